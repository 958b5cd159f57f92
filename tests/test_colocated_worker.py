"""The colocated worker (one base model serving an engine and a learner group), called with the
scheduler's typed worker messages in this process, against separate engine and learner workers
(tiny-random, fp32): the same numbers, one copy of the base, versions handed over in memory,
full-parameter jobs refused, training and sampling never at once."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from polytinker.engine.inference.worker import EngineWorker
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.learner.worker import LearnerWorker
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import Datum, SamplingParams
from polytinker.engine.worker import messages as wm
from polytinker.engine.worker.colocated import ColocatedWorker, PhaseRunner, shares_base
from polytinker.engine.worker.config import EngineWorkerConfig, LearnerWorkerConfig
from polytinker.errors import ConfigError, NotResident
from polytinker.transport.requests import kind_of

AGENTS = ("t/job-a/alice", "t/job-b/bob")
PROMPT = (1, 17, 230, 4096, 88, 9)
ENGINE = EngineWorkerConfig(batch_window_s=0.0, max_batch_size=16)
LEARNER = LearnerWorkerConfig(micro_batch_size=8, dtype="float32", device="cpu")


def _call(handlers: dict[str, Any], msg: Any) -> Any:
    return handlers[kind_of(type(msg))](msg)


def _sample(h: dict[str, Any], adapter: str, version: int, seed: int, tokens: int = 6) -> Any:
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True)
    weights = wm.WeightsRef(adapter, version, "export")
    return _call(h, wm.EngineSample(adapter, version, weights, PROMPT, 4, params, tag="t"))


def _rl_step(h: dict[str, Any]) -> dict[str, Any]:
    """Two agents: create, export v0, sample, train on the samples (importance sampling), step to
    v1 (which exports it), sample and score again. Every number the workers answered."""
    out: dict[str, Any] = {}
    for i, adapter in enumerate(AGENTS):
        _call(h, wm.EnsureAdapter(adapter, 0, rank=4, alpha=8, seed=i))
        _call(h, wm.LearnerExport(adapter, 0))
    for i, adapter in enumerate(AGENTS):
        seqs = _sample(h, adapter, 0, seed=11 + i).sequences
        data = []
        for k, s in enumerate(seqs):
            tokens = list(PROMPT) + s.tokens
            n = len(tokens) - 1
            weights_T = [0.0] * (len(PROMPT) - 1) + [1.0] * len(s.tokens)
            sampled_T = [0.0] * (len(PROMPT) - 1) + list(s.logprobs)
            # Advantages that do not sum to zero: at v0 every ratio is 1 (or within float noise),
            # so advantages summing to zero would make the loss 0.0 or not by chance.
            data.append(Datum(tokens[:-1], tokens[1:], weights_T, [float(k) - 1.0] * n, sampled_T))
        fb = _call(h, wm.LearnerForwardBackward(adapter, tuple(data), "importance_sampling"))
        step = _call(h, wm.LearnerStep(adapter, AdamParams(5e-2, 0.9, 0.999, 1e-8, 0.0)))
        after = _sample(h, adapter, step.version, seed=21 + i).sequences
        weights = wm.WeightsRef(adapter, step.version, "export")
        scored = _call(h, wm.EngineLogprobs(adapter, step.version, weights, ((*PROMPT, 5, 6, 7),)))
        out[adapter] = {
            "v0_tokens": [s.tokens for s in seqs],
            "v0_logprobs": [s.logprobs for s in seqs],
            "loss": fb.loss,
            "fb_logprobs": fb.logprobs,
            "version": step.version,
            "v1_tokens": [s.tokens for s in after],
            "v1_logprobs": [s.logprobs for s in after],
            "v1_scored": scored.logprobs,
        }
    return out


def _close(a: list[float] | float, b: list[float] | float, tol: float = 1e-5) -> bool:
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        return all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    assert not isinstance(b, list)
    return abs(a - b) <= tol


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    worker = ColocatedWorker(TINY_RANDOM, ENGINE, LEARNER, tmp_path_factory.mktemp("colocated"))
    yield worker
    worker.close()


@pytest.mark.timeout(120)
def test_the_same_numbers_as_separate_workers_from_one_copy_of_the_base(colocated: Any, tmp_path: Path) -> None:
    engine = EngineWorker(TINY_RANDOM, ENGINE, tmp_path)
    learner = LearnerWorker(TINY_RANDOM, LEARNER, tmp_path)
    try:
        separate = _rl_step(engine.handlers() | learner.handlers())
    finally:
        engine.close()
        learner.close()
    together = _rl_step(colocated.engine_handlers() | colocated.learner_handlers())
    for adapter in AGENTS:
        s, c = separate[adapter], together[adapter]
        assert c["version"] == s["version"] == 1
        assert c["v0_tokens"] == s["v0_tokens"] and c["v1_tokens"] == s["v1_tokens"]
        assert s["loss"] != 0.0 and s["fb_logprobs"]  # a real gradient, compared position by position
        for key in ("v0_logprobs", "loss", "fb_logprobs", "v1_logprobs", "v1_scored"):
            assert _close(c[key], s[key]), (adapter, key)
    # One copy of the base: every engine parameter lies in the learner's memory, and none is an
    # adapter's (the learner's peft layers and the engine's LoRA wrappers each wrap their own tree).
    assert shares_base(colocated.engine_model, colocated.learner_model)
    learner_ptrs = {p.data_ptr() for p in colocated.learner_model.parameters()}
    engine_ptrs = {p.data_ptr() for p in colocated.engine_model.parameters()}
    assert engine_ptrs < learner_ptrs  # the learner's extra tensors are its adapters'
    # Each new version reached the engine in memory, before the step answered: none came over
    # the transport, none was read from disk.
    stats = _call(colocated.learner_handlers(), wm.WorkerStats())
    assert stats["handed_over"] == 4 and stats["phase_switches"] >= 4  # v0 and v1 of each agent
    assert _call(colocated.engine_handlers(), wm.WorkerStats())["adapters_received"] == 0


@pytest.mark.timeout(60)
def test_every_pass_over_the_model_runs_on_the_runner_thread(colocated: Any) -> None:
    """Sampling and training on one thread: torch's OpenMP runtime keeps a pool of helper threads
    for each thread that runs parallel work, and two pools on a machine's cores slow both."""
    threads: dict[str, set[int]] = {"sample": set(), "train": set()}
    hooks = [
        model.get_input_embeddings().register_forward_pre_hook(
            lambda *_, phase=phase: threads[phase].add(threading.get_ident())
        )
        for phase, model in (("sample", colocated.engine_model), ("train", colocated.learner_model))
    ]
    try:
        h = colocated.engine_handlers() | colocated.learner_handlers()
        adapter = "t/job-e/erin"
        _call(h, wm.EnsureAdapter(adapter, 0, rank=4, alpha=8, seed=5))
        _call(h, wm.LearnerExport(adapter, 0))
        data = (Datum(list(PROMPT[:-1]), list(PROMPT[1:]), [1.0] * (len(PROMPT) - 1)),)
        _call(h, wm.LearnerForwardBackward(adapter, data, "cross_entropy"))
        _sample(h, adapter, 0, seed=6)
    finally:
        for hook in hooks:
            hook.remove()
    assert threads["sample"] == threads["train"] == {colocated.runner._thread.ident}


