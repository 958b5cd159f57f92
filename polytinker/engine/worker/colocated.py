"""The colocated worker: one process, one copy of the base model, serving sampling and LoRA training.

A runtime with ``colocate = true`` starts, for each pair of a local engine and a local learner
group it declares, one process (``ColocatedActor``) in place of two. That process loads the base
model once, for the learner (``ColocatedLearnerWorker``), and builds the engine's model as a
second module tree over the same parameter and buffer objects (``shared_copy``): the engine's
LoRA wrappers (``hf`` backend) and the learner's peft layers each wrap their own tree, and both
read one set of frozen base tensors (``shares_base`` checks it by ``data_ptr``). It serves the
scheduler as two registered workers, the engine and the learner group under their own ids, so
the scheduler's broker, weight push and policy address it as they do separate workers.

Phases. A training call and a sampling step never run at the same time: ``PhaseRunner`` is one
thread that runs every learner call and every backend step of the engine (a decode step, a
prefill, a whole batch or a scoring pass), first come first served; the model is loaded there
too. A training call that arrives while a batch is decoding waits for the decode step in
flight, not the whole batch, and the batch goes on after it.

Versions. After a step (or an export) the learner hands the new version's tensors to the engine
in the same process (``EngineWorker.register_weights``): the version is registered under the
``WeightsRef`` of its export before the step answers, so the scheduler's first request for it
finds it registered and nothing is read from disk or sent through the transport. The export is
still written: other engines, restarts and checkpoints read it.

LoRA only: a full-parameter model is a second copy of the weights, the thing this worker exists
to avoid, so a full-parameter job is refused (``FULL_REFUSED``); so are learner groups of more
than one rank and non-``hf`` engines (the config refuses them before anything starts). vLLM
keeps its model inside its own engine core and offers no way to read another module's tensors,
so no colocated worker is built for vLLM.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from polytinker.actors import Actor
from polytinker.engine.device import resolve_device, resolve_dtype
from polytinker.engine.learner.worker import LearnerWorker
from polytinker.engine.models import ModelConfig, load_model
from polytinker.engine.worker.config import EngineWorkerConfig, LearnerWorkerConfig
from polytinker.engine.worker.messages import EngineLogprobs, EngineSample, WeightsRef, WorkerStats
from polytinker.engine.worker.server import WorkerPlan, WorkerServer, set_worker_threads
from polytinker.errors import ConfigError
from polytinker.transport.requests import kind_of

T = TypeVar("T")

FULL_REFUSED = (
    "a colocated worker (colocate = true in the runtime config) trains LoRA adapters only: a full-parameter"
    " job needs its own copy of the model. Run it on a runtime with colocate = false"
)


class PhaseRunner:
    """Every pass over the shared model, run on one thread, in the order asked: a training call
    waiting behind a decode step goes next, not after every step the engine's thread could ask for
    first. Counts the switches between phases and the seconds each phase waited.

    One thread, not a lock between the engine's thread and the learner's: torch's OpenMP runtime
    (libgomp) keeps a pool of helper threads for each thread that has run parallel work, and once
    a process holds more of them than it has cores, every pool sleeps between parallel regions
    instead of spinning. A learner thread that had trained once, idle beside the engine's, made
    the engine's decode 1.4x slower (192 -> 135 tokens/s, 16 rows of SmolLM2-135M on 2 cores). On
    one thread both phases share one pool, and one arena of the C heap: what a phase freed is
    reused by the next (with a thread each, the engine's freed KV caches stayed resident in its
    thread's arena while the learner's activations were allocated in another's)."""

    PHASES = ("sample", "train")

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[tuple[str, Callable[[], Any], Future[Any], float] | None] = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()
        self.phase = ""  # the phase that ran last
        self.switches = 0
        self.waited_s = dict.fromkeys(self.PHASES, 0.0)
        self._thread = threading.Thread(target=self._loop, name="polytinker-colocated", daemon=True)
        self._thread.start()

    def run(self, phase: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the runner's thread, after what was asked before it; its result or its
        exception. ``phase`` is ``"sample"``, ``"train"`` or ``""`` (neither: loading, setting up).
        Called from the runner's own thread (a version handed over during a step), it runs at once."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[T] = Future()
        with self._closing:  # nothing is queued behind the thread's stop
            if self._closed:
                raise RuntimeError("the colocated worker is closed")
            self._work.put((phase, fn, future, time.perf_counter()))
        return future.result()

    def _loop(self) -> None:
        while (item := self._work.get()) is not None:
            phase, fn, future, asked = item
            if phase:
                self.waited_s[phase] += time.perf_counter() - asked
                self.switches += bool(self.phase) and self.phase != phase
                self.phase = phase
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's to raise
                future.set_exception(exc)

    def close(self, timeout_s: float = 30.0) -> None:
        """Run what was asked already, then stop the thread; idempotent."""
        with self._closing:
            if not self._closed:
                self._closed = True
                self._work.put(None)
        self._thread.join(timeout_s)


class _RunnerBatch:
    """A decode batch whose prefills and steps run on the phase runner."""

    def __init__(self, batch: Any, runner: PhaseRunner) -> None:
        self._batch, self._runner = batch, runner

    @property
    def rows(self) -> int:
        return int(self._batch.rows)

    @property
    def tokens_left(self) -> int:
        return int(self._batch.tokens_left)

    def add(self, requests: Sequence[tuple[Hashable, Any]]) -> list[tuple[Hashable, Any]]:
        return self._runner.run("sample", lambda: list(self._batch.add(requests)))

    def step(self) -> list[tuple[Hashable, Any]]:
        return self._runner.run("sample", lambda: list(self._batch.step()))


class RunnerBackend:
    """The hf backend with everything that touches tensors run on the phase runner: every pass
    over the model as the sampling phase, loading and unloading an adapter outside any phase (they
    touch the engine's own slot buffers, not the base; on the runner's thread so that no other
    thread runs parallel work)."""

    def __init__(self, backend: Any, runner: PhaseRunner) -> None:
        self.inner, self._runner = backend, runner
        self.name, self.vocab_size, self.max_model_len = backend.name, backend.vocab_size, backend.max_model_len
        self.joins = backend.joins

    def open_batch(self) -> _RunnerBatch:
        return _RunnerBatch(self._runner.run("", self.inner.open_batch), self._runner)

    def sample(self, requests: Sequence[Any]) -> list[Any]:
        return self._runner.run("sample", lambda: list(self.inner.sample(requests)))

    def compute_logprobs(self, sequences: Sequence[Sequence[int]], adapter: Any = None) -> list[list[float]]:
        return self._runner.run("sample", lambda: list(self.inner.compute_logprobs(sequences, adapter)))

    def compute_logprobs_topk(self, sequences: Sequence[Sequence[int]], k: int, adapter: Any = None) -> Any:
        return self._runner.run("sample", lambda: self.inner.compute_logprobs_topk(sequences, k, adapter))

    def load_adapter(self, weights: Any) -> None:
        self._runner.run("", lambda: self.inner.load_adapter(weights))

    def load_adapter_dir(self, ref: Any, path: Path) -> None:
        self._runner.run("", lambda: self.inner.load_adapter_dir(ref, path))

    def unload_adapter(self, ref: Any) -> None:
        self._runner.run("", lambda: self.inner.unload_adapter(ref))

    def loaded_adapters(self) -> list[Any]:
        return list(self.inner.loaded_adapters())

    def close(self) -> None:
        self.inner.close()


def shared_copy(model: Any) -> Any:
    """A second module tree of ``model`` whose parameters and buffers are ``model``'s own objects
    (deepcopy with them in its memo): wrapping one tree's layers leaves the other's alone, and
    neither holds a second copy of a weight."""
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def shares_base(engine_model: Any, learner_model: Any) -> bool:
    """Whether every parameter of the engine's model lies in memory the learner's model holds."""
    learner_ptrs = {p.data_ptr() for p in learner_model.parameters()}
    return all(p.data_ptr() in learner_ptrs for p in engine_model.parameters())


class ColocatedLearnerWorker(LearnerWorker):
    """The learner half: a one-rank LoRA learner whose base model is loaded here once; its
    ``base_copy`` is what the engine half serves. ``hand_over(weights_ref, adapter_weights)``
    receives each version it exports."""

    def __init__(
        self,
        model: str,
        cfg: LearnerWorkerConfig,
        root: str | os.PathLike[str],
        hand_over: Callable[[WeightsRef, Any], None] | None = None,
    ) -> None:
        if cfg.world_size != 1:
            raise ConfigError(f"learner {cfg.learner_id}: a colocated learner has one rank, not {cfg.world_size}")
        self.hand_over = hand_over
        self.tokenizer: Any = None
        self.base_copy: Any = None
        self.handed_over = 0
        self.hand_over_s = 0.0  # seconds spent handing versions to the engine (snapshot and register)
        super().__init__(model, cfg, root)

    def _start(self, mode: str) -> Any:
        if mode != "lora":
            raise ConfigError(FULL_REFUSED)
        # torch, transformers and peft load when the worker starts: the runtime reads this module.
        from polytinker.engine.learner import DistInfo, LearnerConfig, make_learner
        from polytinker.engine.learner.group import LearnerGroup

        lcfg = LearnerConfig(
            mode="lora", micro_batch_size=self.cfg.micro_batch_size, max_tokens_per_pass=self.cfg.max_tokens_per_pass
        )
        device = resolve_device(self.cfg.device)
        base, self.tokenizer = load_model(self.model, ModelConfig(dtype=resolve_dtype(self.cfg.dtype, device)))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
        learner = make_learner(base, lcfg, info, pad_token_id=int(pad))
        # Copied before any adapter: peft then wraps the learner's layers in place, not these.
        self.base_copy = shared_copy(learner.base_model)
        return LearnerGroup(learner, info)

    def _export(self, weights: WeightsRef) -> str:
        relative = super()._export(weights)
        if self.hand_over is not None:
            t0 = time.perf_counter()
            group, _ = self._slot(weights.adapter, False)
            self.hand_over(weights, group.export_adapter(weights.adapter))
            self.hand_over_s += time.perf_counter() - t0
            self.handed_over += 1
        return relative

    def get_stats(self, msg: WorkerStats) -> dict[str, Any]:
        return {**super().get_stats(msg), "handed_over": self.handed_over, "hand_over_s": self.hand_over_s}


class ColocatedWorker:
    """An engine worker and a learner worker over one base model in this process (module docstring)."""

    def __init__(
        self, model: str, engine: EngineWorkerConfig, learner: LearnerWorkerConfig, root: str | os.PathLike[str]
    ):
        if engine.backend != "hf":
            raise ConfigError(
                f"engine {engine.engine_id}: a colocated engine uses the hf backend, not {engine.backend}"
            )
        # torch and transformers load when the worker starts: the runtime reads this module.
        from polytinker.engine.inference.config import HFBackendConfig
        from polytinker.engine.inference.hf import HFBackend
        from polytinker.engine.inference.worker import EngineWorker

        device = str(resolve_device(learner.device))
        self.runner = PhaseRunner()

        def load() -> HFBackend:  # on the runner's thread, as every later pass over the model
            self.learner = ColocatedLearnerWorker(model, learner, root, hand_over=self._hand_over)
            return HFBackend(
                HFBackendConfig(model=model, device=device),
                model=self.learner.base_copy,
                tokenizer=self.learner.tokenizer,
            )

        try:
            self.backend = self.runner.run("", load)
        except BaseException:
            self.runner.close()
            raise
        self.engine = EngineWorker(model, engine, root, backend=RunnerBackend(self.backend, self.runner))

    def _hand_over(self, weights: WeightsRef, adapter_weights: Any) -> None:
        self.engine.register_weights(weights, adapter_weights)

    @property
    def engine_model(self) -> Any:
        return self.backend.model

    @property
    def learner_model(self) -> Any:
        return self.learner._lora.learner.base_model

    def engine_handlers(self) -> dict[str, Callable[[Any], Any]]:
        handlers = self.engine.handlers()
        for cls in (EngineSample, EngineLogprobs):
            handlers[kind_of(cls)] = self._lora_only(handlers[kind_of(cls)])
        return handlers

    def learner_handlers(self) -> dict[str, Callable[[Any], Any]]:
        """The learner's handlers, each call run on the phase runner; its stats add the runner's."""
        stats = kind_of(WorkerStats)
        handlers = {k: self._training(fn) for k, fn in self.learner.handlers().items() if k != stats}
        handlers[stats] = lambda msg: {**self.learner.get_stats(msg), **self.phase_stats()}
        return handlers

    def _lora_only(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        @functools.wraps(fn)
        def run(msg: Any) -> Any:
            if msg.full:
                raise ConfigError(FULL_REFUSED)
            return fn(msg)

        return run

    def _training(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        @functools.wraps(fn)
        def run(msg: Any) -> Any:
            if getattr(msg, "full", False):
                raise ConfigError(FULL_REFUSED)
            return self.runner.run("train", lambda: fn(msg))

        return run

    def phase_stats(self) -> dict[str, Any]:
        return {
            "phase_switches": self.runner.switches,
            "phase_waited_s": dict(self.runner.waited_s),
        }

    def close(self) -> None:
        try:
            self.engine.close()
            self.runner.run("", self.learner.close)
        finally:
            self.runner.close()


class ColocatedActor(Actor):
    """A colocated worker as a supervised process actor: it registers with the scheduler twice,
    as its engine and as its learner group, each on its own RPC server."""

    def __init__(self, engine_plan: dict[str, Any], learner_plan: dict[str, Any], scheduler: str, token: str) -> None:
        self._engine_plan, self._learner_plan = WorkerPlan.from_dict(engine_plan), WorkerPlan.from_dict(learner_plan)
        if (self._engine_plan.role, self._learner_plan.role) != ("engine", "learner"):
            raise ConfigError("a colocated actor takes an engine's plan and a learner's plan")
        self._scheduler, self._token = scheduler, token
        self._worker: ColocatedWorker | None = None
        self._servers: list[WorkerServer] = []

    def on_start(self) -> None:
        os.umask(0o077)  # checkpoints and adapter exports hold a tenant's weights: this user's alone
        set_worker_threads(self._learner_plan)
        plan = self._learner_plan
        engine_cfg, learner_cfg = self._engine_plan.worker, plan.worker
        assert isinstance(engine_cfg, EngineWorkerConfig) and isinstance(learner_cfg, LearnerWorkerConfig)
        if not plan.state_dir:
            raise ConfigError(f"colocated worker {plan.worker_id}: no state directory to keep weights in")
        self._worker = worker = ColocatedWorker(plan.model, engine_cfg, learner_cfg, Path(plan.state_dir).expanduser())
        for p, handlers in ((self._engine_plan, worker.engine_handlers()), (plan, worker.learner_handlers())):
            server = WorkerServer(
                worker_id=p.worker_id,
                role=p.role,
                base_model=p.model,
                handlers=handlers,
                scheduler=self._scheduler,
                token=self._token,
                heartbeat_s=p.heartbeat_s,
                capacity=p.capacity,
            )
            self._servers.append(server)
        for server in self._servers:
            server.registered.wait(30.0)

    def on_stop(self) -> None:
        for server in self._servers:
            server.close()
        if self._worker is not None:
            self._worker.close()


__all__ = [
    "FULL_REFUSED",
    "ColocatedActor",
    "ColocatedLearnerWorker",
    "ColocatedWorker",
    "PhaseRunner",
    "RunnerBackend",
    "shared_copy",
    "shares_base",
]
