"""Actor classes the actor tests start in child processes (kept light: the child imports this module)."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from polytinker.actors import Actor, handler, spawn
from polytinker.transport import message


@message("scale")
@dataclass(frozen=True)
class Scale:
    """A typed message: registered under the kind it is sent with, in a module both sides import."""

    factor: int

    def __post_init__(self) -> None:
        if self.factor == 0:
            raise ValueError("Scale.factor must not be 0")


class Counter(Actor):
    """Adds numbers; records its lifecycle in files under the run dir so tests can see it."""

    def __init__(self, start: int = 0) -> None:
        self.total = start

    def on_start(self) -> None:
        self.log.info("counter starting", extra={"start": self.total})

    def on_stop(self) -> None:
        assert self.run_dir is not None
        (self.run_dir / f"{self.name}.stopped").write_text(str(self.total))

    @handler("add")
    def add(self, amount: int) -> int:
        self.total += amount
        return self.total

    @handler("get")
    def get(self, _payload: Any) -> int:
        return self.total

    @handler("fail")
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @handler("pid")
    def pid(self, _payload: Any) -> int:
        return os.getpid()

    @handler("scale")
    def scale(self, msg: Scale) -> int:
        assert isinstance(msg, Scale)
        self.total *= msg.factor
        return self.total

    @handler("modules")
    def modules(self, names: list[str]) -> list[str]:
        return [n for n in names if n in sys.modules]

    @handler("echo")
    def echo(self, payload: Any) -> Any:
        return payload

    @handler("sleep")
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @handler("print")
    def print_(self, text: str) -> None:
        print(text)
        print(f"err: {text}", file=sys.stderr)


class Overlap(Actor):
    """Records how many handlers run at once, to check the mailbox serialises them."""

    # The explicit-table form of registering a handler, next to the decorator form.
    handler_table: ClassVar[dict[str, str]] = {"slow_table": "slow"}

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.guard = threading.Lock()

    def slow(self, seconds: float) -> int:
        with self.guard:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(seconds)
        with self.guard:
            self.running -= 1
        return self.peak

    @handler("slow")
    def slow_handler(self, seconds: float) -> int:
        return self.slow(seconds)

    @handler("peek", concurrent=True)
    def peek(self, _payload: Any) -> int:
        return self.running


class FailsOnStart(Actor):
    def on_start(self) -> None:
        self.connect_to_missing_thing()

    def connect_to_missing_thing(self) -> None:
        raise RuntimeError("cannot reach the thing")


class StubbornStop(Actor):
    """on_stop never finishes: only SIGKILL ends it."""

    def on_stop(self) -> None:
        time.sleep(120)


class Crashy(Actor):
    """A tell to 'crash' raises with no asker; the process dies with exit code 1 (tell_failure='stop')."""

    @handler("crash")
    def crash(self, message: str) -> None:
        raise KeyError(message)

    @handler("ok")
    def ok(self, _payload: Any) -> str:
        return "ok"


class DiesSoon(Actor):
    """Exits abnormally a moment after it starts, every time: a child a supervisor must give up on."""

    def on_start(self) -> None:
        threading.Timer(0.5, os._exit, (7,)).start()  # time enough to report ready, even on a busy machine


class Marker(Actor):
    """Writes its pid to a file on start (for the parent-death test)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_start(self) -> None:
        self.path.write_text(str(os.getpid()))


class Nest(Actor):
    """Spawns a Counter of its own: actors can start actors."""

    def on_start(self) -> None:
        self.inner = spawn(Counter, 5, name=f"{self.name}-inner", run_dir=self.run_dir)

    @handler("inner_add")
    def inner_add(self, amount: int) -> int:
        result: int = self.inner.ask("add", amount)
        return result

    @handler("inner_pid")
    def inner_pid(self, _payload: Any) -> int | None:
        return self.inner.pid
