"""The runtime's state directory holds every tenant's weights: it is 0700, the SQLite file 0600,
and the checkpoints and exports the real learner writes are the serving user's alone."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

from fixtures.client import KEY_ALICE, MODEL, client, data, shared_runtime

from polytinker.engine.learner.config import AdamParams
from polytinker.scheduler.service.home import private_state_dir
from polytinker.scheduler.service.state import StateStore


def _loose(paths: list[Path]) -> list[str]:
    """Those of ``paths`` (and what is under them) that another user could read or write."""
    found = [p for path in paths for p in [path, *path.rglob("*")]]
    return [f"{p} {stat.S_IMODE(p.stat().st_mode):04o}" for p in found if p.stat().st_mode & 0o077]


def test_the_state_directory_and_everything_in_it_is_private_to_its_user() -> None:
    runtime = shared_runtime()
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="private")
        trainer.forward_backward(data(31))
        trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
        trainer.save_weights_and_get_sampling_client()
        trainer.save_state("mine").result()  # done before the files are looked at (no temp file in flight)
    state = runtime.config.state_path
    assert stat.S_IMODE(state.stat().st_mode) == 0o700  # nothing under it is reachable by others
    weights = [state / "checkpoints", state / "adapters"]
    assert list(state.glob("checkpoints/alice/*/private/*")) and list(state.glob("adapters/alice/*/private/*"))
    # And what holds tenants' data is the user's alone by itself too (written with umask 077).
    assert _loose([*weights, *state.glob("scheduler.sqlite3*")]) == []


def test_an_existing_state_dir_is_tightened_with_a_warning(tmp_path, caplog) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    old_db = state / "scheduler.sqlite3"
    old_db.touch()
    old_db.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="polytinker.scheduler.state"):
        assert private_state_dir(state) == state
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert "had mode 0755" in caplog.text
    StateStore(old_db).close()
    assert stat.S_IMODE(old_db.stat().st_mode) == 0o600
    fresh = StateStore(tmp_path / "new" / "db.sqlite3")
    fresh.close()
    assert stat.S_IMODE((tmp_path / "new" / "db.sqlite3").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
