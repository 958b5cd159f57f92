"""Supervision and process hygiene: restarts after SIGKILL, the restart limit, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from fixtures.actors import Counter, Crashy, DiesSoon

from polytinker.actors import ActorConfig, RestartPolicy, Supervisor, read_log
from polytinker.errors import ActorDeadError

pytestmark = pytest.mark.timeout(60)

FAST = RestartPolicy(max_restarts=3, window_s=30, backoff_initial_s=0.05, backoff_max_s=0.5)


def _wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    """True once ``pid`` is dead; a zombie no one reaped yet counts as dead."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_actor_killed_with_sigkill_comes_back_and_the_same_ref_works(tmp_path):
    with Supervisor(run_dir=tmp_path) as sup:
        ref = sup.spawn(Counter, 1, name="phoenix", config=ActorConfig(restart=FAST))
        assert ref.ask("add", 1) == 2
        old_pid = ref.pid
        os.kill(old_pid, signal.SIGKILL)
        _wait_for(lambda: ref.pid != old_pid, what="the restart")
        assert ref.wait_alive(timeout_s=5)
        assert ref.ask("add", 1) == 2  # a fresh incarnation, built from the same constructor arguments
        report = sup.report()["phoenix"]
        assert report.restarts == 1 and not report.gave_up and report.alive
        assert report.exits[0].pid == old_pid
        assert report.exits[0].exit_code == -9 and report.exits[0].action == "restart"
        assert report.last_traceback == ""  # SIGKILL leaves none: the exit code is the report
    assert not ref.alive


def test_the_restart_limit_holds_and_the_supervisor_reports_giving_up(tmp_path):
    gave_up = []
    policy = RestartPolicy(max_restarts=2, window_s=30, backoff_initial_s=0.05, backoff_factor=2.0)
    with Supervisor(run_dir=tmp_path, on_give_up=gave_up.append) as sup:
        ref = sup.spawn(DiesSoon, name="doomed", config=ActorConfig(restart=policy))
        _wait_for(lambda: bool(gave_up), what="the supervisor to give up")
        report = sup.report()["doomed"]
        assert report.gave_up and not report.alive
        assert report.restarts == 2
        # Each start died with exit code 7: two were restarted, the third made it give up.
        assert [e.exit_code for e in report.exits] == [7, 7, 7]
        assert [e.action for e in report.exits] == ["restart", "restart", "give up"]
        assert gave_up[0].name == "doomed" and gave_up[0].gave_up
        time.sleep(0.3)
        assert sup.report()["doomed"].restarts == 2  # and it stays down
        with pytest.raises(ActorDeadError, match="gave up"):
            ref.ask("anything")
    events = read_log(tmp_path, "supervisor")
    assert [e["extra"]["exit_code"] for e in events if e["message"].startswith("child exited")] == [7, 7, 7]


def test_the_supervisor_keeps_the_last_traceback(tmp_path):
    with Supervisor(run_dir=tmp_path) as sup:
        ref = sup.spawn(Crashy, name="crashy", config=ActorConfig(restart=FAST))
        first = ref.pid
        ref.tell("crash", "the lost key")
        _wait_for(lambda: ref.alive and ref.pid != first, what="the restart")
        report = sup.report()["crashy"]
        assert report.exits[0].exit_code == 1
        assert "KeyError" in report.last_traceback and "the lost key" in report.last_traceback
        assert ref.ask("ok") == "ok"


def test_on_change_reports_each_exit_before_the_restart_and_each_restart(tmp_path):
    changes = []
    with Supervisor(run_dir=tmp_path, on_change=changes.append) as sup:
        ref = sup.spawn(Crashy, name="watched", config=ActorConfig(restart=FAST))
        first = ref.pid
        ref.tell("crash", "the lost key")
        _wait_for(lambda: len(changes) >= 2, what="the exit and the restart")
        exited, restarted = changes[:2]
        assert not exited.alive and exited.restarts == 0 and exited.exits[-1].pid == first
        assert exited.last_error == "KeyError: 'the lost key'"
        assert exited.describe() == f"actor 'watched' is down (0 restarts); last exit code 1 (pid {first}): " + (
            "KeyError: 'the lost key'"
        )
        assert restarted.alive and restarted.restarts == 1 and restarted.pid == ref.pid != first


def test_backoff_grows_exponentially_up_to_its_cap():
    policy = RestartPolicy(backoff_initial_s=0.1, backoff_factor=3.0, backoff_max_s=1.0)
    assert [policy.backoff_s(n) for n in range(4)] == pytest.approx([0.1, 0.3, 0.9, 1.0])


def test_a_stopped_or_transient_clean_exit_is_not_restarted(tmp_path):
    with Supervisor(run_dir=tmp_path) as sup:
        ref = sup.spawn(Counter, name="calm", config=ActorConfig(restart=FAST))
        assert ref.stop() == 0
        time.sleep(0.3)
        report = sup.report()["calm"]
        assert report.restarts == 0 and [e.action for e in report.exits] == ["none"]
        assert not ref.alive
    # A stop that was asked for and went cleanly is news, not a warning; a crash is a warning (above).
    exits = [e for e in read_log(tmp_path, "supervisor") if e["message"].startswith("child exited")]
    assert [(e["level"], e["extra"]["exit_code"]) for e in exits] == [("INFO", 0)]


PARENT = textwrap.dedent(
    """
    import sys, time
    from fixtures.actors import Marker
    from polytinker.actors import spawn
    ref = spawn(Marker, sys.argv[2], name="orphan-candidate", run_dir=sys.argv[1])
    print(ref.pid, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "watchdog-only"])
def test_children_die_with_their_parent(tmp_path, pdeathsig):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    if not pdeathsig:
        env["POLYTINKER_ACTOR_NO_PDEATHSIG"] = "1"
    marker = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), str(marker)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert int(marker.read_text()) == child_pid and not _gone(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        _wait_for(lambda: _gone(child_pid), timeout_s=5, what=f"actor pid {child_pid} to die with its parent")
    finally:
        parent.kill()
        parent.wait()


def test_a_parent_that_exits_normally_stops_its_actors_gracefully(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from fixtures.actors import Counter
        from polytinker.actors import ActorConfig, RestartPolicy, Supervisor, spawn
        # a stop at exit waits each child's stop_timeout_s: generous, so that a loaded machine is no cause
        ref = spawn(Counter, 7, name="left-behind", run_dir=sys.argv[1], config=ActorConfig(stop_timeout_s=30))
        sup = Supervisor(run_dir=sys.argv[1])
        # permanent: even a clean exit would be restarted, were the process not exiting
        restart = RestartPolicy(mode="permanent", backoff_initial_s=0.01)
        config = ActorConfig(restart=restart, stop_timeout_s=30)
        supervised = sup.spawn(Counter, 8, name="supervised", config=config)
        print(ref.pid, supervised.pid, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stderr
    for pid in map(int, out.stdout.split()):
        _wait_for(lambda pid=pid: _gone(pid), timeout_s=5, what=f"actor pid {pid} to stop")
    # on_stop ran in both
    assert (tmp_path / "left-behind.stopped").read_text() == "7"
    assert (tmp_path / "supervised.stopped").read_text() == "8"
    events = [e["message"] for e in read_log(tmp_path, "supervisor")]
    assert "child restarted" not in events and "child exited; restart" not in events, events
    assert {r["pid"] for r in read_log(tmp_path, "supervised")} == {int(out.stdout.split()[1])}
