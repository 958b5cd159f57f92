"""The client API against a real runtime: scheduler, engine and learner as processes over ZeroMQ."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import wait

import pytest
from fixtures.client import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker import cli
from polytinker.client import SamplingClient, ServiceClient, TrainingClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import Datum, SamplingParams
from polytinker.errors import NotBuiltError
from polytinker.scheduler.service import AuthError, JobNotRunning, StateStore

ADAM = AdamParams(learning_rate=1e-2)
GREEDY5 = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True, seed=3)


def test_train_then_sample_end_to_end() -> None:
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="hero")
        batch = data(1)
        first = trainer.forward_backward(batch, "cross_entropy")
        step = trainer.optim_step(ADAM)  # queued behind the forward_backward, no wait in between
        assert [len(lp) for lp in first.result().logprobs] == [12] * 4
        assert step.result().version == 1
        again = trainer.forward_backward(batch).result()
        assert again.loss < first.result().loss  # the step moved the adapter towards the data
        assert trainer.optim_step(ADAM).result().version == 2

        sampler = trainer.save_weights_and_get_sampling_client("v2")
        assert sampler.model_path.endswith("/hero@2")
        prompt = batch[0].input_tokens[:4]
        out = sampler.sample(prompt, num_samples=2, sampling_params=GREEDY5).result()
        assert len(out.sequences) == 2 and all(len(s.tokens) == 5 for s in out.sequences)
        # The engine's sampling logprobs are the model's own: compute_logprobs agrees on the same tokens.
        seq = out.sequences[0]
        scored = sampler.compute_logprobs(prompt + seq.tokens).result()
        assert scored[0] is None and len(scored) == len(prompt) + 5
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(scored[len(prompt) :], seq.logprobs, strict=True))
        # The base model scores the same tokens differently from the trained adapter.
        base = service.create_sampling_client(base_model=MODEL)
        base_scored = base.compute_logprobs(prompt + seq.tokens).result()
        assert base_scored[1:] != scored[1:]

    store = StateStore(shared_runtime().config.state_path / "scheduler.sqlite3")
    row = store.adapter(f"alice/{trainer.job_id}/hero")
    assert row is not None and row.version == 2 and row.checkpoint.endswith("v2")
    store.close()


def test_an_engine_that_cannot_read_a_version_gets_its_tensors_over_the_transport() -> None:
    state = shared_runtime().config.state_path
    with client(KEY_ALICE) as alice:
        trainer = alice.create_lora_training_client(MODEL, rank=4, agent="far")
        trainer.forward_backward(data(8)).result()
        trainer.optim_step(ADAM).result()
        sampler = trainer.save_weights_and_get_sampling_client()
        store = StateStore(state / "scheduler.sqlite3")
        row = store.adapter(f"alice/{trainer.job_id}/far")
        store.close()
        assert row is not None and row.export_dir
        # As on an engine with no shared filesystem: the version's export is not where it can read it.
        export, hidden = state / row.export_dir, state / (row.export_dir + ".hidden")
        export.rename(hidden)
        try:
            before = alice.runtime_status()["stats"]
            seq = [5, 6, 7, 8, 9, 10, 11]
            scored = sampler.compute_logprobs(seq).result()
            after = alice.runtime_status()["stats"]
        finally:
            hidden.rename(export)
        assert after["engine-0"]["adapters_received"] == before["engine-0"]["adapters_received"] + 1
        assert after["learner-0"]["adapters_sent"] == before["learner-0"]["adapters_sent"] + 1
        # The tensors sent are the trained version: the engine scores as the learner does.
        learner = trainer.forward([Datum(seq[:-1], seq[1:], [1.0] * 6)]).result()[0]
        assert scored[1:] == pytest.approx(learner, abs=1e-3)


def test_agents_calls_that_meet_at_the_learner_run_as_one_pass() -> None:
    with client(KEY_ALICE) as alice:
        agents = [alice.create_lora_training_client(MODEL, rank=4, agent=f"team-{i}") for i in range(3)]
        batches = [data(20, n=32), data(21), data(22)]
        # What each agent's call gives alone: its forward pass (no gradient, never batched).
        alone = [t.forward(b, "cross_entropy").result() for t, b in zip(agents, batches, strict=True)]
        before = alice.runtime_status()["stats"]["learner-0"]["batched_forward_backward"]
        # Sent together: the second and third arrive while the first runs (its 32 rows take the
        # longest), so at least those two meet in one pass.
        futures = [t.forward_backward(b, "cross_entropy") for t, b in zip(agents, batches, strict=True)]
        outs = [f.result() for f in futures]
        assert alice.runtime_status()["stats"]["learner-0"]["batched_forward_backward"] >= before + 2
        for out, ref in zip(outs, alone, strict=True):
            assert out.loss == pytest.approx(ref.loss, rel=1e-4)
            for a, b in zip(out.logprobs, ref.logprobs, strict=True):
                assert list(a) == pytest.approx(list(b), abs=1e-4)
        assert [t.optim_step(ADAM).result().version for t in agents] == [1, 1, 1]  # each its own step


def test_two_tenants_train_concurrently_and_cannot_touch_each_other() -> None:
    with client(KEY_ALICE) as alice, client(KEY_BOB) as bob:
        ta = alice.create_lora_training_client(MODEL, rank=4, agent="a")
        tb = bob.create_lora_training_client(MODEL, rank=4, agent="b")
        switches_before = alice.runtime_status()["learner_switches"]["learner-0"]

        def train(t: TrainingClient, seed: int) -> None:
            for _ in range(2):
                t.forward_backward(data(seed))
                t.optim_step(ADAM).result()

        threads = [threading.Thread(target=train, args=(t, s)) for t, s in ((ta, 2), (tb, 3))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        sa, sb = ta.save_weights_and_get_sampling_client(), tb.save_weights_and_get_sampling_client()
        assert alice.runtime_status()["learner_switches"]["learner-0"] >= switches_before + 2

        # Requests of both tenants meet in the engine's mixed batches.
        before = alice.runtime_status()["stats"]["engine-0"]["mixed_adapter_batches"]
        futures = [s.sample([5, 6, 7], 1, GREEDY5) for _ in range(6) for s in (sa, sb)]
        wait(futures, timeout=120)
        assert all(f.result().sequences for f in futures)
        assert alice.runtime_status()["stats"]["engine-0"]["mixed_adapter_batches"] > before

        # Bob can neither see, nor sample from, nor change alice's job and adapter.
        assert ta.job_id not in [j["job_id"] for j in bob.list_jobs()]
        with pytest.raises(AuthError):
            bob.get_job(ta.job_id)
        for action in (bob.cancel_job, bob.pause_job):
            with pytest.raises(AuthError):
                action(ta.job_id)
        with pytest.raises(AuthError):
            SamplingClient(bob._connection(), MODEL, sa.model_path).sample([5, 6], 1, GREEDY5).result()
        intruder = TrainingClient(bob._connection(), {**alice.get_job(ta.job_id)["job"]})
        with pytest.raises(AuthError):
            intruder.forward_backward(data(4)).result()
        with pytest.raises(AuthError):
            intruder.optim_step(ADAM).result()
        path = ta.save_state("mine").result()
        with pytest.raises(AuthError):
            tb.load_state(path).result()
        assert alice.get_job(ta.job_id)["adapter"]["version"] == 2  # untouched by bob's attempts


def test_asyncio_variants() -> None:
    async def run() -> tuple[int, int]:
        with client(KEY_BOB) as service:
            trainer = service.create_lora_training_client(MODEL, rank=4, agent="async")
            await trainer.forward_backward_async(data(5))  # Tinker's rule: answers the call's future...
            step = await (await trainer.optim_step_async(ADAM))  # ...to await again
            sampler = await trainer.save_weights_and_get_sampling_client_async()
            outs = await asyncio.gather(*(sampler.sample_async([9, 8, 7], 1, GREEDY5) for _ in range(3)))
            return step.version, sum(len(o.sequences) for o in outs)

    assert asyncio.run(run()) == (1, 3)


def test_pause_resume_cancel_and_the_jobs_command(capsys: pytest.CaptureFixture[str]) -> None:
    address = shared_runtime().address
    with client(KEY_ALICE, job_wait_s=0.5) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="pausable")
        assert cli.main(["jobs", "--scheduler", address, "--api-key", KEY_ALICE, "pause", trainer.job_id]) == 0
        assert f"{trainer.job_id}: paused" in capsys.readouterr().out
        with pytest.raises(JobNotRunning):
            trainer.forward(data(6)).result()
        assert cli.main(["jobs", "--scheduler", address, "--api-key", KEY_ALICE, "resume", trainer.job_id]) == 0
        assert len(trainer.forward(data(6)).result()) == 4
        assert cli.main(["jobs", "--scheduler", address, "--api-key", KEY_ALICE, "list"]) == 0
        listing = capsys.readouterr().out
        assert trainer.job_id in listing and "running" in listing
        assert cli.main(["jobs", "--scheduler", address, "--api-key", KEY_BOB, "list"]) == 0
        assert trainer.job_id not in capsys.readouterr().out
        assert service.cancel_job(trainer.job_id)["state"] == "cancelled"
        kinds = [e["kind"] for e in service.get_job(trainer.job_id)["events"]]
        assert kinds[:2] == ["admit", "start"] and "pause" in kinds and kinds[-1] == "cancel"
    with client(KEY_ALICE) as patient:  # waits up to 600 s for a job that may still run...
        again = TrainingClient(patient._connection(), patient.get_job(trainer.job_id)["job"])
        start = time.monotonic()
        with pytest.raises(JobNotRunning, match="cancelled"):
            again.forward(data(6)).result()
        assert time.monotonic() - start < 10  # ...but not for one that never will


def test_save_and_load_state_restore_weights_and_version() -> None:
    with client(KEY_BOB) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="ckpt")
        batch = data(7)
        trainer.forward_backward(batch)
        trainer.optim_step(ADAM)
        saved = trainer.save_state("after-one").result()
        at_one = trainer.forward(batch).result()
        trainer.forward_backward(batch)
        assert trainer.optim_step(ADAM).result().version == 2
        assert trainer.forward(batch).result() != at_one
        assert trainer.load_state(saved).result().version == 1
        restored = trainer.forward(batch).result()
        pairs = [(a, b) for ra, rb in zip(restored, at_one, strict=True) for a, b in zip(ra, rb, strict=True)]
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in pairs)
        sampler = trainer.save_weights_and_get_sampling_client()
        assert sampler.model_path.endswith("@1")
        assert sampler.sample([1, 2, 3], 1, GREEDY5).result().sequences


def _close(a: list[float | None], b: list[float], tol: float) -> bool:
    return all(x is not None and math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b, strict=True))


def test_full_parameter_job_trains_and_samples_its_own_weights(tmp_path) -> None:
    with client(KEY_ALICE) as service:
        trainer = service.create_training_client(MODEL, agent="full")
        batch = data(8, n=2)
        sequence = batch[0].input_tokens + batch[0].target_tokens_T[-1:]
        base = service.create_sampling_client(base_model=MODEL).compute_logprobs(sequence).result()

        # Version 0 is the base model's weights: sampling it scores like the base model.
        v0 = trainer.save_weights_and_get_sampling_client()
        assert v0.model_path.endswith("/full@0")
        assert _close(v0.compute_logprobs(sequence).result()[1:], base[1:], 1e-4)  # type: ignore[arg-type]

        first = trainer.forward_backward(batch).result()
        assert trainer.optim_step(AdamParams(learning_rate=1e-3)).result().version == 1
        assert trainer.forward_backward(batch).result().loss < first.loss
        v1 = trainer.save_weights_and_get_sampling_client()
        assert v1.model_path.endswith("/full@1")
        # The engine serves version 1's weights: its logprobs are the learner's, not the base model's.
        learner = trainer.forward(batch[:1]).result()[0]
        engine = v1.compute_logprobs(sequence).result()[1:]
        assert _close(engine, learner, 1e-3)
        assert not _close(engine, base[1:], 1e-3)  # type: ignore[arg-type]
        out = v1.sample(sequence[:4], num_samples=2, sampling_params=GREEDY5).result()
        assert len(out.sequences) == 2 and all(len(s.tokens) == 5 for s in out.sequences)
        seq = out.sequences[0]
        rescored = v1.compute_logprobs(sequence[:4] + seq.tokens).result()[4:]
        assert _close(rescored, seq.logprobs, 1e-3)
        # Both versions' samplers still work: version 0 is loaded again from its checkpoint.
        assert _close(v0.compute_logprobs(sequence).result()[1:], base[1:], 1e-4)  # type: ignore[arg-type]
        stats = service.runtime_status()["stats"]["engine-0"]
        assert stats["full_weight_loads"] >= 3 and len(stats["full_weight_resident"]) == 1  # one slot

        # Exported, version 1 is a whole Hugging Face model that stock transformers loads and that
        # scores as the engine serves it.
        import torch
        from transformers import AutoModelForCausalLM

        exported = service.export_weights(v1.model_path, tmp_path / "full-v1")
        model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
        ids = torch.tensor([sequence])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        plain = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
        assert _close(plain, engine, 1e-3)  # type: ignore[arg-type]
        with pytest.raises(NotBuiltError, match="full-parameter"):
            service.export_files(v1.model_path)

        trainer.finish()
        assert service.get_job(trainer.job_id)["job"]["state"] == "done"


def test_a_data_parallel_learner_group_serves_a_full_parameter_job_between_lora_jobs(tmp_path) -> None:
    """K=2 replicas turn into a full-parameter job's model and back: the paused LoRA job's adapter
    is reloaded from its checkpoint when it resumes (the broker prepares it again), unchanged."""
    from polytinker.scheduler.service.config import LearnerWorkerConfig, RuntimeConfig

    cfg = RuntimeConfig(
        model=MODEL,
        state_dir=str(tmp_path),
        learners=(LearnerWorkerConfig(world_size=2, micro_batch_size=8),),
        start_timeout_s=240.0,
    )
    with ServiceClient(runtime_config=cfg) as service:
        lora = service.create_lora_training_client(MODEL, rank=4, agent="lora")
        batch = data(21, n=3)
        lora.forward_backward(batch)
        assert lora.optim_step(ADAM).result().version == 1
        before = lora.forward(batch).result()
        service.pause_job(lora.job_id)  # its learner share goes back: the full job may have the group

        full = service.create_training_client(MODEL, agent="full")
        first = full.forward_backward(batch).result()
        assert full.optim_step(AdamParams(learning_rate=1e-3)).result().version == 1
        assert full.forward_backward(batch).result().loss < first.loss
        sampler = full.save_weights_and_get_sampling_client()
        assert sampler.sample([3, 4, 5], 1, GREEDY5).result().sequences
        full.finish()

        service.resume_job(lora.job_id)
        after = lora.forward(batch).result()
        pairs = [(a, b) for ra, rb in zip(after, before, strict=True) for a, b in zip(ra, rb, strict=True)]
        assert max(abs(a - b) for a, b in pairs) < 1e-5
        lora.forward_backward(batch)
        assert lora.optim_step(ADAM).result().version == 2
        stats = service.runtime_status()["stats"]["learner-0"]
        assert stats["loads"] >= 1 and stats["full_slots"] == 0  # the replicas went back to the adapters
