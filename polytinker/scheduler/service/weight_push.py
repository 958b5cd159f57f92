"""LoRA versions to engines as tensors over the transport, so an engine needs no shared filesystem.

A learner writes each version's export (the peft directory) under its own state root. An engine on
the same machine (or on a shared filesystem) reads it there. One that cannot gets the tensors
sent: before the first request for a version reaches an engine incarnation, the broker runs
``WeightPush.prepare``'s step, which asks the engine whether it holds or can read the export
(``sched.w.has_weights``) and, when it cannot, fetches the tensors from the learner that trained
the adapter (``sched.w.adapter_weights``: the resident version from memory, an older one from the
learner's copy) and puts them into the engine's host cache (``sched.w.put_adapter``). The tensors
travel as the codec's out-of-band frames (no pickling, no copy into the message body).

Full-parameter versions are whole models: engines read them from their checkpoints (not sent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polytinker.engine.worker import messages as wm
from polytinker.scheduler.service.config import RuntimeConfig
from polytinker.scheduler.service.replies import AdapterTensors
from polytinker.transport import ask


class WeightPush:
    """Sends an engine the versions it cannot read (module docstring)."""

    def __init__(self, config: RuntimeConfig, broker: Any, jobs: Any) -> None:
        self._config, self._broker, self._jobs = config, broker, jobs

    def prepare(
        self, adapter: str, weights: wm.WeightsRef | None, full: bool
    ) -> tuple[str, Callable[[Any], None]] | None:
        """The broker's prepare step for a request naming ``weights`` (None: nothing to send)."""
        if full or not adapter or weights is None:
            return None
        timeout = self._config.request_timeout_s

        def send(engine: Any) -> None:
            if ask(engine.client, wm.EngineHasWeights(weights), timeout_s=timeout):
                return
            learner = self._learner_of(adapter)
            t: AdapterTensors = self._broker.call(learner, wm.LearnerAdapterWeights(weights))
            ask(engine.client, wm.EnginePutAdapter(weights, t), timeout_s=timeout)

        return f"weights:{weights.relative_path}", send

    def _learner_of(self, adapter: str) -> str:
        """The learner group the adapter's job is placed on; for a job placed nowhere now (paused,
        finished), the first: with one group that is where its exports are."""
        placed: str | None = self._jobs.learner_of(adapter.split("/")[1])
        return placed or self._config.learners[0].learner_id


__all__ = ["WeightPush"]
