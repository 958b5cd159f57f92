"""One base model, many LoRA adapters, each with its own AdamW (``MultiAdapterLearner``).

The adapters live in one peft model. peft's ``set_adapter`` makes one adapter active and flips
``requires_grad`` so only that adapter's parameters take gradients; the base weights stay frozen
and are never handed to an optimizer, so stepping adapter A changes neither adapter B nor the base.
The KL reference and ``adapter=None`` requests run the same weights under
``disable_adapter()``: no second copy of the model.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from torch import nn

from polytinker.engine.adapter_weights import AdapterWeights, TensorLayout
from polytinker.engine.learner._base import ForwardBackwardResult, Learner, Slot, _metrics, _Sums, new_adamw
from polytinker.engine.learner.checks import check_data
from polytinker.engine.learner.config import LearnerConfig, LossConfig
from polytinker.engine.learner.distributed import SINGLE, DistInfo, broadcast_
from polytinker.engine.learner.losses import collate, kl_to_reference, policy_loss
from polytinker.engine.learner.scoring import plan_micro_batches
from polytinker.engine.learner.snapshots import SnapshotBuffers
from polytinker.engine.learner.state import Checkpoint, load_checkpoint, save_checkpoint, write_atomic_dir
from polytinker.engine.types import AdapterName, AdapterRef, Datum, LoraConfig, LossFnName
from polytinker.errors import ConfigError


def to_peft_config(lora: LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _is_param_of(param_name: str, adapter: str) -> bool:
    # peft names adapter tensors "...<module>.lora_A.<adapter>.weight".
    parts = param_name.split(".")
    return any(parts[i].startswith("lora_") and parts[i + 1] == adapter for i in range(len(parts) - 1))


def _peft_key(param_name: str, adapter: str) -> str:
    parts = param_name.split(".")
    for i in range(len(parts) - 1):
        if parts[i].startswith("lora_") and parts[i + 1] == adapter:
            return ".".join(parts[: i + 1] + parts[i + 2 :])
    raise ConfigError(f"{param_name} is not a tensor of adapter {adapter!r}")


def _pack_params(params: dict[str, nn.Parameter], adapter: str) -> tuple[torch.Tensor, TensorLayout, tuple[str, ...]]:
    """Move ``params`` into one flat buffer and make each a view of it (optimizer steps,
    checkpoint loads and broadcasts write parameters in place, so the views hold; ``_aliases``
    checks). Keys are peft's: the parameter name without the adapter name. The buffer holds the
    parameters ordered by shape, so an engine makes its views of a version in a few runs
    (``TensorLayout.split``); returned with the parameters' names in that order."""
    if len({p.dtype for p in params.values()}) != 1:
        raise ConfigError(f"adapter {adapter!r}: its LoRA parameters differ in dtype; one flat buffer needs one")
    ordered = sorted(params.items(), key=lambda item: tuple(item[1].shape))  # stable: peft's order within a shape
    layout = TensorLayout.of_shapes([_peft_key(k, adapter) for k, _ in ordered], [p.shape for _, p in ordered])
    flat = layout.pack({_peft_key(k, adapter): p.detach() for k, p in ordered})
    for (_, p), view in zip(ordered, layout.split(flat).values(), strict=True):
        p.data = view
    return flat, layout, tuple(k for k, _ in ordered)


def _aliases(params: dict[str, nn.Parameter], order: tuple[str, ...], flat: torch.Tensor, layout: TensorLayout) -> bool:
    """Whether every parameter (named in ``layout``'s ``order``) is still its view of ``flat``
    (``p.data = ...`` or ``module.to`` would have given it storage of its own). One C-level
    pass: it runs with every export."""
    base, size = flat.data_ptr(), flat.element_size()
    ptrs = list(map(torch.Tensor.data_ptr, map(params.__getitem__, order)))
    return ptrs == [base + off * size for off in layout.offsets]


