"""Process actors: real child processes, real sockets."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from fixtures.actors import BreaksInBackground, Counter, Crashy, FailsOnStart, Nest, Overlap, Quiet, Scale, StubbornStop

from polytinker.actors import (
    EXIT_FAILED,
    Actor,
    ActorConfig,
    ActorStartError,
    RestartPolicy,
    handler,
    read_log,
    spawn,
)
from polytinker.errors import ActorDeadError, ActorError, ConfigError, ProtocolError, RemoteError, RequestTimeout

pytestmark = pytest.mark.timeout(60)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def counter(tmp_path):
    ref = spawn(Counter, 10, name="counter", run_dir=tmp_path)
    yield ref
    ref.kill()


def test_ask_and_tell_round_trip(counter):
    assert counter.alive and counter.pid and counter.name == "counter"
    assert counter.ask("add", 5) == 15
    counter.tell("add", 100)  # a tell is queued before the next ask, so the ask sees it
    assert counter.ask("get") == 115
    futures = [counter.ask_async("add", 1) for _ in range(20)]
    results = sorted(f.result(timeout=10) for f in futures)
    assert results == list(range(116, 136))
    assert counter.ask("pid") == counter.pid != os.getpid()


def test_handler_error_goes_back_to_the_asker_and_the_actor_keeps_serving(counter):
    with pytest.raises(RemoteError) as info:
        counter.ask("fail", "bad input")
    assert info.value.remote_type == "ValueError"
    assert "bad input" in str(info.value)
    assert "def fail" in info.value.remote_traceback or "in fail" in info.value.remote_traceback
    # An unknown kind is refused before it is sent (a tell would otherwise fail unseen).
    with pytest.raises(ProtocolError, match=r"no handler for kind 'nope'.*add"):
        counter.ask("nope")
    with pytest.raises(ProtocolError, match="'nope'"):
        counter.tell("nope")
    assert counter.ask("add", 1) == 11
    assert counter.alive


def test_message_to_a_stopped_actor_raises_actor_dead_error_naming_it(counter, tmp_path):
    assert counter.stop() == 0
    assert not counter.alive and counter.exit_code == 0
    with pytest.raises(ActorDeadError, match="'counter'"):
        counter.ask("get")
    with pytest.raises(ActorDeadError, match="'counter'"):
        counter.tell("add", 1)


def test_graceful_stop_runs_on_stop_after_the_current_message(counter, tmp_path):
    counter.ask("add", 32)
    counter.tell("add", 1)
    assert counter.stop(timeout_s=10) == 0
    # on_stop ran (it writes the total), after the queued tell was handled.
    assert (tmp_path / "counter.stopped").read_text() == "43"


def test_startup_failure_raises_actor_error_with_the_child_traceback(tmp_path):
    with pytest.raises(ActorStartError) as info:
        spawn(FailsOnStart, name="bad", run_dir=tmp_path)
    assert isinstance(info.value, ActorError) and info.value.exit_code == EXIT_FAILED
    assert "connect_to_missing_thing" in info.value.child_traceback
    text = str(info.value)
    assert "cannot reach the thing" in text and "connect_to_missing_thing" in text
    assert isinstance(info.value.__cause__, RemoteError)
    assert info.value.__cause__.remote_type == "RuntimeError"
    records = read_log(tmp_path, "bad")
    assert any(r["level"] == "ERROR" and "startup failed" in r["message"] for r in records)


def test_unimportable_actor_target_is_reported(tmp_path):
    with pytest.raises(ActorError, match="no_such_module"):
        spawn("no_such_module:Thing", name="ghost", run_dir=tmp_path)


def test_stop_kills_an_actor_that_ignores_it_after_the_timeout(tmp_path):
    ref = spawn(StubbornStop, name="stubborn", run_dir=tmp_path)
    t0 = time.monotonic()
    assert ref.stop(timeout_s=0.5) == -9
    assert time.monotonic() - t0 < 5
    assert ref.exit_code == -9 and not ref.alive


def test_handlers_run_one_at_a_time_unless_declared_concurrent(tmp_path):
    ref = spawn(Overlap, name="overlap", run_dir=tmp_path)
    try:
        futures = [ref.ask_async("slow", 0.5), ref.ask_async("slow_table", 0.5), ref.ask_async("slow", 0.5)]
        # A concurrent handler answers (within 0.3 s) while a 0.5 s one holds the mailbox; queued
        # behind the slow ones it could not.
        deadline = time.monotonic() + 5
        while ref.ask("peek", timeout_s=0.3) != 1:
            assert time.monotonic() < deadline, "the concurrent handler never saw a slow one running"
        assert max(f.result(timeout=10) for f in futures) == 1
    finally:
        ref.kill()


def test_ask_times_out_and_the_actor_survives(tmp_path):
    ref = spawn(Overlap, name="slowpoke", run_dir=tmp_path)
    try:
        with pytest.raises(RequestTimeout):
            ref.ask("slow", 1.0, timeout_s=0.2)
        assert ref.ask("peek") in (0, 1)
    finally:
        ref.kill()


def test_failed_tell_stops_the_actor_with_its_traceback(tmp_path):
    ref = spawn(Crashy, name="crashy", run_dir=tmp_path)
    pid = ref.pid
    ref.tell("crash", "lost key")
    deadline = time.monotonic() + 10
    while ref.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ref.exit_code == EXIT_FAILED
    traceback_text = (tmp_path / "actors" / f"crashy.{pid}.traceback").read_text()
    assert "KeyError" in traceback_text and "lost key" in traceback_text
    with pytest.raises(ActorDeadError, match="exited with code 1"):
        ref.ask("ok")


def test_an_actor_broken_by_its_own_thread_fails_with_its_traceback(tmp_path):
    """fail_self from a background thread: exit code 1, the traceback kept, on_stop not run, even
    with tell_failure='log' (that policy is about a sender's tells, not the actor's own failure)."""
    ref = spawn(BreaksInBackground, name="breaks", run_dir=tmp_path, config=ActorConfig(tell_failure="log"))
    pid = ref.pid
    assert ref.ask("ok") == "ok"
    ref.tell("break", None)
    deadline = time.monotonic() + 10
    while ref.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ref.exit_code == EXIT_FAILED
    traceback_text = (tmp_path / "actors" / f"breaks.{pid}.traceback").read_text()
    assert "OSError: the child this actor needs is gone" in traceback_text
    assert not any(r["message"] == "on_stop ran" for r in read_log(tmp_path, "breaks"))


def test_an_actor_without_handlers_binds_no_mailbox_and_still_stops_gracefully(tmp_path):
    """One way into a worker's process: its own RPC server, not a second socket for the supervisor."""
    ref = spawn(Quiet, str(tmp_path / "quiet.stopped"), name="quiet", run_dir=tmp_path, config=ActorConfig())
    assert ref.alive and ref.address == ""
    assert not list((tmp_path / "actors").glob("quiet*.sock"))
    assert not [c for c in psutil.Process(ref.pid).net_connections(kind="unix") if c.laddr]
    with pytest.raises(ProtocolError, match="declares no handlers, so it has no mailbox"):
        ref.ask("anything")
    assert ref.stop() == 0  # SIGTERM: on_stop runs as after a stop message
    assert (tmp_path / "quiet.stopped").read_text() == "stopped"


