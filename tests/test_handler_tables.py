"""Every handler table a polytinker process serves is keyed by the kinds of request classes: each
key is a registered message name whose class derives from ``Request[R]``, and a handler that
declares its return type declares that ``R``. So a handler cannot sit under a kind its message does
not have, nor answer another reply than its callers (``ask``) expect. The real tables, of a real
engine worker and learner worker (the tiny random model) and a scheduler service."""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from polytinker.engine.inference.worker import EngineWorker
from polytinker.engine.learner.worker import LearnerWorker
from polytinker.engine.models import TINY_RANDOM
from polytinker.engine.worker.config import EngineWorkerConfig, LearnerWorkerConfig
from polytinker.scheduler.service import RuntimeConfig, SchedulerService, TenantConfig
from polytinker.transport import Request, kind_of, message_type, reply_of


def _table_errors(handlers: dict[str, Callable[[Any], Any]]) -> list[str]:
    errors = []
    for kind, handler in handlers.items():
        cls = message_type(kind)
        if cls is None or not issubclass(cls, Request):
            errors.append(f"{kind}: not the name of a request class")
            continue
        assert kind_of(cls) == kind
        declared = typing.get_type_hints(handler).get("return")
        if declared is not None and declared != reply_of(cls):
            errors.append(f"{kind}: the handler answers {declared}, the message declares {reply_of(cls)}")
    return errors


@pytest.fixture
def engine_worker(tmp_path: Path) -> Iterator[EngineWorker]:
    worker = EngineWorker(TINY_RANDOM, EngineWorkerConfig(), tmp_path)
    try:
        yield worker
    finally:
        worker.close()


def test_the_engine_worker_files_its_handlers_under_their_messages_kinds(engine_worker: EngineWorker) -> None:
    handlers = engine_worker.handlers()
    assert "sched.w.sample" in handlers and len(handlers) == 5
    assert _table_errors(handlers) == []


def test_the_learner_worker_files_its_handlers_under_their_messages_kinds(tmp_path: Path) -> None:
    worker = LearnerWorker(TINY_RANDOM, LearnerWorkerConfig(), tmp_path)
    try:
        handlers = worker.handlers()
        assert "sched.w.fb" in handlers and len(handlers) == 10
        assert _table_errors(handlers) == []
    finally:
        worker.close()


def test_the_scheduler_files_its_handlers_under_their_messages_kinds(tmp_path: Path) -> None:
    cfg = RuntimeConfig(
        model="tiny-random",
        state_dir=str(tmp_path),
        tenants=(TenantConfig("alice", api_key="a" * 24),),
        worker_token="w" * 24,
    )
    svc = SchedulerService(cfg, cfg.worker_token)
    try:
        handlers = svc.handlers()
        assert {"sched.create_job", "sched.sample", "sched.usage", "sched.w.register", "sched.w.leave"} <= set(handlers)
        assert len(handlers) == 27
        assert _table_errors(handlers) == []
    finally:
        svc.stop()


def test_a_table_with_a_handler_that_answers_another_reply_is_caught() -> None:
    """The check above can fail: a handler filed under a kind whose reply it does not answer."""

    def wrong(msg: Any) -> int:
        return 0

    assert _table_errors({"sched.w.sample": wrong, "sched.datum": wrong}) == [
        f"sched.w.sample: the handler answers {int}, the message declares {reply_of(message_type('sched.w.sample'))}",
        "sched.datum: not the name of a request class",
    ]
