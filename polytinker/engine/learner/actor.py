"""The learner as a process actor (``LearnerActor``) and its typed client (``LearnerClient``).

The actor holds one :class:`~polytinker.engine.learner.group.LearnerGroup`: with
``world_size=1`` a plain in-process learner, with more it is rank 0 of a data-parallel group
whose followers it spawns. Messages are msgpack maps; the client builds and decodes them, so
callers see the same types as the in-process learner. An exported adapter's tensors cross as
out-of-band frames of :mod:`polytinker.transport.codec` (raw buffers, never pickled).

Kinds: ``add_adapter``, ``remove_adapter``, ``adapters``, ``forward``, ``forward_backward``,
``optim_step``, ``save_state``, ``load_state``, ``export_adapter``.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch

from polytinker.actors import Actor, ActorRef, handler
from polytinker.engine.learner._base import ForwardBackwardResult
from polytinker.engine.learner.config import AdamParams, LearnerConfig
from polytinker.engine.learner.distributed import SINGLE
from polytinker.engine.learner.group import LearnerGroup, _datum_to_wire
from polytinker.engine.types import AdapterName, AdapterRef, AdapterWeights, Datum, LoraConfig, LossFnName
from polytinker.errors import ConfigError
from polytinker.transport.codec import decode, encode


def _ref_to_wire(ref: AdapterRef) -> dict[str, Any]:
    return {"name": ref.name, "version": ref.version}


def _lora_from_wire(obj: dict[str, Any]) -> LoraConfig:
    return LoraConfig(**{**obj, "target_modules": tuple(obj["target_modules"])})


def _data_from_wire(rows: Any) -> list[Datum]:
    if not isinstance(rows, list):
        raise ConfigError("'data' must be a list of [input_tokens, target_tokens_T, weights_T, advantages_T, ...]")
    return [Datum(*row) for row in rows]


class LearnerActor(Actor):
    """A learner (or rank 0 of a learner group) serving Tinker-style calls from its mailbox."""

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        config: dict[str, Any] | None = None,
        world_size: int = 1,
        num_threads: int | None = None,
    ) -> None:
        self._model_spec = model
        self._config = LearnerConfig(**(config or {}))
        self._world_size = world_size
        self._num_threads = num_threads
        self.group: LearnerGroup | None = None

    def on_start(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        if self._world_size > 1:
            self.group = LearnerGroup.start(self._model_spec, self._world_size, self._config)
        else:
            from polytinker.engine.learner import make_learner
            from polytinker.engine.models import load_model

            model, tokenizer = load_model(self._model_spec)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            self.group = LearnerGroup(make_learner(model, self._config, pad_token_id=int(pad)), SINGLE)
        self.log.info("learner ready", extra={"model": self._model_spec, "world_size": self._world_size})

    def on_stop(self) -> None:
        if self.group is not None:
            self.group.close()

    @property
    def _g(self) -> LearnerGroup:
        assert self.group is not None, "on_start has not run"
        return self.group

    @handler("add_adapter")
    def add_adapter(self, msg: dict[str, Any]) -> dict[str, Any]:
        lora = _lora_from_wire(msg["lora"]) if msg.get("lora") else LoraConfig()
        return _ref_to_wire(self._g.add_adapter(msg["name"], lora, int(msg.get("seed", 0))))

    @handler("remove_adapter")
    def remove_adapter(self, name: str) -> None:
        self._g.remove_adapter(name)

    @handler("adapters")
    def adapters(self, _msg: Any) -> list[dict[str, Any]]:
        return [_ref_to_wire(r) for r in self._g.adapters()]

    @handler("forward")
    def forward(self, msg: dict[str, Any]) -> list[list[float]]:
        return self._g.forward(_data_from_wire(msg["data"]), msg.get("adapter"))

    @handler("forward_backward")
    def forward_backward(self, msg: dict[str, Any]) -> dict[str, Any]:
        data = _data_from_wire(msg["data"])
        r = self._g.forward_backward(data, msg["loss_fn"], msg.get("adapter"), msg.get("loss_fn_config"))
        return {"loss": r.loss, "logprobs": r.logprobs, "metrics": r.metrics}

    @handler("optim_step")
    def optim_step(self, msg: dict[str, Any]) -> dict[str, Any]:
        return _ref_to_wire(self._g.optim_step(AdamParams(**msg["adam"]), msg.get("adapter")))

    @handler("save_state")
    def save_state(self, msg: dict[str, Any]) -> str:
        return str(self._g.save_state(msg["path"], msg.get("adapter")))

    @handler("load_state")
    def load_state(self, msg: dict[str, Any]) -> dict[str, Any]:
        return _ref_to_wire(self._g.load_state(msg["path"], msg.get("adapter")))

    @handler("export_adapter")
    def export_adapter(self, name: str) -> list[bytes]:
        w = self._g.export_adapter(name)
        body = {"ref": _ref_to_wire(w.ref), "lora": {**asdict(w.config)}, "tensors": w.tensors}
        # The mailbox carries msgpack; the codec's raw tensor frames ride in it as bin fields.
        return [bytes(frame) for frame in encode(body)]


class LearnerClient:
    """The learner's API over an :class:`ActorRef` to a :class:`LearnerActor`; blocking calls."""

    def __init__(self, ref: ActorRef, timeout_s: float | None = None):
        self.ref = ref
        self.timeout_s = timeout_s

    def _ask(self, kind: str, payload: Any = None) -> Any:
        return self.ref.ask(kind, payload, timeout_s=self.timeout_s)

    def add_adapter(self, name: AdapterName, lora: LoraConfig | None = None, seed: int = 0) -> AdapterRef:
        msg = {"name": name, "lora": asdict(lora or LoraConfig()), "seed": seed}
        return AdapterRef(**self._ask("add_adapter", msg))

    def remove_adapter(self, name: AdapterName) -> None:
        self._ask("remove_adapter", name)

    def adapters(self) -> list[AdapterRef]:
        return [AdapterRef(**r) for r in self._ask("adapters")]

    def forward(self, data: list[Datum], adapter: AdapterName | None = None) -> list[list[float]]:
        return list(self._ask("forward", {"data": [_datum_to_wire(d) for d in data], "adapter": adapter}))

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: LossFnName,
        adapter: AdapterName | None = None,
        loss_fn_config: dict[str, float] | None = None,
    ) -> ForwardBackwardResult:
        msg = {
            "data": [_datum_to_wire(d) for d in data],
            "loss_fn": loss_fn,
            "adapter": adapter,
            "loss_fn_config": loss_fn_config,
        }
        r = self._ask("forward_backward", msg)
        return ForwardBackwardResult(r["loss"], r["logprobs"], r["metrics"])

    def optim_step(self, adam_params: AdamParams, adapter: AdapterName | None = None) -> AdapterRef:
        return AdapterRef(**self._ask("optim_step", {"adam": asdict(adam_params), "adapter": adapter}))

    def save_state(self, path: str | os.PathLike[str], adapter: AdapterName | None = None) -> str:
        return str(self._ask("save_state", {"path": str(path), "adapter": adapter}))

    def load_state(self, path: str | os.PathLike[str], adapter: AdapterName | None = None) -> AdapterRef:
        return AdapterRef(**self._ask("load_state", {"path": str(path), "adapter": adapter}))

    def export_adapter(self, name: AdapterName) -> AdapterWeights:
        body = decode(self._ask("export_adapter", name))
        # Decoded tensors alias the received frames; clone so the caller owns writable memory.
        tensors = {k: v.clone() for k, v in body["tensors"].items()}
        return AdapterWeights(AdapterRef(**body["ref"]), _lora_from_wire(body["lora"]), tensors)


__all__ = ["LearnerActor", "LearnerClient"]