def test_failed_tell_with_log_policy_keeps_serving(tmp_path):
    ref = spawn(Crashy, name="tolerant", run_dir=tmp_path, config=ActorConfig(tell_failure="log"))
    try:
        ref.tell("crash", "ignored")
        assert ref.ask("ok") == "ok"
        assert any("tell 'crash' failed" in r["message"] for r in read_log(tmp_path, "tolerant"))
    finally:
        ref.kill()


def test_logs_are_json_lines_with_the_actor_fields_and_captured_output(counter, tmp_path):
    counter.ask("print", "hello from the child")
    counter.stop()
    path = tmp_path / "actors" / "counter.log"
    assert path.exists()
    records = read_log(tmp_path, "counter")
    assert records, "the log is empty"
    assert all(set(r) == {"time", "level", "actor", "pid", "message", "extra"} for r in records)
    assert all(r["actor"] == "counter" and r["pid"] == counter.pid for r in records)
    start = next(r for r in records if r["message"] == "counter starting")
    assert start["level"] == "INFO" and start["extra"]["start"] == 10
    out = [r for r in records if r["extra"].get("stream") == "stdout"]
    err = [r for r in records if r["extra"].get("stream") == "stderr"]
    assert [r["message"] for r in out] == ["hello from the child"]
    assert [r["message"] for r in err] == ["err: hello from the child"]


def test_actor_handlers_are_collected_and_checked():
    class Local(Actor):
        @handler("a")
        def a(self, p):
            return p

    assert set(Local.handler_specs()) == {"a"}
    assert Local().dispatch("a", 3) == 3  # in-process construction works (unit tests of handlers)
    with pytest.raises(ConfigError, match="two handlers"):

        class Twice(Actor):
            @handler("x")
            def one(self, p): ...

            @handler("x")
            def two(self, p): ...

    with pytest.raises(ConfigError, match="non-empty"):
        handler("")
    with pytest.raises(ConfigError, match="defined inside a function"):
        spawn(Local)


