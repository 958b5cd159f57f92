"""The audit log and usage counts with polytinker's own client and CLI: each act on saved weights
is one entry in the acting tenant's log and in the owner's, so the owner of a published
checkpoint sees another tenant's reads of it; a day without acts is empty, and bad arguments are
refused at the edge. Usage counts each call's tokens by kind and job, and storage the named
checkpoints a tenant keeps."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from fixtures.client import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker.cli import main as cli_main
from polytinker.errors import ConfigError
from polytinker.model_path import CheckpointPath
from polytinker.scheduler.service.audit import saved_path
from polytinker.scheduler.service.state_rows import JobRow

SEQUENCE = [5, 17, 230, 1400, 9]


def _acts(log, job_ids: set[str]) -> list[tuple[str, str, str, str | None]]:
    """(event, tenant, path, purpose) of the entries about ``job_ids``, in order."""
    return [(e.event, e.tenant, e.path, e.details.get("purpose")) for e in log.entries if e.job_id in job_ids]


def test_each_act_on_saved_weights_is_logged_for_the_actor_and_the_owner(capsys: pytest.CaptureFixture[str]) -> None:
    with client(KEY_ALICE) as alice, client(KEY_BOB) as bob:
        trainer = alice.create_lora_training_client(MODEL, rank=4, agent="audited", seed=3)
        trainer.forward_backward(data(1), "cross_entropy").result()
        trainer.optim_step({"learning_rate": 0.01}).result()
        state = trainer.save_state("lesson").result().path
        version = trainer.save_weights_for_sampler("shown").result().path
        alice.set_checkpoint_ttl(trainer.job_id, "lesson", 3600)
        alice.publish_checkpoint(trainer.job_id, "lesson")
        alice.publish_checkpoint(trainer.job_id, "lesson")  # as it was: no second entry

        student = bob.create_training_client_from_state(state)  # bob reads alice's checkpoint
        sampler = alice.create_sampling_client(model_path=version)
        for _ in range(3):  # one read a day per reader and version, however many calls
            sampler.compute_logprobs(SEQUENCE).result()
        alice.unpublish_checkpoint(trainer.job_id, "lesson")
        alice.delete_checkpoint(trainer.job_id, "sampler-shown")

        ours = {trainer.job_id}
        assert _acts(alice.audit_log(), ours) == [
            ("checkpoint_create", "alice", state, None),
            ("checkpoint_create", "alice", version, None),
            ("checkpoint_ttl_set", "alice", state, None),
            ("checkpoint_publish", "alice", state, None),
            ("checkpoint_read", "bob", state, "load_state"),  # the owner sees who read it
            ("checkpoint_read", "alice", version, "sample"),
            ("checkpoint_unpublish", "alice", state, None),
            ("checkpoint_delete", "alice", version, None),
        ]
        read = next(e for e in bob.audit_log().entries if e.job_id == trainer.job_id)
        assert (read.event, read.owner, read.details["into"]) == ("checkpoint_read", "alice", student.job_id)
        assert [e.event for e in bob.audit_log().entries if e.job_id == trainer.job_id] == ["checkpoint_read"]
        assert bob.audit_log(event_type="projects").entries == []  # no projects here: nothing

        yesterday = (datetime.now(UTC) - timedelta(days=1)).date()
        assert _acts(alice.audit_log(yesterday), ours) == []
        with pytest.raises(ConfigError, match="event_type"):
            alice.audit_log(event_type="everything")
        with pytest.raises(ConfigError, match="day"):
            alice.audit_log("last tuesday")

        base = ["--scheduler", shared_runtime().address, "--api-key", KEY_ALICE]
        assert cli_main(["audit", *base, "--json"]) == 0
        rows = [row for row in json.loads(capsys.readouterr().out) if row["job_id"] == trainer.job_id]
        assert [row["event"] for row in rows][:2] == ["checkpoint_create", "checkpoint_create"]
        assert cli_main(["audit", *base]) == 0
        assert "checkpoint_publish" in capsys.readouterr().out


def test_a_named_checkpoint_is_named_by_the_path_its_tenant_uses() -> None:
    job = JobRow("lorarl-1", "alice", "lora_rl", MODEL, "a", {}, "running", 0, 0, "", 0.0, 0.0)  # type: ignore[arg-type]
    assert saved_path(job, "lesson", 3) == str(CheckpointPath("lorarl-1", "lesson"))
    assert saved_path(job, "sampler-shown", 3) == "polytinker://lorarl-1/a@3"


def test_usage_counts_each_calls_tokens_and_storage_the_checkpoints_kept(capsys: pytest.CaptureFixture[str]) -> None:
    with client(KEY_BOB) as bob:
        held = bob.storage_usage()
        trainer = bob.create_lora_training_client(MODEL, rank=4, agent="metered", seed=4)
        batch = data(2)  # 4 datums of 12 tokens
        trainer.forward_backward(batch, "cross_entropy").result()
        trainer.forward(batch[:1], "cross_entropy").result()
        trainer.optim_step({"learning_rate": 0.01}).result()
        trainer.save_state("metered").result()
        sampler = bob.create_sampling_client(model_path=trainer.save_weights_for_sampler().result().path)
        out = sampler.sample([5, 17, 230], num_samples=2, sampling_params={"max_tokens": 4}).result()
        sampler.compute_logprobs(SEQUENCE).result()

        now = time.time()
        used = bob.usage(now - 3600, now + 3600)
        mine: dict[str, int] = {}
        for row in used.rows:
            if row.job_id == trainer.job_id:
                assert row.base_model == MODEL
                mine[row.kind] = mine.get(row.kind, 0) + row.count
        assert mine == {
            "training": 4 * 12 + 12,
            "checkpoint": 1,
            "sampling_prefill": 3 + len(SEQUENCE),
            "sampling_sample": sum(len(s.tokens) for s in out.sequences),
        }
        after = bob.storage_usage()
        assert after.checkpoint_count == held.checkpoint_count + 1 and after.size_bytes > held.size_bytes
        with pytest.raises(ConfigError, match="14 days"):
            bob.usage(now - 15 * 86400, now)

        base = ["--scheduler", shared_runtime().address, "--api-key", KEY_BOB]
        assert cli_main(["usage", *base, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert {u["kind"] for u in report["usage"] if u["job_id"] == trainer.job_id} == set(mine)
        assert report["storage"]["checkpoint_count"] == after.checkpoint_count
