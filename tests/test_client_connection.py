"""``Connection.ask``: the client's one typed call. The kind and the reply type come from the
message's class; the scheduler's retry answers are waited out; any other answer is refused, naming
the kind and the type expected. Against a real ``RpcServer`` whose handlers stand in for the
scheduler's (the real scheduler behind it: tests/test_client_inproc.py, test_client_runtime.py)."""

from __future__ import annotations

import pytest

from polytinker.client._connection import Connection
from polytinker.errors import TransportError
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.types import JobState
from polytinker.transport import RpcServer, current_call, handler_table

KEY = "connection-test-key-0123456789"


def test_ask_sends_the_kind_of_the_message_and_returns_its_declared_reply() -> None:
    answers = iter([r.WaitingReply(JobState.QUEUED, 0.01, "queued"), r.JobListReply([], {})])
    kinds: list[str] = []

    def list_jobs(msg: m.ListJobs) -> object:
        call = current_call()
        assert call is not None and msg.api_key == KEY
        kinds.append(call.kind)
        return next(answers)

    with RpcServer("tcp://127.0.0.1:0", handler_table({m.ListJobs: list_jobs})) as server:
        conn = Connection(server.address, KEY)
        try:
            assert conn.ask(m.ListJobs(KEY)) == r.JobListReply([], {})
        finally:
            conn.close()
    assert kinds == ["sched.list_jobs", "sched.list_jobs"]  # the retry answer, then the result


def test_ask_refuses_an_answer_of_another_type() -> None:
    with RpcServer("tcp://127.0.0.1:0", handler_table({m.ListJobs: lambda _msg: r.JobReply({})})) as server:
        conn = Connection(server.address, KEY)
        try:
            with pytest.raises(TransportError, match=r"answered sched\.list_jobs with .*not a JobListReply"):
                conn.ask(m.ListJobs(KEY))
        finally:
            conn.close()