@pytest.mark.parametrize(
    ("make", "fix"),
    [
        (lambda: ActorConfig(start_timeout_s=0), "start_timeout_s"),
        (lambda: ActorConfig(transport="udp"), "'ipc' or 'tcp'"),
        (lambda: RestartPolicy(max_restarts=-1), "max_restarts"),
        (lambda: RestartPolicy(backoff_factor=0.5), "backoff_factor"),
        (lambda: RestartPolicy(backoff_initial_s=5, backoff_max_s=1), "backoff_max_s"),
    ],
)
def test_config_validation_says_how_to_fix(make, fix):
    with pytest.raises(ConfigError, match=fix):
        make()


def test_bad_names_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="file name"):
        spawn(Counter, name="../escape", run_dir=tmp_path)


def test_tcp_transport(tmp_path):
    ref = spawn(Counter, 1, name="tcp", run_dir=tmp_path, config=ActorConfig(transport="tcp"))
    try:
        assert ref.address.startswith("tcp://127.0.0.1:")
        assert ref.ask("add", 1) == 2
    finally:
        assert ref.stop() == 0


def test_an_actor_dying_mid_call_fails_the_call_with_actor_dead_error(counter):
    pending = counter.ask_async("sleep", 30)
    time.sleep(0.2)
    os.kill(counter.pid, signal.SIGKILL)
    with pytest.raises(ActorDeadError, match="exited with code -9"):
        pending.result(timeout=5)
    assert counter.exit_code == -9


def test_arrays_travel_through_the_mailbox(counter):
    data = np.arange(100_000, dtype=np.float32).reshape(100, 1000)
    back = counter.ask("echo", {"x": data, "tag": "t"})
    assert back["tag"] == "t" and back["x"].dtype == np.float32
    np.testing.assert_array_equal(back["x"], data)


def test_typed_messages_arrive_as_their_type_and_other_payloads_are_refused(counter):
    assert counter.ask("scale", Scale(3)) == 30
    with pytest.raises(ProtocolError, match="takes a Scale, got dict"):
        counter.ask("scale", {"factor": 3})
    with pytest.raises(ProtocolError, match="takes a Scale, got int"):
        counter.tell("scale", 3)
    assert counter.ask("get") == 30


def test_the_actor_process_stays_light(counter):
    # Startup time: the machinery must not pull in torch or transformers for an actor that does not.
    assert counter.ask("modules", ["torch", "transformers", "polytinker.actors._actor"]) == ["polytinker.actors._actor"]
    assert counter.ping() == {"name": "counter", "pid": counter.pid}


def test_a_long_run_dir_still_gets_an_ipc_mailbox(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    ref = spawn(Counter, 2, name="deep", run_dir=deep)
    try:
        assert ref.address.startswith("ipc://") and len(ref.address) < 110
        assert ref.ask("add", 1) == 3
        assert (deep / "actors" / "deep.log").exists()
    finally:
        ref.stop()


def test_an_actor_can_spawn_actors_and_stopping_it_stops_them(tmp_path):
    outer = spawn(Nest, name="nest", run_dir=tmp_path)
    inner_pid = outer.ask("inner_pid")
    assert outer.ask("inner_add", 2) == 7
    assert outer.stop() == 0
    deadline = time.monotonic() + 10
    while not _gone(inner_pid):
        assert time.monotonic() < deadline, "the inner actor outlived the outer one"
        time.sleep(0.05)
    assert (tmp_path / "nest-inner.stopped").read_text() == "7"  # stopped gracefully: on_stop ran


def test_many_asks_from_threads(counter):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: counter.ask("add", 1), range(200)))
    assert sorted(results) == list(range(11, 211))


def test_the_example_in_the_docs_runs(tmp_path):
    doc = (Path(__file__).parent.parent / "docs" / "actors.md").read_text()
    script = tmp_path / "counter.py"
    script.write_text(doc.split("```python\n", 1)[1].split("```", 1)[0])
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:4] == ["15", "16", "remote error: ZeroDivisionError", "0"]
    assert "'counter'" in lines[4] and "was stopped" in lines[4]
    assert lines[-2:] == ["2", "1 -9"]
    assert (tmp_path / "runs" / "actors-demo" / "actors" / "counter.log").exists()
