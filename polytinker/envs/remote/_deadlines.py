"""The env server's step timeout: env calls run on the transport's handler thread that serves the
request, and one watcher thread finds those that run past ``step_timeout_s``.

Handing each env call to a separate pool and waiting for it there (as the server once did) cost
two thread hand-offs per request, about half of a remote step's time on the server. Here a call
registers a ``Watch`` (an append to a deque) and marks it done when the env returns; the watcher
looks every ``tick_s`` (a quarter of the timeout, at most 1 s), so an expired call is answered
between ``step_timeout_s`` and ``step_timeout_s + tick_s`` after it started. Deadlines are start
times plus one constant, so the deque is in deadline order and the watcher reads only its head.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Watch:
    """One env call being run: its deadline and what to say when it passes."""

    __slots__ = ("call", "deadline", "done", "episode", "expired", "what")

    def __init__(self, deadline: float, call: Any, episode: str, what: str) -> None:
        self.deadline, self.call, self.episode, self.what = deadline, call, episode, what
        self.done = False  # the env call returned (or raised), or the watcher took it
        self.expired = False  # the watcher took it: the call's answer is the timeout's


class Deadlines:
    """Calls past ``timeout_s`` go to ``on_expired(watch)``, on the watcher thread."""

    def __init__(self, timeout_s: float, on_expired: Callable[[Watch], None]) -> None:
        self.timeout_s = timeout_s
        self.tick_s = min(1.0, timeout_s / 4)
        self._on_expired = on_expired
        self._watches: collections.deque[Watch] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="polytinker-env-deadlines", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def watch(self, call: Any, episode: str, what: str) -> Watch:
        """Register an env call about to run (``call``: the transport's request, or None)."""
        w = Watch(time.monotonic() + self.timeout_s, call, episode, what)
        self._watches.append(w)
        return w

    def _run(self) -> None:
        watches = self._watches
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            while watches and (watches[0].done or watches[0].deadline <= now):
                w = watches.popleft()
                if w.done:
                    continue
                w.done = w.expired = True  # (a call that returned just now answers itself: fail_call says no)
                try:
                    self._on_expired(w)
                except Exception:  # the watcher must outlive any one call
                    log.exception("answering the expired env call %s of episode %s failed", w.what, w.episode)


__all__ = ["Deadlines", "Watch"]
