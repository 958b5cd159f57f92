"""Publishing named checkpoints with polytinker's own client and CLI: a published sampler save
samples for every tenant, a published ``save_state`` checkpoint starts another tenant's job; an
unpublished one is the owner's alone again, and only the owner publishes, deletes or sets TTLs."""

from __future__ import annotations

import pytest
from fixtures.client import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker.cli import main as cli_main
from polytinker.errors import AuthError, ConfigError, JobNotRunning

SEQUENCE = [5, 17, 230, 1400, 9]


def _stepped(service, agent: str, seed: int):
    """A LoRA job of ``service``'s one optimizer step away from its fresh adapter."""
    trainer = service.create_lora_training_client(MODEL, rank=4, agent=agent, seed=seed)
    trainer.forward_backward(data(seed), "cross_entropy").result()
    trainer.optim_step({"learning_rate": 0.01}).result()
    return trainer


def test_a_published_sampler_save_samples_for_another_tenant_until_unpublished(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with client(KEY_ALICE) as alice, client(KEY_BOB) as bob:
        trainer = _stepped(alice, "publisher", 5)
        path = trainer.save_weights_for_sampler("shared").result().path
        own = alice.create_sampling_client(model_path=path).compute_logprobs(SEQUENCE).result()
        with pytest.raises(AuthError, match="no saved weights"):
            bob.create_sampling_client(model_path=path).compute_logprobs(SEQUENCE).result()
        with pytest.raises(AuthError):
            bob.weights_info(path)

        base = ["--scheduler", shared_runtime().address, "--api-key", KEY_ALICE]
        assert cli_main(["checkpoints", *base, "publish", trainer.job_id, "sampler-shared"]) == 0
        assert "published" in capsys.readouterr().out
        assert alice.get_job(trainer.job_id)["public_checkpoints"] == ["sampler-shared"]
        info = bob.weights_info(path)
        assert (info.job_id, info.public, info.owned, info.lora["rank"]) == (trainer.job_id, True, False, 4)
        theirs = bob.create_sampling_client(model_path=path).compute_logprobs(SEQUENCE).result()
        assert theirs[1:] == pytest.approx(own[1:], abs=1e-4)  # the very weights alice saved

        # Publishing gives reading only: the checkpoint stays alice's to delete and to publish.
        with pytest.raises(AuthError):
            bob.delete_checkpoint(trainer.job_id, "sampler-shared")
        with pytest.raises(AuthError):
            bob.unpublish_checkpoint(trainer.job_id, "sampler-shared")
        assert alice.publish_checkpoint(trainer.job_id, "sampler-shared") is True  # as it was

        assert alice.unpublish_checkpoint(trainer.job_id, "sampler-shared") is True
        with pytest.raises(AuthError, match="no saved weights"):
            bob.create_sampling_client(model_path=path).compute_logprobs(SEQUENCE).result()
        assert alice.create_sampling_client(model_path=path).compute_logprobs(SEQUENCE).result()[1:] == (
            pytest.approx(own[1:], abs=1e-4)
        )


def test_a_published_training_checkpoint_starts_another_tenants_job() -> None:
    with client(KEY_ALICE) as alice, client(KEY_BOB) as bob:
        trainer = _stepped(alice, "teacher", 6)
        state = trainer.save_state("lesson").result().path
        with pytest.raises(AuthError):
            bob.create_training_client_from_state(state)

        assert alice.publish_checkpoint(trainer.job_id, "lesson") is False
        student = bob.create_training_client_from_state(state)
        assert bob.get_job(student.job_id)["lora"]["rank"] == 4  # shaped like the run that saved it
        ref = alice.create_sampling_client(model_path=trainer.save_weights_for_sampler().result().path)
        mine = bob.create_sampling_client(model_path=student.save_weights_for_sampler().result().path)
        assert mine.compute_logprobs(SEQUENCE).result()[1:] == pytest.approx(
            ref.compute_logprobs(SEQUENCE).result()[1:], abs=1e-4
        )
        student.forward_backward(data(3), "cross_entropy").result()  # bob's own job trains on
        student.optim_step({"learning_rate": 0.01}).result()

        # Alice deletes her checkpoint: its files stay, as bob's loaded version stands on them.
        assert alice.delete_checkpoint(trainer.job_id, "lesson") is False
        student.forward_backward(data(4), "cross_entropy").result()


def test_a_copy_outlives_its_source_and_holds_weights_without_training() -> None:
    with client(KEY_ALICE) as alice, client(KEY_BOB) as bob:
        trainer = _stepped(alice, "original", 7)
        state = trainer.save_state("to-copy").result().path
        version = trainer.save_weights_for_sampler("to-copy").result().path
        expected = alice.create_sampling_client(model_path=version).compute_logprobs(SEQUENCE).result()[1:]
        with pytest.raises(AuthError):  # not published: not bob's to copy
            bob.copy_weights(state).result()

        alice.publish_checkpoint(trainer.job_id, "to-copy")
        alice.publish_checkpoint(trainer.job_id, "sampler-to-copy")
        state_copy = bob.copy_weights(state).result()
        version_copy = bob.copy_weights(version, ttl_seconds=3600).result()
        copy_job = bob.weights_info(state_copy).job_id
        assert copy_job != trainer.job_id and bob.weights_info(state_copy).owned
        assert bob.get_job(copy_job)["job"]["state"] == "done"  # it holds weights; it never trains
        assert "sampler-to-copy" in bob.get_job(bob.weights_info(version_copy).job_id)["checkpoint_expiry"]

        # The source goes; the copies stay whole (hard links).
        alice.unpublish_checkpoint(trainer.job_id, "to-copy")
        alice.delete_checkpoint(trainer.job_id, "to-copy")
        alice.delete_checkpoint(trainer.job_id, "sampler-to-copy")
        scored = bob.create_sampling_client(model_path=version_copy).compute_logprobs(SEQUENCE).result()[1:]
        assert scored == pytest.approx(expected, abs=1e-4)
        resumed = bob.create_training_client_from_state(state_copy)
        again = bob.create_sampling_client(model_path=resumed.save_weights_for_sampler().result().path)
        assert again.compute_logprobs(SEQUENCE).result()[1:] == pytest.approx(expected, abs=1e-4)
        with pytest.raises(JobNotRunning):
            bob.attach_training_client(copy_job).forward_backward(data(6), "cross_entropy").result()


def test_a_resent_copy_is_the_first_copy_and_a_tenant_copies_its_own_runs() -> None:
    with client(KEY_ALICE) as alice:
        trainer = _stepped(alice, "copied", 8)  # its job carries its create call's request key
        state = trainer.save_state("mine").result().path
        version = trainer.save_weights_for_sampler().result().path
        first = alice.copy_weights(state, request_key="copy-call-1").result()
        assert alice.copy_weights(state, request_key="copy-call-1").result() == first  # a resend: no second copy
        of_version = alice.copy_weights(version, request_key="copy-call-2").result()
        assert alice.copy_weights(version, request_key="copy-call-2").result() == of_version
        jobs = {j["job_id"] for j in alice.list_jobs()}
        copies = {alice.weights_info(p).job_id for p in (first, of_version)}
        assert copies <= jobs and len(copies) == 2 and trainer.job_id not in copies
        assert alice.copy_weights(state).result() != first  # a new call (its own key): a new copy
        with pytest.raises(ConfigError, match="request_key 'copy-call-1' was already used"):
            alice.copy_weights(version, request_key="copy-call-1").result()  # the key of another copy