@contextlib.contextmanager
def _adapters_off(layers: Sequence[Any]) -> Iterator[None]:
    """The base model alone in the body. Each LoRA layer's public ``enable_adapters`` toggle:
    ``PeftModel.disable_adapter`` does the same plus a walk over the whole model's status that
    cost a third of a small forward_backward here. Leaving makes peft's active adapter trainable
    again and every other adapter frozen (``set_adapter``)."""
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@contextlib.contextmanager
def _per_row_adapters(layers: Sequence[Any], names: list[str]) -> Iterator[None]:
    """Row ``i`` of every batch in the body runs adapter ``names[i]``; call it with peft's own
    LoRA path off (``_adapters_off``).

    peft's own mixed batches gather and scatter each adapter's rows by index in every LoRA layer;
    on a CPU that indexing cost as much as the matmuls. Here each run of consecutive rows of one
    adapter is a ``split`` view and the adapters' deltas are one ``cat`` (both cheap, forward and
    backward), added to the base layer's output by a forward hook. Callers keep each adapter's
    rows together.
    """
    runs = [(name, len(list(rows))) for name, rows in itertools.groupby(names)]
    sizes = [n for _, n in runs]

    def add_deltas(layer: Any, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if x.shape[0] != len(names):
            raise ConfigError(f"per-row adapters for {len(names)} rows, got a batch of {x.shape[0]}")
        deltas = []
        for (name, _), x_part in zip(runs, x.split(sizes), strict=True):
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            h = layer.lora_dropout[name](x_part.to(lora_a.weight.dtype))
            # Scaled at rank width (rows x r), not at the output's (rows x out): the same delta, a
            # smaller multiply, forward and backward.
            deltas.append(lora_b(lora_a(h) * layer.scaling[name]))
        return out + torch.cat(deltas).to(out.dtype)

    with contextlib.ExitStack() as stack:
        for layer in layers:
            stack.callback(layer.register_forward_hook(add_deltas).remove)
        yield


class MultiAdapterLearner(Learner):
    """A learner for many LoRA adapters over one frozen base model."""

    def __init__(
        self, model: nn.Module, config: LearnerConfig | None = None, dist: DistInfo = SINGLE, pad_token_id: int = 0
    ):
        config = config or LearnerConfig()
        if config.mode != "lora":
            raise ConfigError("MultiAdapterLearner needs LearnerConfig(mode='lora'); use FullParamLearner otherwise")
        super().__init__(model, config, dist, pad_token_id)
        for p in self.base_model.parameters():
            p.requires_grad_(False)
        self.peft_model: PeftModel | None = None
        self._slots: dict[AdapterName, Slot] = {}
        self._lora: dict[AdapterName, LoraConfig] = {}
        self._layers: list[Any] | None = None  # peft's LoRA layers, found once per adapter set
        # Per adapter: one flat buffer its parameters are views of, their peft keys and shapes in
        # that buffer, and the parameters' names in that order (export copies the buffer in one op:
        # _pack_params).
        self._packed: dict[AdapterName, tuple[torch.Tensor, TensorLayout, tuple[str, ...]]] = {}
        self._snapshots = SnapshotBuffers()  # export_adapter's host buffers, reused once released
        self._rows_mode = False  # inside forward_backward_many: peft's LoRA path off, hooks add the deltas

    # -- adapters -------------------------------------------------------------------------------
    def add_adapter(self, name: AdapterName, lora: LoraConfig | None = None, seed: int = 0) -> AdapterRef:
        """Create adapter ``name`` at version 0 (B = 0, so it starts equal to the base model)."""
        lora = lora or LoraConfig()
        AdapterRef(name)  # validates the name
        if name in self._slots:
            raise ConfigError(f"adapter {name!r} already exists; remove_adapter it first or pick another name")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self.peft_model is None:
                self.peft_model = get_peft_model(self.base_model, to_peft_config(lora), adapter_name=name)  # type: ignore[arg-type]
            else:
                self.peft_model.add_adapter(name, to_peft_config(lora))
        # eval(): new LoRA modules start in training mode; the learner never uses dropout (replicas
        # must agree bit for bit), and peft only serves per-row adapter_names in eval mode.
        self.peft_model.eval()
        params = {n: p for n, p in self.peft_model.named_parameters() if _is_param_of(n, name)}
        if not params:
            raise ConfigError(f"LoraConfig.target_modules {lora.target_modules} match no module of this model")
        self._layers = None
        self._packed[name] = _pack_params(params, name)
        broadcast_([self._packed[name][0]])  # data-parallel ranks start from rank 0's initialisation
        self._slots[name] = Slot(name, params)
        self._lora[name] = lora
        return AdapterRef(name, 0)

    def remove_adapter(self, name: AdapterName) -> None:
        self._slot(name)
        assert self.peft_model is not None
        self.peft_model.delete_adapter(name)
        self._layers = None
        del self._slots[name], self._lora[name], self._packed[name]

    def adapters(self) -> list[AdapterRef]:
        return [slot.ref() for slot in self._slots.values()]

    def export_adapter(self, name: AdapterName) -> AdapterWeights:
        """A snapshot of the adapter's current version on the CPU, keyed as peft saves it: one
        copy of its flat buffer into host memory no earlier snapshot still uses (``snapshots``)."""
        slot = self._slot(name)
        flat, layout, order = self._packed[name]
        if not _aliases(slot.params, order, flat, layout):
            flat, layout, _ = self._packed[name] = _pack_params(slot.params, name)
        snapshot = self._snapshots.take(flat.numel(), flat.dtype)
        with torch.no_grad():
            snapshot.copy_(flat)
        return AdapterWeights(slot.ref(), self._lora[name], snapshot, layout)

    def export_adapter_dir(self, name: AdapterName, path: str | os.PathLike[str]) -> Path:
        """Write the adapter in peft's directory format (what vLLM's LoRARequest loads), atomically."""
        weights = self.export_adapter(name)
        assert self.peft_model is not None
        peft_cfg = self.peft_model.peft_config[name]

        def write(tmp: Path) -> None:
            save_file(weights.tensors, str(tmp / "adapter_model.safetensors"))
            peft_cfg.save_pretrained(str(tmp))

        return write_atomic_dir(path, write)

    def forward_backward_many(
        self,
        data_by_adapter: dict[AdapterName, list[Datum]],
        loss_fn: LossFnName,
        loss_fn_config: dict[str, float] | None = None,
    ) -> dict[AdapterName, ForwardBackwardResult]:
        """``forward_backward`` for several adapters in shared passes: each micro-batch may mix
        adapters (``_per_row_adapters``), so the base model's matmuls see one larger batch.
        Gradients and results are the same as one call per adapter.

        All or nothing: when one adapter's data is refused, its loss or gradient is not finite,
        or the pass fails, no adapter's gradient changes and the call raises, naming each adapter
        at fault; each call sent alone then gets its own answer. A row's computation never reads
        another row's (each LoRA delta is taken on its own adapter's rows), so a NaN in one
        adapter's rows does not reach the others' losses or gradients, and the check names the
        culprit alone."""
        what = {name: f"forward_backward of adapter {name!r}" for name in data_by_adapter}
        with self._all_or_nothing() as guard:
            for name, data in data_by_adapter.items():
                check_data(data, self.vocab_size, loss_fn, where=f"adapter {name!r}")
            loss_cfg = LossConfig.from_mapping(loss_fn_config)
            kl_coef = self.config.kl_coef if loss_cfg.kl_coef is None else loss_cfg.kl_coef
            slots = {name: self._slot(name) for name in data_by_adapter}
            for slot in slots.values():
                guard.hold(slot.name, list(slot.params.values()))
            sums = self._mixed_passes(data_by_adapter, loss_fn, loss_cfg, kl_coef)
            losses = {name: (what[name], acc.values["loss"]) for name, acc in sums.items()}
            guard.finish(losses, kept="no adapter's gradient of this batch was accumulated")
        results = {}
        for name, acc in sums.items():
            slots[name].pending_tokens += acc.values["tokens"]
            results[name] = ForwardBackwardResult(
                acc.values["loss"], acc.logprobs, _metrics(loss_fn, kl_coef, acc.values)
            )
        return results

    def _mixed_passes(
        self,
        data_by_adapter: dict[AdapterName, list[Datum]],
        loss_fn: LossFnName,
        loss_cfg: LossConfig,
        kl_coef: float,
    ) -> dict[AdapterName, _Sums]:
        """``forward_backward_many``'s passes, each adapter's gradient into its parameters' ``.grad``."""
        rows = [(name, d) for name, data in data_by_adapter.items() for d in data]
        sums = {name: _Sums() for name in data_by_adapter}
        index_in_adapter: list[int] = []  # each row's index within its adapter's list
        seen: dict[AdapterName, int] = {}
        for name, _ in rows:
            index_in_adapter.append(seen.get(name, 0))
            seen[name] = index_in_adapter[-1] + 1
        position = {name: i for i, name in enumerate(data_by_adapter)}
        # peft's LoRA path stays off for the whole call (each switch walks every layer): the
        # reference is the base model as it stands, and hooks add each row's own adapter.
        with _adapters_off(self._lora_layers()), self._per_row_mode():
            for name in data_by_adapter:  # switching off froze every adapter: these train
                for p in self._slots[name].params.values():
                    p.requires_grad_(True)
            for order in self._mixed_chunks(rows):
                # Each adapter's rows together: one run per adapter in every LoRA layer.
                order.sort(key=lambda i: position[rows[i][0]])
                chunk = [rows[i] for i in order]
                names = [name for name, _ in chunk]
                batch = collate([d for _, d in chunk], pad_token_id=self.pad_token_id, device=self.dist.device)
                row_index = [index_in_adapter[i] for i in order]
                self._mixed_micro_batch(batch, names, row_index, loss_fn, loss_cfg, kl_coef, sums)
        return sums

    def _mixed_chunks(self, rows: list[tuple[AdapterName, Datum]]) -> list[list[int]]:
        """Micro-batches of ``forward_backward_many``. Adapters' rows mix where that costs nothing,
        but never at the price of a shared prompt prefix (``plan_micro_batches``): mixing an
        agent's short prompts with another's long ones padded every row to the longest and ran
        every prompt in full, 4x the time and 3x the memory of one call per adapter (measured on
        a solver and a verifier's GRPO groups)."""
        if not self.config.share_prefix:
            return [order for order, _ in self._chunks(rows) if order is not None]
        cfg = self.config
        return plan_micro_batches([(n, d.input_tokens) for n, d in rows], cfg.micro_batch_size, cfg.max_tokens_per_pass)

    def _mixed_micro_batch(
        self,
        batch: Any,
        names: list[AdapterName],
        row_index: list[int],
        loss_fn: LossFnName,
        loss_cfg: LossConfig,
        kl_coef: float,
        sums: dict[AdapterName, _Sums],
    ) -> None:
        """One micro-batch of ``forward_backward_many``: row ``i`` is row ``row_index[i]`` of
        adapter ``names[i]``; each adapter's loss is its own, the backward one pass."""
        if kl_coef > 0:
            with torch.inference_mode():
                ref_BT = self._logprobs(batch)  # no per-row hooks: the base model
            ref_BT = ref_BT.clone()  # a normal tensor: autograd may save it
        logprobs_BT = self._logprobs(batch, grad_BT=batch.weights_BT != 0, adapter_names=names)
        total = logprobs_BT.new_zeros(())
        for name in dict.fromkeys(names):
            index_R = [i for i, n in enumerate(names) if n == name]
            sub = batch.rows(index_R)
            sub_logprobs_BT = logprobs_BT[index_R]
            loss, extra = policy_loss(loss_fn, sub_logprobs_BT, sub, loss_cfg)
            kl = kl_to_reference(sub_logprobs_BT, ref_BT[index_R], sub.weights_BT) if kl_coef > 0 else None
            if kl is not None:
                loss = loss + kl_coef * kl
            total = total + loss
            sums[name].add(loss, kl, sub, extra, sub_logprobs_BT, [row_index[i] for i in index_R])
        if total.requires_grad:  # False when no position of the micro-batch has weight
            total.backward()

    @contextlib.contextmanager
    def _per_row_mode(self) -> Iterator[None]:
        self._rows_mode = True
        try:
            yield
        finally:
            self._rows_mode = False

    # -- state ----------------------------------------------------------------------------------
    def save_state(self, path: str | os.PathLike[str], adapter: AdapterName | None = None) -> Path:
        slot = self._slot(adapter)
        lora = self._lora[slot.name]
        meta = {
            "mode": "lora",
            "adapter": slot.name,
            "version": slot.version,
            "lora": {
                "rank": lora.rank,
                "alpha": lora.alpha,
                "target_modules": list(lora.target_modules),
                "dropout": lora.dropout,
            },
        }
        opt_state = slot.optimizer.state_dict() if slot.optimizer is not None else None
        return save_checkpoint(path, Checkpoint(self.export_adapter(slot.name).tensors, opt_state, meta))

    def load_state(
        self, path: str | os.PathLike[str], adapter: AdapterName | None = None, *, optimizer: bool = True
    ) -> AdapterRef:
        """Restore weights, optimizer (unless ``optimizer=False``) and version into ``adapter``
        (created if missing); drops pending grads."""
        if adapter is None:
            raise ConfigError("load_state on a LoRA learner needs adapter=<name> to load into")
        ckpt = load_checkpoint(path)
        if ckpt.meta.get("mode") != "lora":
            raise ConfigError(f"{path} holds a {ckpt.meta.get('mode')!r} checkpoint, not a LoRA adapter")
        lora_meta = ckpt.meta["lora"]
        lora = LoraConfig(
            rank=lora_meta["rank"],
            alpha=lora_meta["alpha"],
            target_modules=tuple(lora_meta["target_modules"]),
            dropout=lora_meta.get("dropout", 0.0),
        )
        if adapter not in self._slots:
            self.add_adapter(adapter, lora)
        elif self._lora[adapter] != lora:
            raise ConfigError(f"adapter {adapter!r} has shape {self._lora[adapter]}, the checkpoint {lora}")
        assert self.peft_model is not None
        slot = self._slots[adapter]
        with torch.no_grad():
            result = set_peft_model_state_dict(self.peft_model, ckpt.tensors, adapter_name=adapter)
        missing = [k for k in getattr(result, "missing_keys", []) if _is_param_of(k, adapter)]
        if missing:
            raise ConfigError(f"{path} lacks tensors of adapter {adapter!r}: {missing[:3]}")
        for p in slot.params.values():
            p.grad = None
        slot.optimizer = None
        if optimizer and ckpt.optimizer_state is not None:
            adamw = new_adamw(list(slot.params.values()))
            adamw.load_state_dict(ckpt.optimizer_state)
            slot.optimizer = adamw
        slot.version = int(ckpt.meta["version"])
        slot.pending_tokens = 0.0
        return slot.ref()

    # -- hooks ----------------------------------------------------------------------------------
    def _module(self) -> nn.Module:
        return self.peft_model if self.peft_model is not None else self.base_model

    def _slot(self, adapter: AdapterName | None) -> Slot:
        if adapter is None:
            raise ConfigError("a LoRA learner trains adapters: pass adapter=<name> (add_adapter creates one)")
        if adapter not in self._slots:
            raise ConfigError(f"unknown adapter {adapter!r}; known: {sorted(self._slots)} (add_adapter creates one)")
        return self._slots[adapter]

    @contextlib.contextmanager
    def _selected(self, adapter: AdapterName | None) -> Iterator[None]:
        if adapter is None:
            with self._reference():
                yield
            return
        self._slot(adapter)
        assert self.peft_model is not None
        # set_adapter also sets requires_grad: True on this adapter's tensors, False on the others'.
        self.peft_model.set_adapter(adapter)
        yield

    def _row_context(self, names: Sequence[str] | None) -> contextlib.AbstractContextManager[Any]:
        if names is None or self.peft_model is None:
            return contextlib.nullcontext()
        if not self._rows_mode:
            raise ConfigError("per-row adapters run inside forward_backward_many only")
        return _per_row_adapters(self._lora_layers(), list(names))

    def _lora_layers(self) -> list[Any]:
        if self._layers is None:
            assert self.peft_model is not None
            self._layers = [m for m in self.peft_model.modules() if isinstance(m, LoraLayer)]
        return self._layers

    @contextlib.contextmanager
    def _reference(self) -> Iterator[None]:
        if self.peft_model is None:
            yield
            return
        with _adapters_off(self._lora_layers()):
            yield


__all__ = ["MultiAdapterLearner", "to_peft_config"]
