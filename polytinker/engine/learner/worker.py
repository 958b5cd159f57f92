"""The learner worker: one learner group behind the scheduler.

It holds every LoRA job's adapter on one base model (``MultiAdapterLearner``; K data-parallel
replicas through ``LearnerGroup`` when ``world_size > 1``) and, for a full-parameter job, a
``FullParamLearner`` over its own copy of the weights (the policy gives such a job the group to
itself). With K replicas the processes belong to one torch.distributed group, so they hold either
the adapters or one full-parameter job's model: a full-parameter job's first call turns the
replicas into its model, and the next LoRA call turns them back (the adapters reload from their
checkpoints; a gradient held across the switch is gone, and the step that needed it is refused
with ``GradientLost``). Requests arrive one at a time (one handler thread), so two jobs' calls
never interleave inside the model. A group whose follower exits is broken for good: its calls
answer ``WorkerFailed`` and ``on_broken`` tells whoever runs this worker (``WorkerProcess``), which
ends the process so that its supervisor starts the worker anew; the scheduler then treats it as
a restarted learner (above and below).

``sched.w.step`` steps and then writes the new version's checkpoint (and the peft directory the
engines load) before it answers: the scheduler records the version only once it is on disk.
Every path is the worker's own, made from the adapter key, version and name under its state root
(``layout``): a message names weights by ids (``WeightsRef``), never by path.

Idempotent training calls. ``sched.w.fb`` and ``sched.w.step`` carry a ``request_id`` that is the
same on every resend of one call (the client makes it; the scheduler makes one for clients that do
not). With the adapter it is the idempotency key: a worker that gets a key it already ran answers
the first result and runs nothing, so a resend to a worker wrongly declared dead (it missed its
heartbeats but ran the call) never applies a gradient or a step twice. A step's key is also written
next to its checkpoint (``request.json``): a replacement process that gets the resend of a step
its predecessor finished loads that checkpoint and answers the same version, so a completed step is
not lost; a resent step this process holds no gradient for is refused (``GradientLost``) instead of
stepping on nothing. A step also carries ``expected_fb``, the number of the step's
``forward_backward`` calls the scheduler saw answered: a process holding another number (it
restarted between them) drops what it holds and refuses the step, even on its first send.

What a message carries is checked against this worker's model before the model sees it (the
scheduler's token admits the sender, not the sizes and values it sends): every learner call
checks its datums first (``checks``), so a token id outside the vocabulary, a non-finite weight,
advantage or logprob, or a missing loss input is refused with a ``ConfigError`` naming the datum
and field. A loss or gradient that still comes out
non-finite is never applied (``guard``): the call or the step is refused and the adapter's state
stays as it was; a refused step's gradient is dropped, so the step's calls are made again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polytinker.engine.device import resolve_device, resolve_dtype
from polytinker.engine.learner.checks import NonFinite
from polytinker.engine.learner.follower import FollowersKind
from polytinker.engine.models import ModelConfig, load_model
from polytinker.engine.types import DEFAULT_TARGET_MODULES, AdapterRef, LoraConfig
from polytinker.engine.worker.config import LearnerWorkerConfig
from polytinker.engine.worker.layout import under
from polytinker.engine.worker.messages import (
    EnsureAdapter,
    LearnerAdapterWeights,
    LearnerExport,
    LearnerForward,
    LearnerForwardBackward,
    LearnerForwardBackwardMany,
    LearnerLoad,
    LearnerSave,
    LearnerStep,
    WeightsRef,
    WorkerStats,
)
from polytinker.engine.worker.replies import (
    AdapterTensors,
    ExportedWeights,
    ForwardBackwardManyReply,
    ForwardBackwardReply,
    ForwardReply,
    SavedCheckpoint,
    StepResult,
    WorkerVersion,
)
from polytinker.errors import ConfigError, GradientLost, ModelError, NotResident
from polytinker.transport.messages import to_fields
from polytinker.transport.requests import handler_table

log = logging.getLogger("polytinker.engine.learner.worker")

REQUEST_FILE = "request.json"  # in a step's checkpoint directory: the key of the call that made it
MAX_REMEMBERED = 1024  # keyed results kept in memory (the newest)


class LearnerWorker:
    """Handlers for the scheduler: ensure, fb, forward, step, save, load, export, stats."""

    def __init__(
        self,
        model: str,
        cfg: LearnerWorkerConfig,
        root: str | os.PathLike[str],
        on_broken: Callable[[str], None] | None = None,
        followers: FollowersKind = "local",
    ) -> None:
        self.model, self.cfg = model, cfg
        self._on_broken = on_broken  # a group of K > 1 lost a rank (LearnerGroup.start): the process should end
        self._followers = followers  # how its group's ranks 1..K-1 start: "local" processes or "ray" actors
        self.root = Path(root)  # every checkpoint and export this worker writes or reads is under it
        self._lora: Any = None  # the LearnerGroup of every LoRA adapter (None while a full model holds the replicas)
        self._full: dict[str, Any] = {}  # the full-parameter job served -> its own model's LearnerGroup (one)
        self._lora_group()
        self.stats = {
            "forward_backward": 0,
            "batched_forward_backward": 0,
            "optim_steps": 0,
            "loads": 0,
            "adapters_created": 0,
            "duplicates": 0,
            "adapters_sent": 0,  # versions sent as tensors to engines that could not read them
        }
        # Keyed calls: (adapter, request_id) -> ("fb" | "step", result), newest last.
        self._done: OrderedDict[tuple[str, str], tuple[str, Any]] = OrderedDict()
        self._fb_since_step: dict[str, int] = {}  # forward_backward calls held in each adapter's gradient
        self._keyed = threading.Lock()  # one keyed call at a time: a duplicate waits for the first

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return handler_table(
            {
                EnsureAdapter: self.ensure,
                LearnerForwardBackward: self.forward_backward,
                LearnerForwardBackwardMany: self.forward_backward_many,
                LearnerForward: self.forward,
                LearnerStep: self.step,
                LearnerSave: self.save,
                LearnerLoad: self.load,
                LearnerExport: self.export,
                LearnerAdapterWeights: self.adapter_weights,
                WorkerStats: self.get_stats,
            }
        )

    def close(self) -> None:
        self._close_full()
        self._close_lora()

    # --- slots -------------------------------------------------------------------------------------
    def _start(self, mode: str) -> Any:
        """A learner group of ``world_size`` replicas in ``mode`` (one process: no followers)."""
        # torch, transformers and peft load when the group starts: the scheduler reads this module.
        from polytinker.engine.learner import DistInfo, LearnerConfig, make_learner
        from polytinker.engine.learner.group import LearnerGroup

        lcfg = LearnerConfig(
            mode=mode,  # type: ignore[arg-type]
            micro_batch_size=self.cfg.micro_batch_size,
            max_tokens_per_pass=self.cfg.max_tokens_per_pass,
            full_sharding=self.cfg.full_sharding,  # type: ignore[arg-type]
        )
        # ConfigError before any model loads. On Ray each rank sees its own bundle's GPUs only.
        device = resolve_device(self.cfg.device, 1 if self._followers == "ray" else self.cfg.world_size)
        dtype = resolve_dtype(self.cfg.dtype, device)
        if self.cfg.world_size > 1:
            return LearnerGroup.start(
                self.model,
                self.cfg.world_size,
                lcfg,
                device=str(device),
                dtype=dtype,
                name=self.cfg.learner_id,
                on_broken=self._on_broken,
                followers=self._followers,
            )
        base, tokenizer = load_model(self.model, ModelConfig(dtype=dtype))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
        return LearnerGroup(make_learner(base, lcfg, info, pad_token_id=int(pad)), info)

    def _lora_group(self) -> Any:
        if self._lora is None:
            if self.cfg.world_size > 1:
                self._close_full()  # the replicas go back to the shared base model
            self._lora = self._start("lora")
        return self._lora

    def _full_group(self, adapter: str) -> Any:
        group = self._full.get(adapter)
        if group is None:
            # The policy gives a full-parameter job the learner group to itself, so the model of
            # an earlier one goes (it reloads from its checkpoint if that job comes back): a
            # worker holds one full model, not one per job it ever served.
            self._close_full()
            if self.cfg.world_size > 1:
                # A process belongs to one torch.distributed group, so the replicas become this
                # job's model; the adapters come back from their checkpoints with LoRA work.
                self._close_lora()
            group = self._full[adapter] = self._start("full")
            log.info("full-parameter slot %s on %d replica(s)", adapter, self.cfg.world_size)
        return group

    def _close_lora(self) -> None:
        if self._lora is not None:
            for name in self._versions():
                self._gradient_gone(name)
            self._lora.close()
            self._lora = None

    def _close_full(self) -> None:
        for adapter, group in list(self._full.items()):
            self._gradient_gone(adapter)
            group.close()
            del self._full[adapter]

    def _slot(self, adapter: str, full: bool) -> tuple[Any, str | None]:
        """The group holding the adapter's weights, and its name there (None: the group's whole
        model). Only ``ensure`` loads: a slot that is not resident is never made up here (a fresh
        model would silently stand in for a job's trained weights)."""
        if full and adapter in self._full:
            return self._full[adapter], None
        if not full and adapter in self._versions():
            return self._lora, adapter
        raise NotResident(f"{'full-parameter model' if full else 'adapter'} {adapter} is not resident on this learner")

    def _path(self, weights: WeightsRef) -> Path:
        return under(self.root, weights.relative_path)

    def _checkpoint(self, weights: WeightsRef) -> Path:
        """Where the checkpoint ``ensure`` loads is; ModelError when it is not on this disk."""
        path = self._path(weights)
        if not path.is_dir():
            raise ModelError(
                f"adapter {weights.adapter} v{weights.version}: its checkpoint is not on this learner's disk "
                "(a learner started on another machine reads the checkpoints of the one before it only from "
                "a state_dir they share)"
            )
        return path

    def _versions(self) -> dict[str, int]:
        """LoRA adapters resident, with their versions."""
        return {} if self._lora is None else {r.name: r.version for r in self._lora.adapters()}

    def ensure(self, msg: EnsureAdapter) -> WorkerVersion:
        """Make the slot resident at ``msg.version``; reloads from the checkpoint when it differs."""
        if msg.full:
            group = self._full_group(msg.adapter)
            if self._version(msg.adapter, True) != msg.version:
                if not msg.checkpoint:
                    raise ConfigError(f"full-parameter slot {msg.adapter} needs a checkpoint for v{msg.version}")
                group.load_state(self._checkpoint(msg.checkpoint), None)
                self._gradient_gone(msg.adapter)
                self.stats["loads"] += 1
                return WorkerVersion(self._version(msg.adapter, True), loaded=True)
            return WorkerVersion(self._version(msg.adapter, True))
        lora = self._lora_group()
        have = self._versions().get(msg.adapter)
        if have == msg.version:
            return WorkerVersion(have)
        self._gradient_gone(msg.adapter)
        if msg.checkpoint:
            ref = lora.load_state(self._checkpoint(msg.checkpoint), msg.adapter)
            self.stats["loads"] += 1
            return WorkerVersion(ref.version, loaded=True)
        if msg.version != 0:
            raise ConfigError(f"adapter {msg.adapter} v{msg.version} has no checkpoint to load")
        if have is not None:
            lora.remove_adapter(msg.adapter)

        shape = LoraConfig(
            rank=msg.rank, alpha=msg.alpha, target_modules=tuple(msg.target_modules) or DEFAULT_TARGET_MODULES
        )
        lora.add_adapter(msg.adapter, shape, msg.seed)
        self.stats["adapters_created"] += 1
        return WorkerVersion(0)

    # --- idempotency ------------------------------------------------------------------------------
    def _remember(self, adapter: str, request_id: str, kind: str, result: Any) -> None:
        if not request_id:
            return
        self._done[(adapter, request_id)] = (kind, result)
        while len(self._done) > MAX_REMEMBERED:
            self._done.popitem(last=False)

    def _duplicate(self, adapter: str, request_id: str, kind: str) -> Any:
        found = self._done.get((adapter, request_id)) if request_id else None
        if found is None:
            return None
        if found[0] != kind:
            raise ConfigError(f"request id {request_id} of {adapter} was already used by a {found[0]} call")
        self.stats["duplicates"] += 1
        log.info("%s %s of %s is a resend: answering its first result", kind, request_id, adapter)
        return found[1]

    def _gradient_gone(self, adapter: str) -> None:
        """The gradient the adapter's forward_backward calls left is gone (a step spent it, or the
        adapter's state was replaced), and so are their remembered results."""
        self._fb_since_step.pop(adapter, None)
        for key in [k for k, (kind, _) in self._done.items() if k[0] == adapter and kind == "fb"]:
            del self._done[key]

    def _discard(self, adapter: str, full: bool) -> None:
        group, name = self._slot(adapter, full)
        group.discard_gradient(name)
        self._gradient_gone(adapter)

    def _version(self, adapter: str, full: bool) -> int | None:
        if full:
            group = self._full.get(adapter)
            return None if group is None else int(group.adapters()[0].version)
        return self._versions().get(adapter)

    def _restore(self, adapter: str, full: bool, result: StepResult) -> None:
        """Put the adapter back at the version a step made (something reloaded an older one since)."""
        if self._version(adapter, full) == result.version:
            return
        self._gradient_gone(adapter)
        group, name = self._slot(adapter, full)
        group.load_state(self._path(WeightsRef(adapter, result.version)), name)
        self.stats["loads"] += 1

    def _recorded_step(self, msg: LearnerStep) -> StepResult | None:
        """The result an earlier process wrote for this step's key next to its checkpoint, if any."""
        if not msg.request_id or msg.from_version < 0:
            return None
        path = self._path(WeightsRef(msg.adapter, msg.from_version + 1)) / REQUEST_FILE
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("request_id") != msg.request_id:
            return None
        result = record.get("result")
        try:
            return StepResult(**result) if isinstance(result, dict) else None
        except TypeError:  # not the fields a step result has: not a record this worker can answer from
            return None

    # --- training --------------------------------------------------------------------------------
    def forward_backward(self, msg: LearnerForwardBackward) -> ForwardBackwardReply:
        with self._keyed:
            first = self._duplicate(msg.adapter, msg.request_id, "fb")
            if first is not None:
                return first
            group, name = self._slot(msg.adapter, msg.full)
            r = group.forward_backward(list(msg.data), msg.loss_fn, name, msg.loss_fn_config)
            self.stats["forward_backward"] += 1
            self._fb_since_step[msg.adapter] = self._fb_since_step.get(msg.adapter, 0) + 1
            result = ForwardBackwardReply(r.loss, r.logprobs, r.metrics)
            self._remember(msg.adapter, msg.request_id, "fb", result)
            return result

    def forward_backward_many(self, msg: LearnerForwardBackwardMany) -> ForwardBackwardManyReply:
        """The items' calls in shared passes over their adapters (``forward_backward_many``): each
        adapter's gradient, result and count are what its own ``forward_backward`` would leave. An
        item this worker already ran (a resend) answers its first result and runs nothing. All or
        nothing: when one item is refused or fails, no item's gradient is kept or its result
        remembered, and the error names the items at fault, so each call can be sent alone."""
        with self._keyed:
            results: list[ForwardBackwardReply | None] = [
                self._duplicate(i.adapter, i.request_id, "fb") for i in msg.items
            ]
            todo = [i for i, r in zip(msg.items, results, strict=True) if r is None]
            if todo:
                for item in todo:
                    self._slot(item.adapter, False)  # NotResident before any work: the broker prepares again
                first = todo[0]
                many = self._lora.forward_backward_many(
                    {i.adapter: list(i.data) for i in todo}, first.loss_fn, first.loss_fn_config
                )
                for item in todo:
                    r = many[item.adapter]
                    reply = ForwardBackwardReply(r.loss, r.logprobs, r.metrics)
                    self.stats["forward_backward"] += 1
                    self.stats["batched_forward_backward"] += 1
                    self._fb_since_step[item.adapter] = self._fb_since_step.get(item.adapter, 0) + 1
                    self._remember(item.adapter, item.request_id, "fb", reply)
                    results[msg.items.index(item)] = reply
            return ForwardBackwardManyReply(tuple(r for r in results if r is not None))

    def forward(self, msg: LearnerForward) -> ForwardReply:
        group, name = self._slot(msg.adapter, msg.full)
        if not msg.loss_fn:
            return ForwardReply(group.forward(list(msg.data), name))
        out = group.forward_loss(list(msg.data), msg.loss_fn, name, msg.loss_fn_config)
        return ForwardReply(out.logprobs, out.loss, out.metrics)

    def step(self, msg: LearnerStep) -> StepResult:
        with self._keyed:
            first = self._duplicate(msg.adapter, msg.request_id, "step")
            if first is None and (first := self._recorded_step(msg)) is not None:
                self.stats["duplicates"] += 1
                log.info("step %s of %s was taken by an earlier process: answering it", msg.request_id, msg.adapter)
                self._remember(msg.adapter, msg.request_id, "step", first)
            if first is not None:
                self._restore(msg.adapter, msg.full, first)
                return first
            held = self._fb_since_step.get(msg.adapter, 0)
            if msg.expected_fb >= 0 and held != msg.expected_fb:
                # A learner restarted between the step's calls: stepping on what this process holds
                # would apply part of the step's gradient, or none, as if it were all of it.
                self._discard(msg.adapter, msg.full)
                raise GradientLost(
                    f"optim_step {msg.request_id} of {msg.adapter}: this learner holds {held} of the step's"
                    f" {msg.expected_fb} forward_backward calls (the process that took the others is gone):"
                    " redo this step's calls"
                )
            if msg.attempt > 0 and not held:
                raise GradientLost(
                    f"optim_step {msg.request_id} of {msg.adapter} was resent to a learner that holds no gradient"
                    " for it (the process that took its forward_backward calls is gone): redo this step's calls"
                )
            try:
                result = self._step(msg)
            except NonFinite:
                self._gradient_gone(msg.adapter)  # the learner dropped the gradient it refused to step on
                raise
            self._gradient_gone(msg.adapter)  # spent by the step: a late resend of a call belongs to no step
            self._remember(msg.adapter, msg.request_id, "step", result)
            if msg.request_id:
                record = self._path(WeightsRef(msg.adapter, result.version)) / REQUEST_FILE
                tmp = record.with_suffix(".tmp")
                tmp.write_text(json.dumps({"request_id": msg.request_id, "result": to_fields(result)}))
                os.replace(tmp, record)
            return result

    def _step(self, msg: LearnerStep) -> StepResult:
        group, name = self._slot(msg.adapter, msg.full)
        ref = group.optim_step(msg.adam, name)
        ckpt = WeightsRef(msg.adapter, ref.version)
        group.save_state(self._path(ckpt), name)
        export = ""
        if msg.export and msg.full:
            # An engine serves a full-parameter version from its checkpoint's weights file: writing
            # the whole model a second time every step would double the disk traffic.
            export = ckpt.relative_path
        elif msg.export:
            export = self._export(WeightsRef(msg.adapter, ref.version, "export"))
        self.stats["optim_steps"] += 1
        metrics = dict(getattr(group.learner, "last_step_metrics", {}) or {})
        return StepResult(ref.version, ckpt.relative_path, export, metrics)

    def _export(self, weights: WeightsRef) -> str:
        group, _ = self._slot(weights.adapter, False)
        group.learner.export_adapter_dir(weights.adapter, self._path(weights))
        return weights.relative_path

    def save(self, msg: LearnerSave) -> SavedCheckpoint:
        group, name = self._slot(msg.adapter, msg.full)
        version = self._version(msg.adapter, msg.full)
        assert version is not None  # resident: _slot found it
        ckpt = WeightsRef(msg.adapter, version, "checkpoint", msg.name)
        group.save_state(self._path(ckpt), name)
        return SavedCheckpoint(ckpt.relative_path, version)

    def load(self, msg: LearnerLoad) -> WorkerVersion:
        self._gradient_gone(msg.adapter)
        group, name = self._slot(msg.adapter, msg.full)
        return WorkerVersion(group.load_state(self._path(msg.checkpoint), name, optimizer=msg.optimizer).version)

    def export(self, msg: LearnerExport) -> ExportedWeights:
        group, _ = self._slot(msg.adapter, msg.full)  # NotResident first: the broker prepares it again
        have = self._version(msg.adapter, msg.full)
        if have != msg.version:
            raise ConfigError(f"export of {msg.adapter} v{msg.version}: this learner holds v{have}")
        if msg.full:  # the weights as a checkpoint, which is what an engine loads a full version from
            ckpt = WeightsRef(msg.adapter, msg.version)
            group.save_state(self._path(ckpt), None)
            return ExportedWeights(ckpt.relative_path)
        return ExportedWeights(self._export(WeightsRef(msg.adapter, msg.version, "export", msg.loaded_from)))

    def adapter_weights(self, msg: LearnerAdapterWeights) -> AdapterTensors:
        """An export's tensors for an engine that cannot read them: the resident version from
        memory (no disk), an older one from this learner's own copy."""
        # safetensors loads only where an older export is read back.
        from polytinker.engine.inference.adapter_io import read_adapter_dir

        w = msg.weights
        if not w.name and self._versions().get(w.adapter) == w.version:
            weights = self._lora.export_adapter(w.adapter)
        else:
            weights = read_adapter_dir(AdapterRef(w.adapter, w.version), self._path(w))
        self.stats["adapters_sent"] += 1
        return AdapterTensors.of(weights)

    def get_stats(self, _msg: WorkerStats) -> dict[str, Any]:
        return {**self.stats, "adapters": len(self._versions()), "full_slots": len(self._full), "pid": os.getpid()}


__all__ = ["LearnerWorker"]
