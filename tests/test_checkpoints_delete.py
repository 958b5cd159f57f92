"""Deleting named checkpoints with polytinker's own client and CLI, and their TTLs: the name stops
resolving, the files go unless something still stands on them, and only the owner deletes."""

from __future__ import annotations

import time

import pytest
from fixtures.client import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker.cli import main as cli_main
from polytinker.errors import AuthError, ConfigError

SEQUENCE = [5, 17, 230, 1400, 9]


def _step(trainer, seed: int) -> None:
    trainer.forward_backward(data(seed), "cross_entropy").result()
    trainer.optim_step({"learning_rate": 0.01}).result()


def test_a_named_sampler_save_past_the_kept_versions_goes_when_deleted() -> None:
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="deleter", seed=2)
        _step(trainer, 1)
        old = trainer.save_weights_for_sampler("old").result().path  # version 1
        for seed in (2, 3, 4):  # version 4: the runtime keeps the last 2 unnamed ones
            _step(trainer, seed)
        assert len(service.create_sampling_client(model_path=old).compute_logprobs(SEQUENCE).result()) == 5
        assert "sampler-old" in service.get_job(trainer.job_id)["checkpoints"]

        with client(KEY_BOB) as bob, pytest.raises(AuthError):
            bob.delete_checkpoint(trainer.job_id, "sampler-old")
        assert service.delete_checkpoint(trainer.job_id, "sampler-old") is True
        assert "sampler-old" not in service.get_job(trainer.job_id)["checkpoints"]
        with pytest.raises(AuthError, match="no saved weights"):
            service.create_sampling_client(model_path=old).compute_logprobs(SEQUENCE).result()
        with pytest.raises(ConfigError, match="has no checkpoint"):
            service.delete_checkpoint(trainer.job_id, "sampler-old")


def test_save_state_checkpoints_are_deleted_unless_a_version_stands_on_them(capsys: pytest.CaptureFixture[str]) -> None:
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="deleter2", seed=3)
        _step(trainer, 5)
        trainer.save_state("unused").result()
        loaded = trainer.save_state("loaded").result().path
        trainer.load_state(loaded).result()  # the job's version now comes from this checkpoint

        base = ["--scheduler", shared_runtime().address, "--api-key", KEY_ALICE]
        assert cli_main(["checkpoints", *base, "delete", trainer.job_id, "unused"]) == 0
        assert "its files deleted" in capsys.readouterr().out
        with pytest.raises(ConfigError, match="no checkpoint"):
            trainer.load_state("unused").result()

        assert service.delete_checkpoint(trainer.job_id, "loaded") is False  # its files stay
        assert "loaded" not in service.get_job(trainer.job_id)["checkpoints"]
        _step(trainer, 6)  # training goes on from the loaded weights
        assert cli_main(["checkpoints", *base, "delete", trainer.job_id, "nope"]) == 1


def test_a_checkpoint_whose_ttl_runs_out_is_deleted() -> None:
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="expirer", seed=4)
        _step(trainer, 7)
        trainer.save_state("brief", ttl_seconds=1).result()
        trainer.save_state("kept").result()
        expires = service.set_checkpoint_ttl(trainer.job_id, "kept", 3600)
        assert expires is not None and expires > time.time() + 3500
        assert set(service.get_job(trainer.job_id)["checkpoint_expiry"]) == {"brief", "kept"}
        assert service.set_checkpoint_ttl(trainer.job_id, "kept", None) is None  # kept for good again
        with pytest.raises(ConfigError, match="ttl"):
            service.set_checkpoint_ttl(trainer.job_id, "kept", -5)

        deadline = time.monotonic() + 30  # the scheduler looks every 5 s
        while "brief" in service.get_job(trainer.job_id)["checkpoints"]:
            assert time.monotonic() < deadline, service.get_job(trainer.job_id)
            time.sleep(0.5)
        job = service.get_job(trainer.job_id)
        assert job["checkpoints"] == ["kept"] and job["checkpoint_expiry"] == {}
        assert any(e["kind"] == "expired" for e in job["events"])
        with pytest.raises(ConfigError, match="no checkpoint"):
            trainer.load_state("brief").result()
