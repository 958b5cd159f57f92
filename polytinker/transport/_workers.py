"""A lean handler pool: threads started on demand up to a maximum, fed by a C-level queue.

``concurrent.futures.ThreadPoolExecutor`` builds a Future and a work item per task and takes a
semaphore and locks on the way; a server never looks at those futures, and on a 100-byte round
trip that bookkeeping is measurable. Tasks still queued when the pool stops are dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("polytinker.transport.server")


class Workers:
    def __init__(self, max_threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._max = max_threads
        self._name = name
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args))
        with self._lock:
            grow = self._idle == 0 and len(self._threads) < self._max
            if grow:
                self._idle += 1  # counted idle until it takes its first task
                t = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
        if grow:
            t.start()

    def _work(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            with self._lock:
                self._idle -= 1
            if item is None or self._stopped:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # a task must not take its thread down
                log.exception("handler task failed")
            with self._lock:
                self._idle += 1

    def stop(self) -> None:
        """Drop queued tasks; running ones finish in the background (threads are daemons)."""
        self._stopped = True
        for _ in self._threads:
            self._queue.put(None)


__all__ = ["Workers"]
