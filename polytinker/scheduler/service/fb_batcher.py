"""Agents' updates batched: LoRA ``forward_backward`` calls that wait on one learner together run
in one pass over their adapters.

Each learner has one ``FbBatcher``, and every ``forward_backward`` to it goes through it (a
full-parameter call is sent alone, without waiting). A call joins its queue. While no batch of that learner is in
flight, the first waiting call becomes the sender: it waits up to ``window_s`` for others (less
once ``max_calls`` are there), takes every waiting call that can share its pass (same loss
function and config, each adapter once) and sends them as one ``sched.w.fb_many``, or alone as
``sched.w.fb``; the rest wait for their answer or their turn to send. Calls that arrive while a
batch runs gather for the next one, so a busy learner batches more and an idle one adds at most
``window_s`` to a call.

Every call keeps its idempotency key inside the batch (the worker answers a resent item with its
first result), and each caller gets its own answer. A failure stays with the call that caused it:
a batch the learner answers with an error (one call's data or loss config refused, one adapter's
loss or gradient not finite, the pass itself failing) is sent again call by call, so each caller
gets its own answer or error. That is safe because the learner keeps a failed batch's gradients
all or nothing (``MultiAdapterLearner.forward_backward_many``): none of them stayed. A failure of
the send itself (the learner did not answer) is every caller's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polytinker.engine.worker.messages import LearnerForwardBackward, LearnerForwardBackwardMany
from polytinker.errors import RemoteError
from polytinker.scheduler.service.replies import ForwardBackwardManyReply, ForwardBackwardReply
from polytinker.transport import kind_of

Prepare = tuple[str, Callable[[Any], None]]
# (kind, payload, prepares) -> the learner's answer; the broker's keyed call to one learner (the
# kind is the payload's, kind_of(type(payload)): for a sender that records what it was sent).
Send = Callable[[str, Any, list[Prepare]], Any]


@dataclass
class _Call:
    req: LearnerForwardBackward
    prepare: Prepare
    done: bool = False
    reply: ForwardBackwardReply | None = None
    error: BaseException | None = None

    def outcome(self) -> ForwardBackwardReply:
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply


def _joins(call: _Call, batch: list[_Call]) -> bool:
    first = batch[0].req
    return (
        not call.req.full
        and not first.full
        and (call.req.loss_fn, call.req.loss_fn_config) == (first.loss_fn, first.loss_fn_config)
        and all(c.req.adapter != call.req.adapter for c in batch)
    )


class FbBatcher:
    """The ``forward_backward`` calls of one learner, batched as they meet (module docstring)."""

    def __init__(self, send: Send, window_s: float, max_calls: int) -> None:
        self._send, self._window_s, self._max_calls = send, window_s, max_calls
        self._cv = threading.Condition()
        self._queue: list[_Call] = []
        self._sending = False
        self.batches = 0  # sends of two or more calls
        self.batched_calls = 0  # calls that went in them

    def call(self, req: LearnerForwardBackward, prepare: Prepare) -> ForwardBackwardReply:
        me = _Call(req, prepare)
        with self._cv:
            self._queue.append(me)
            self._cv.notify_all()  # a sender gathering its batch counts this call
            while not me.done and self._sending:
                self._cv.wait()
            if me.done:
                return me.outcome()
            self._sending = True
        try:
            self._run(self._gather(me))
        finally:
            with self._cv:
                self._sending = False
                self._cv.notify_all()
        return me.outcome()

    def _gather(self, me: _Call) -> list[_Call]:
        """``me`` and the waiting calls that can share its pass, taken off the queue."""
        deadline = time.monotonic() + self._window_s
        with self._cv:
            while True:
                batch = [me]
                for c in self._queue:
                    if c is not me and len(batch) < self._max_calls and _joins(c, batch):
                        batch.append(c)
                left = deadline - time.monotonic()
                if me.req.full or len(batch) >= self._max_calls or left <= 0:  # a full-parameter call goes alone
                    break
                self._cv.wait(left)
            for c in batch:
                self._queue.remove(c)
            return batch

    def _run(self, batch: list[_Call]) -> None:
        try:
            if len(batch) == 1:
                self._one(batch[0])
                return
            msg = LearnerForwardBackwardMany(tuple(c.req for c in batch))
            try:
                out: ForwardBackwardManyReply = self._send(kind_of(type(msg)), msg, [c.prepare for c in batch])
            except RemoteError:
                for c in batch:  # the learner kept none of the batch: each call alone, for its own answer
                    self._one(c)
                return
            self.batches += 1
            self.batched_calls += len(batch)
            for c, reply in zip(batch, out.results, strict=True):
                c.reply = reply
        except BaseException as exc:
            for c in batch:
                if c.reply is None and c.error is None:
                    c.error = exc
        finally:
            with self._cv:
                for c in batch:
                    c.done = True
                self._cv.notify_all()

    def _one(self, c: _Call) -> None:
        try:
            c.reply = self._send(kind_of(type(c.req)), c.req, [c.prepare])
        except Exception as exc:
            c.error = exc


__all__ = ["FbBatcher"]
