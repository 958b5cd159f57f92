"""Failures of real processes: an engine and a learner, and the scheduler, killed with SIGKILL mid-run.

Each is restarted by the runtime's supervisor; the work in flight is retried or recovered, and
the job goes on from its last acknowledged optimizer step."""

from __future__ import annotations

import os
import signal
import time

from test_client_fixtures import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker.engine.actors import ActorRef
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import SamplingParams

ADAM = AdamParams(learning_rate=1e-2)
LONG = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True, seed=1)


def wait_restarted(ref: ActorRef, old_pid: int | None, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (ref.alive and ref.pid != old_pid):
        assert time.monotonic() < deadline, f"{ref.name} was not restarted"
        time.sleep(0.1)


def test_engine_and_learner_killed_mid_run_work_is_retried_and_the_job_goes_on() -> None:
    runtime = shared_runtime()
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="survivor")
        batch = data(11)
        trainer.forward_backward(batch)
        trainer.optim_step(ADAM).result()
        sampler = trainer.save_weights_and_get_sampling_client()
        before = trainer.forward(batch).result()
        engine, learner = runtime.workers["engine-0"], runtime.workers["learner-0"]
        old_engine, old_learner = engine.pid, learner.pid
        assert old_engine is not None and old_learner is not None
        futures = [sampler.sample([3, 4, 5], 1, LONG) for _ in range(4)]
        time.sleep(0.5)
        assert not any(f.done() for f in futures)  # still generating: in flight on the engine
        os.kill(old_engine, signal.SIGKILL)
        os.kill(old_learner, signal.SIGKILL)
        # Sent again once the supervisor has restarted them; the adapter comes back from its files.
        after = trainer.forward(batch).result()
        results = [f.result(timeout=240) for f in futures]
        assert all(len(r.sequences[0].tokens) == LONG.max_tokens for r in results)
        assert engine.pid != old_engine and learner.pid != old_learner
        pairs = [(a, b) for ra, rb in zip(after, before, strict=True) for a, b in zip(ra, rb, strict=True)]
        assert max(abs(a - b) for a, b in pairs) < 1e-4  # reloaded from the step-1 checkpoint
        stats = service.runtime_status()["stats"]["engine-0"]
        assert stats["adapter_loads"] >= 1 and any(r.startswith("alice/") for r in stats["resident"])
        # The job goes on: another step, and the new version samples on the new engine.
        trainer.forward_backward(batch)
        assert trainer.optim_step(ADAM).result().version == 2
        assert trainer.save_weights_and_get_sampling_client().sample([3, 4], 1, LONG).result().sequences


def test_scheduler_killed_and_restarted_recovers_jobs_without_losing_a_step() -> None:
    runtime = shared_runtime()
    assert runtime.scheduler is not None
    with client(KEY_BOB) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="phoenix")
        for _ in range(2):
            trainer.forward_backward(data(12))
            trainer.optim_step(ADAM).result()  # acknowledged: durable from here on
        sampler = trainer.save_weights_and_get_sampling_client()
        old_pid = runtime.scheduler.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        wait_restarted(runtime.scheduler, old_pid)
        job = service.get_job(trainer.job_id)  # the client rides out the restart
        assert job["job"]["state"] == "running" and job["adapter"]["version"] == 2
        assert sum(e["kind"] == "start" for e in job["events"]) == 2  # started again by the new scheduler
        # Workers re-registered; training continues from version 2, sampling from saved versions.
        trainer.forward_backward(data(12))
        assert trainer.optim_step(ADAM).result().version == 3
        assert sampler.sample([7, 8], 1, LONG).result().sequences