@pytest.mark.timeout(60)
def test_a_handed_over_version_is_served_with_its_export_gone(colocated: Any, tmp_path: Path) -> None:
    h = colocated.engine_handlers() | colocated.learner_handlers()
    adapter = "t/job-c/carol"
    _call(h, wm.EnsureAdapter(adapter, 0, rank=4, alpha=8, seed=3))
    data = (Datum(list(PROMPT[:-1]), list(PROMPT[1:]), [1.0] * (len(PROMPT) - 1)),)
    _call(h, wm.LearnerForwardBackward(adapter, data, "cross_entropy"))
    step = _call(h, wm.LearnerStep(adapter, AdamParams(1e-2, 0.9, 0.999, 1e-8, 0.0)))
    export = colocated.learner.root / wm.WeightsRef(adapter, step.version, "export").relative_path
    export.rename(tmp_path / "moved")  # nothing on disk to read: only the version handed over remains
    assert _call(h, wm.EngineHasWeights(wm.WeightsRef(adapter, step.version, "export")))
    assert len(_sample(h, adapter, step.version, seed=5).sequences) == 4
    # A separate engine reading the same root finds nothing: the colocated one did not read it.
    engine = EngineWorker(TINY_RANDOM, ENGINE, colocated.learner.root)
    try:
        with pytest.raises(NotResident):
            _sample(engine.handlers(), adapter, step.version, seed=5)
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_full_parameter_job_is_refused_naming_the_setting(colocated: Any) -> None:
    learner, engine = colocated.learner_handlers(), colocated.engine_handlers()
    with pytest.raises(ConfigError, match="colocate = true"):
        _call(learner, wm.EnsureAdapter("t/job-f/full", 0, full=True))
    with pytest.raises(ConfigError, match="colocate = true"):
        colocated.learner._full_group("t/job-f/full")  # the path a full-parameter slot would load by
    params = SamplingParams(max_tokens=2)
    weights = wm.WeightsRef("t/job-f/full", 1)
    with pytest.raises(ConfigError, match="colocate = true"):
        _call(engine, wm.EngineSample("t/job-f/full", 1, weights, PROMPT, 1, params, full=True))
    with pytest.raises(ConfigError, match="one rank"):
        ColocatedWorker(TINY_RANDOM, ENGINE, LearnerWorkerConfig(world_size=2), "unused")


