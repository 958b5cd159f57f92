"""The learner worker: one learner group behind the scheduler.

It holds every LoRA job's adapter on one base model (``MultiAdapterLearner``; K data-parallel
replicas through ``LearnerGroup`` when ``world_size > 1``) and, for a full-parameter job, a
``FullParamLearner`` over its own copy of the weights (the policy gives such a job the group to
itself). Requests arrive one at a time (one handler thread), so two jobs' calls never interleave
inside the model.

``sched.w.step`` steps and then writes the new version's checkpoint (and the peft directory the
engines load) before it answers: the scheduler records the version only once it is on disk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polytinker.errors import ConfigError, NotBuiltError
from polytinker.scheduler.service.config import LearnerWorkerConfig
from polytinker.scheduler.service.messages import (
    DatumMsg,
    EnsureAdapter,
    LearnerExport,
    LearnerForward,
    LearnerForwardBackward,
    LearnerLoad,
    LearnerSave,
    LearnerStep,
    WorkerStats,
)

log = logging.getLogger("polytinker.scheduler.learner_worker")


def _data(msgs: tuple[DatumMsg, ...]) -> list[Any]:
    from polytinker.engine.types import Datum

    def opt(v: tuple[float, ...] | None) -> list[float] | None:
        return None if v is None else list(v)

    return [
        Datum(list(d.input_tokens), list(d.target_tokens), list(d.weights), opt(d.advantages), opt(d.sampling_logprobs))
        for d in msgs
    ]


class LearnerWorker:
    """Handlers for the scheduler: ensure, fb, forward, step, save, load, export, stats."""

    def __init__(self, model: str, cfg: LearnerWorkerConfig) -> None:
        from polytinker.engine.learner import LearnerConfig, make_learner
        from polytinker.engine.learner.group import LearnerGroup
        from polytinker.engine.models import load_model

        self.model, self.cfg = model, cfg
        lcfg = LearnerConfig(mode="lora", micro_batch_size=cfg.micro_batch_size)
        if cfg.world_size > 1:
            self.group = LearnerGroup.start(model, cfg.world_size, lcfg)
        else:
            from polytinker.engine.learner import SINGLE

            base, tokenizer = load_model(model)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            self.group = LearnerGroup(make_learner(base, lcfg, SINGLE, pad_token_id=int(pad)), SINGLE)
        self._full: dict[str, Any] = {}
        self.stats = {"forward_backward": 0, "optim_steps": 0, "loads": 0, "adapters_created": 0}

    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "sched.w.ensure": self.ensure,
            "sched.w.fb": self.forward_backward,
            "sched.w.forward": self.forward,
            "sched.w.step": self.step,
            "sched.w.save": self.save,
            "sched.w.load": self.load,
            "sched.w.export": self.export,
            "sched.w.stats": self.get_stats,
        }

    def close(self) -> None:
        self.group.close()

    # --- slots -------------------------------------------------------------------------------------
    def _versions(self) -> dict[str, int]:
        return {r.name: r.version for r in self.group.learner.adapters()}  # type: ignore[union-attr]

    def _full_learner(self, adapter: str) -> Any:
        learner = self._full.get(adapter)
        if learner is None:
            if self.cfg.world_size > 1:
                raise NotBuiltError("full-parameter jobs on a data-parallel learner group (world_size > 1)")
            from polytinker.engine.learner import FullParamLearner, LearnerConfig
            from polytinker.engine.models import load_model

            base, tokenizer = load_model(self.model)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            cfg = LearnerConfig(mode="full", micro_batch_size=self.cfg.micro_batch_size)
            learner = self._full[adapter] = FullParamLearner(base, cfg, pad_token_id=int(pad))
        return learner

    def ensure(self, msg: EnsureAdapter) -> dict[str, Any]:
        """Make the slot resident at ``msg.version``; reloads from the checkpoint when it differs."""
        if msg.full:
            learner = self._full_learner(msg.adapter)
            if learner.version().version != msg.version:
                if not msg.checkpoint:
                    raise ConfigError(f"full-parameter slot {msg.adapter} needs a checkpoint for v{msg.version}")
                learner.load_state(msg.checkpoint)
                self.stats["loads"] += 1
            return {"version": learner.version().version}
        have = self._versions().get(msg.adapter)
        if have == msg.version:
            return {"version": have}
        if msg.checkpoint:
            ref = self.group.load_state(msg.checkpoint, msg.adapter)
            self.stats["loads"] += 1
            return {"version": ref.version}
        if msg.version != 0:
            raise ConfigError(f"adapter {msg.adapter} v{msg.version} has no checkpoint to load")
        if have is not None:
            self.group.remove_adapter(msg.adapter)
        from polytinker.engine.types import DEFAULT_TARGET_MODULES, LoraConfig

        lora = LoraConfig(
            rank=msg.rank, alpha=msg.alpha, target_modules=tuple(msg.target_modules) or DEFAULT_TARGET_MODULES
        )
        self.group.add_adapter(msg.adapter, lora, msg.seed)
        self.stats["adapters_created"] += 1
        return {"version": 0}

    # --- training --------------------------------------------------------------------------------
    def forward_backward(self, msg: LearnerForwardBackward) -> dict[str, Any]:
        data = _data(msg.data)
        if msg.full:
            r = self._full_learner(msg.adapter).forward_backward(data, msg.loss_fn, None, msg.loss_fn_config)
        else:
            r = self.group.forward_backward(data, msg.loss_fn, msg.adapter, msg.loss_fn_config)  # type: ignore[arg-type]
        self.stats["forward_backward"] += 1
        return {"loss": r.loss, "logprobs": r.logprobs, "metrics": r.metrics}

    def forward(self, msg: LearnerForward) -> dict[str, Any]:
        data = _data(msg.data)
        if msg.full:
            return {"logprobs": self._full_learner(msg.adapter).forward(data, None)}
        return {"logprobs": self.group.forward(data, msg.adapter)}

    def step(self, msg: LearnerStep) -> dict[str, Any]:
        from polytinker.engine.learner import AdamParams

        adam = AdamParams(
            learning_rate=msg.learning_rate,
            beta1=msg.beta1,
            beta2=msg.beta2,
            eps=msg.eps,
            weight_decay=msg.weight_decay,
        )
        if msg.full:
            learner = self._full_learner(msg.adapter)
            ref = learner.optim_step(adam, None)
            ckpt = learner.save_state(Path(msg.checkpoint_dir) / f"v{ref.version}")
            export = ""
        else:
            ref = self.group.optim_step(adam, msg.adapter)
            ckpt = self.group.save_state(Path(msg.checkpoint_dir) / f"v{ref.version}", msg.adapter)
            export = ""
            if msg.export_dir:
                export = str(self._export(msg.adapter, Path(msg.export_dir) / f"v{ref.version}"))
        self.stats["optim_steps"] += 1
        metrics = dict(getattr(self.group.learner, "last_step_metrics", {}) or {})
        return {"version": ref.version, "checkpoint": str(ckpt), "export_dir": export, "metrics": metrics}

    def _export(self, adapter: str, path: Path) -> Path:
        out: Path = self.group.learner.export_adapter_dir(adapter, path)  # type: ignore[union-attr]
        return out

    def save(self, msg: LearnerSave) -> dict[str, Any]:
        if msg.full:
            learner = self._full_learner(msg.adapter)
            return {"path": str(learner.save_state(msg.path)), "version": learner.version().version}
        path = self.group.save_state(msg.path, msg.adapter)
        return {"path": str(path), "version": self._versions()[msg.adapter]}

    def load(self, msg: LearnerLoad) -> dict[str, Any]:
        if msg.full:
            return {"version": self._full_learner(msg.adapter).load_state(msg.path).version}
        return {"version": self.group.load_state(msg.path, msg.adapter).version}

    def export(self, msg: LearnerExport) -> dict[str, Any]:
        return {"path": str(self._export(msg.adapter, Path(msg.path)))}

    def get_stats(self, _msg: WorkerStats) -> dict[str, Any]:
        return {**self.stats, "adapters": len(self._versions()), "full_slots": len(self._full), "pid": os.getpid()}


__all__ = ["LearnerWorker"]
