"""``FbBatcher`` alone, with a recording sender in place of the broker: which calls meet in one
``sched.w.fb_many``, and what each caller gets back. The real path (a learner worker answering a
batch, and a runtime's agents batched) is tested in tests/test_learner_worker.py and
tests/test_client_runtime.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from polytinker.engine.types import Datum
from polytinker.engine.worker import messages as wm
from polytinker.errors import ConfigError, RemoteError
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.fb_batcher import FbBatcher

ROWS = (Datum([1, 2, 3], [2, 3, 4], [1.0, 1.0, 1.0]),)


def fb(agent: str, loss_fn: str = "cross_entropy", full: bool = False) -> wm.LearnerForwardBackward:
    """A call of the adapter ``tenant/job/AGENT``."""
    return wm.LearnerForwardBackward(f"tenant/job/{agent}", ROWS, loss_fn, full=full, request_id=f"req-{agent}")


def agent(req: wm.LearnerForwardBackward) -> str:
    return req.adapter.rsplit("/", 1)[1]


def reply(req: wm.LearnerForwardBackward) -> r.ForwardBackwardReply:
    return r.ForwardBackwardReply(float(len(agent(req))), [[0.0]], {"adapter": req.adapter})


class Recorder:
    """A sender that answers each call from its adapter's name and records what was sent."""

    def __init__(self, refuse_batches: bool = False, batch_code: str = ConfigError.code) -> None:
        self.sent: list[tuple[str, tuple[str, ...], int]] = []  # (kind, adapters, prepares)
        self.refuse_batches = refuse_batches
        self.batch_code = batch_code  # the code of the error a refused batch gets
        self.lock = threading.Lock()

    def __call__(self, kind: str, payload: Any, prepares: list[Any]) -> Any:
        items = payload.items if kind == "sched.w.fb_many" else (payload,)
        with self.lock:
            self.sent.append((kind, tuple(agent(i) for i in items), len(prepares)))
        if kind == "sched.w.fb_many":
            if self.refuse_batches:
                raise RemoteError("bad datum", code=self.batch_code)
            return r.ForwardBackwardManyReply(tuple(reply(i) for i in items))
        if agent(payload) == "bad":
            raise RemoteError("bad datum", code=ConfigError.code)
        return reply(payload)


def together(batcher: FbBatcher, reqs: list[wm.LearnerForwardBackward]) -> list[Any]:
    """Each request from its own thread, all at once; each thread's answer or error."""
    out: list[Any] = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def one(i: int) -> None:
        start.wait()
        try:
            out[i] = batcher.call(reqs[i], (f"ensure:{reqs[i].adapter}", lambda h: None))
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_calls_that_meet_go_as_one_batch_and_each_caller_gets_its_own_answer() -> None:
    sent = Recorder()
    batcher = FbBatcher(sent, window_s=1.0, max_calls=3)
    reqs = [fb(name) for name in ("a", "bb", "ccc")]
    out = together(batcher, reqs)
    assert out == [reply(q) for q in reqs]
    assert len(sent.sent) == 1 and sent.sent[0][0] == "sched.w.fb_many"
    assert sorted(sent.sent[0][1]) == ["a", "bb", "ccc"] and sent.sent[0][2] == 3  # every adapter prepared
    assert (batcher.batches, batcher.batched_calls) == (1, 3)


def test_only_calls_that_can_share_a_pass_meet() -> None:
    sent = Recorder()
    batcher = FbBatcher(sent, window_s=0.5, max_calls=8)
    # Another loss function, the same adapter twice, and a full-parameter call each go apart.
    reqs = [fb("a"), fb("b"), fb("c", loss_fn="importance_sampling"), fb("a"), fb("full", full=True)]
    out = together(batcher, reqs)
    assert out == [reply(q) for q in reqs]
    batches = [adapters for kind, adapters, _ in sent.sent if kind == "sched.w.fb_many"]
    assert all(len(set(b)) == len(b) for b in batches)  # an adapter appears once per pass
    assert ("sched.w.fb", ("full",), 1) in sent.sent  # the full-parameter call alone
    assert not any("full" in b or ("c" in b and len(b) > 1) for b in batches)


def test_max_calls_one_sends_every_call_alone() -> None:
    sent = Recorder()
    batcher = FbBatcher(sent, window_s=0.2, max_calls=1)
    together(batcher, [fb("a"), fb("b")])
    assert [kind for kind, _, _ in sent.sent] == ["sched.w.fb", "sched.w.fb"] and batcher.batches == 0


def test_a_batch_refused_before_any_work_is_sent_again_call_by_call() -> None:
    sent = Recorder(refuse_batches=True)
    batcher = FbBatcher(sent, window_s=1.0, max_calls=2)
    out = together(batcher, [fb("a"), fb("bad")])
    good = next(o for o in out if isinstance(o, r.ForwardBackwardReply))
    bad = next(o for o in out if isinstance(o, RemoteError))
    assert good == reply(fb("a")) and bad.code == ConfigError.code  # each caller its own outcome
    assert [kind for kind, _, _ in sent.sent] == ["sched.w.fb_many", "sched.w.fb", "sched.w.fb"]
    assert batcher.batches == 0


def test_a_batch_whose_pass_failed_at_the_learner_is_sent_again_call_by_call() -> None:
    # Not a refusal before any work: the learner ran the pass and it raised (one member's datum
    # broke the model's code). The learner kept none of the batch, so each call alone gets its own
    # outcome and only the culprit its error.
    sent = Recorder(refuse_batches=True, batch_code="handler")
    batcher = FbBatcher(sent, window_s=1.0, max_calls=3)
    out = together(batcher, [fb("a"), fb("bad"), fb("cc")])
    assert out[0] == reply(fb("a")) and out[2] == reply(fb("cc"))
    assert isinstance(out[1], RemoteError) and out[1].code == ConfigError.code
    assert [kind for kind, _, _ in sent.sent] == ["sched.w.fb_many"] + ["sched.w.fb"] * 3
    assert batcher.batches == 0


def test_a_failed_batch_is_every_callers_error() -> None:
    def dead(kind: str, payload: Any, prepares: list[Any]) -> Any:
        raise TimeoutError("learner-0 did not answer")

    batcher = FbBatcher(dead, window_s=1.0, max_calls=2)
    out = together(batcher, [fb("a"), fb("b")])
    assert all(isinstance(o, TimeoutError) for o in out)
    with pytest.raises(TimeoutError):  # and the batcher is free for the next call
        batcher.call(fb("c"), ("ensure:c", lambda h: None))
