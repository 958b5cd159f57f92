"""How the gateway's sessions end, on its own SQLite store (no scheduler): a session silent past
``session_timeout_s`` is finished as ``timeout`` and filed as ending; a restarted gateway gives
every open session a fresh timeout and finds the endings its predecessor left; a heartbeat of a
finished session is refused (the route answers 410); the first finish stands."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from polytinker.errors import ConfigError
from polytinker.gateway.sessions import Sessions
from polytinker.gateway.store import GatewayStore
from polytinker.gateway.tinker_names import named_sampler, named_sampler_path


def test_a_silent_session_ends_and_a_restart_gives_open_ones_a_fresh_timeout(tmp_path: Path) -> None:
    store = GatewayStore(tmp_path / "gateway.sqlite")
    store.add_session("session-a", "alice")
    store.add_session("session-b", "alice")
    sessions = Sessions(store, lambda owner: None, timeout_s=30.0)  # no tenant seen: endings wait
    now = time.time()
    assert sessions.sweep(now) == [] and not store.session_finished("session-a")
    assert sessions.heartbeat("alice", "session-b")
    with pytest.raises(ConfigError):
        sessions.heartbeat("bob", "session-b")  # another tenant's session reads as unknown
    store.heartbeat("session-b")

    assert sessions.sweep(now + 31.0) == []  # both silent 31 s: finished, filed as ending
    assert store.session_finished("session-a") and store.session_finished("session-b")
    assert sorted(store.endings()) == [("session-a", "alice"), ("session-b", "alice")]
    assert not sessions.heartbeat("alice", "session-a")  # the route answers 410: the SDK stops
    assert not store.finish_session("session-a", "success", None)  # the first finish stood

    store.add_session("session-c", "alice")
    store.close()
    restarted = GatewayStore(tmp_path / "gateway.sqlite")
    with restarted._lock:  # the gateway was down an hour: no heartbeat could arrive meanwhile
        restarted._db.execute("UPDATE sessions SET last_heartbeat = ?", (time.time() - 3600.0,))
    assert restarted.silent_sessions(time.time() - 30.0) == ["session-c"]
    Sessions(restarted, lambda owner: None, timeout_s=30.0)  # a fresh timeout for the open ones
    assert restarted.silent_sessions(time.time() - 30.0) == []
    assert restarted.silent_sessions(time.time() + 1.0) == ["session-c"]  # silent from now on
    assert sorted(s for s, _ in restarted.endings()) == ["session-a", "session-b"]  # left to finish
    restarted.ended("session-a")
    assert [s for s, _ in restarted.endings()] == ["session-b"]


def test_a_named_sampler_path_is_told_from_a_version_path() -> None:
    path = named_sampler_path("lorarl-1", "best")
    assert path == "tinker://lorarl-1/sampler_weights/best"
    assert named_sampler(path) == ("lorarl-1", "best")
    assert named_sampler("tinker://lorarl-1/sampler_weights/default@3") is None
    assert named_sampler("tinker://lorarl-1/weights/best") is None
    with pytest.raises(ConfigError):
        named_sampler("tinker://lorarl-1/sampler_weights/..")
