"""A resent sample joins the run of its first send (engine/inference/_resends.py): the engine
worker, on the tiny model, answers a resend (same tenant, same request key, same request) from
the run already going or just ended, with the same sequences and one run's work; another
tenant's key, another request under the same key, a failed run and a call without a key run
anew."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from polytinker.engine.inference._resends import Resends
from polytinker.engine.inference.config import HFBackendConfig
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.inference.worker import EngineWorker
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.types import SamplingParams
from polytinker.engine.worker import messages as wm
from polytinker.errors import ConfigError
from polytinker.scheduler.service.config import EngineWorkerConfig

PROMPT = (1, 9690, 198, 2683, 359)
LONG = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True)  # no seed: a rerun differs


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineWorker]:
    backend = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    w = EngineWorker(TINY_RANDOM, EngineWorkerConfig(batch_window_s=0.0), tmp_path_factory.mktemp("w"), backend)
    try:
        yield w
    finally:
        w.full.close()
        w.engine.close()


def _sample(worker: EngineWorker, key: str, tag: str = "A", params: SamplingParams = LONG) -> list[list[int]]:
    reply = worker.sample(wm.EngineSample("", 0, None, PROMPT, 4, params, tag=tag, request_key=key))
    return [s.tokens for s in reply.sequences]


def test_a_resend_during_the_first_run_gets_its_answer_from_that_run(worker: EngineWorker) -> None:
    steps, joined = worker.engine.stats.steps, worker.resends.joined
    answers: list[list[list[int]]] = []
    first = threading.Thread(target=lambda: answers.append(_sample(worker, "call-1")))
    first.start()
    while worker.engine.stats.steps == steps:  # the first send is decoding
        threading.Event().wait(0.005)
    resent = _sample(worker, "call-1")  # as the scheduler's resend after its restart
    first.join(60)
    assert resent == answers[0]  # one run, two answers (unseeded: a second run would differ)
    assert worker.resends.joined == joined + 1
    assert worker.engine.stats.steps - steps <= LONG.max_tokens + 1  # the work of one run, not two
    # Just after it ended, a resend is still answered from it.
    assert _sample(worker, "call-1") == answers[0]


def test_other_tenants_other_requests_and_calls_without_a_key_run_anew(worker: EngineWorker) -> None:
    first = _sample(worker, "call-2")
    joined = worker.resends.joined
    assert _sample(worker, "call-2", tag="B") != first  # the same key of another tenant
    short = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    assert len(_sample(worker, "call-2", params=short)[0]) == 3  # the same key, another request
    assert _sample(worker, "") != _sample(worker, "")  # no key: every send runs
    assert worker.resends.joined == joined


def test_a_failed_run_is_not_reused_and_keys_are_bounded() -> None:
    resends = Resends(keep_s=60.0, max_runs=2)
    failed: Future[int] = Future()
    failed.set_exception(RuntimeError("the batch failed"))
    assert resends.run(("A", "k"), 1, lambda: failed) is failed
    again: Future[int] = Future()
    assert resends.run(("A", "k"), 1, lambda: again) is again  # not the failed one
    for i in range(3):  # past max_runs the oldest are forgotten
        resends.run(("A", f"x{i}"), 1, Future)
    fresh: Future[int] = Future()
    assert resends.run(("A", "k"), 1, lambda: fresh) is fresh
    with pytest.raises(ConfigError, match="request_key"):
        wm.EngineSample("", 0, None, PROMPT, 1, LONG, request_key="k" * 65)