@pytest.mark.timeout(60)
def test_a_training_call_waits_for_the_decode_step_in_flight_not_the_batch(colocated: Any) -> None:
    h = colocated.engine_handlers() | colocated.learner_handlers()
    adapter = "t/job-d/dave"
    _call(h, wm.EnsureAdapter(adapter, 0, rank=4, alpha=8, seed=4))
    _call(h, wm.LearnerExport(adapter, 0))
    done: dict[str, float] = {}

    def long_sample() -> None:
        _sample(h, adapter, 0, seed=9, tokens=400)
        done["sample"] = time.perf_counter()

    steps_before = colocated.engine.engine.stats.steps
    thread = threading.Thread(target=long_sample)
    thread.start()
    while colocated.engine.engine.stats.steps == steps_before:  # the batch is decoding
        time.sleep(0.001)
    data = (Datum(list(PROMPT[:-1]), list(PROMPT[1:]), [1.0] * (len(PROMPT) - 1)),)
    switches = colocated.runner.switches
    _call(h, wm.LearnerForwardBackward(adapter, data, "cross_entropy"))
    done["train"] = time.perf_counter()
    thread.join(30)
    assert done["train"] < done["sample"]  # it ran between two decode steps of the batch
    assert colocated.runner.switches >= switches + 2  # sample -> train -> sample


@pytest.mark.timeout(10)
def test_the_phase_runner_runs_every_pass_on_one_thread_in_the_order_asked() -> None:
    order: list[str] = []
    threads_seen: set[int] = set()
    runner = PhaseRunner()
    gate = threading.Event()

    def work(name: str) -> str:
        threads_seen.add(threading.get_ident())
        order.append(name)
        return name

    def first() -> None:
        threads_seen.add(threading.get_ident())
        gate.wait(5)  # the others ask while this one runs
        order.append("step-0")

    try:
        callers = [threading.Thread(target=runner.run, args=("sample", first))]
        callers[0].start()
        while runner.phase != "sample":
            time.sleep(0.001)
        for k, (phase, name) in enumerate((("train", "train-1"), ("sample", "step-2"), ("train", "train-3"))):
            callers.append(threading.Thread(target=runner.run, args=(phase, functools.partial(work, name))))
            callers[-1].start()
            while runner._work.qsize() != k + 1:  # asked before the next one asks
                time.sleep(0.001)
        gate.set()
        for t in callers:
            t.join(5)
        assert order == ["step-0", "train-1", "step-2", "train-3"]
        assert runner.switches == 3 and runner.phase == "train"
        assert len(threads_seen) == 1 and threading.get_ident() not in threads_seen
        assert runner.run("train", lambda: "again") == "again" and runner.switches == 3  # same phase: no switch
        # A pass that asks for another runs it at once; an error reaches its caller.
        assert runner.run("train", lambda: runner.run("sample", lambda: 7)) == 7
        with pytest.raises(ZeroDivisionError):
            runner.run("sample", lambda: 1 / 0)
        assert runner.run("", lambda: "after") == "after"
    finally:
        runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner.run("sample", lambda: None)
