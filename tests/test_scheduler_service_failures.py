"""Failures of real processes: an engine and a learner, and the scheduler, killed with SIGKILL mid-run.

Each is restarted by the runtime's supervisor; the work in flight is retried or recovered, and
the job goes on from its last acknowledged optimizer step."""

from __future__ import annotations

import os
import signal
import time

from fixtures.client import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker.actors import ActorRef
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import SamplingParams
from polytinker.engine.worker.auth import launcher_credential
from polytinker.engine.worker.messages import WorkersQuery
from polytinker.transport import RpcClient

ADAM = AdamParams(learning_rate=1e-2)
LONG = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True, seed=1)
# Long enough to be still generating when the engine is killed half a second in, on any machine.
IN_FLIGHT = SamplingParams(max_tokens=1500, temperature=1.0, ignore_eos=True, seed=1)


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
        unbroken = trainer.optim_step(ADAM).result()
        sampler = trainer.save_weights_and_get_sampling_client()
        before = trainer.forward(batch).result()
        engine, learner = runtime.workers["engine-0"], runtime.workers["learner-0"]
        old_engine, old_learner = engine.pid, learner.pid
        assert old_engine is not None and old_learner is not None
        futures = [sampler.sample([3, 4, 5], 1, IN_FLIGHT) for _ in range(4)]
        time.sleep(0.5)
        assert not any(f.done() for f in futures)  # still generating: in flight on the engine
        os.kill(old_engine, signal.SIGKILL)
        os.kill(old_learner, signal.SIGKILL)
        # Sent again once the supervisor has restarted them; the adapter comes back from its files.
        after = trainer.forward(batch).result()
        results = [f.result(timeout=240) for f in futures]
        assert all(len(r.sequences[0].tokens) == IN_FLIGHT.max_tokens for r in results)
        assert engine.pid != old_engine and learner.pid != old_learner
        pairs = [(a, b) for ra, rb in zip(after, before, strict=True) for a, b in zip(ra, rb, strict=True)]
        assert max(abs(a - b) for a, b in pairs) < 1e-4  # reloaded from the step-1 checkpoint
        stats = service.runtime_status()["stats"]["engine-0"]
        assert stats["adapter_loads"] >= 1 and any(r.startswith("alice/") for r in stats["resident"])
        # A learner killed between a step's forward_backward and its optim_step took that gradient
        # with it: the step is refused (GradientLost), not taken on nothing, and the client sends
        # the step's calls again and then the step: one step on the whole gradient, no error.
        trainer.forward_backward(batch).result()
        restarted = learner.pid
        assert restarted is not None
        os.kill(restarted, signal.SIGKILL)
        replayed = trainer.optim_step(ADAM).result(timeout=240)
        assert learner.pid != restarted
        assert replayed.version == 2 and replayed.metrics["optim/tokens"] == unbroken.metrics["optim/tokens"]
        # The job's events tell its tenant what was lost and what came back, and from where.
        told = [(e["kind"], e["reason"]) for e in service.get_job(trainer.job_id)["events"]]
        restored = "learner-0 restarted (a new process) and loaded it at version 1, from that version's checkpoint"
        lost = "step 2's gradient died with learner-0's process; its calls are sent again"
        assert [t for t in told if t[0] in ("restore", "lost")] == [("restore", restored)] * 2 + [("lost", lost)]
        # The job goes on: another step, and the new version samples on the new engine.
        trainer.forward_backward(batch)
        assert trainer.optim_step(ADAM).result().version == 3
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


def _broker_sees_alive(runtime, worker_id: str) -> bool:
    with RpcClient(runtime.local_address) as rpc:
        query = WorkersQuery(launcher_credential(runtime.config.worker_token))
        workers = rpc.call("sched.w.workers", query, timeout_s=30).workers
    return any(w["worker_id"] == worker_id and w["alive"] for w in workers)


def _learner_stats(service) -> dict:
    return service.runtime_status()["stats"]["learner-0"]


def test_a_learner_wrongly_declared_dead_applies_a_resent_gradient_and_step_once() -> None:
    """SIGSTOP freezes the learner past the broker's heartbeat liveness while it holds a
    forward_backward, then an optim_step: the broker declares it dead and, once it answers again,
    resends the call to it. The learner ran the first copy; the key makes it answer the resend from
    that result, so the adapter ends exactly where a job without the fault does."""
    runtime = shared_runtime()
    learner = runtime.workers["learner-0"]
    dead_after_s = runtime.config.worker_silence_s  # the broker's heartbeat liveness
    batch = data(21)
    with client(KEY_ALICE) as service:
        reference = service.create_lora_training_client(MODEL, rank=4, agent="once-reference")
        resent = service.create_lora_training_client(MODEL, rank=4, agent="once-resent")
        reference.forward_backward(batch)
        expected = reference.optim_step(ADAM).result()
        resent.forward(batch).result()  # its adapter is resident: the next call goes straight to its handler
        before = _learner_stats(service)

        def frozen_while(call):
            pid = learner.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                future = call()
                # Declared dead after worker_silence_s, or longer once it was slow before (the
                # silence limit adapts): the broker's own view says when.
                deadline = time.monotonic() + dead_after_s + 120.0
                while _broker_sees_alive(runtime, "learner-0"):
                    assert time.monotonic() < deadline, "the broker never declared the frozen learner dead"
                    time.sleep(0.2)
                assert not future.done()  # the broker gave up on the frozen learner and waits for it
            finally:
                os.kill(pid, signal.SIGCONT)
            return future.result(timeout=120)

        frozen_while(lambda: resent.forward_backward(batch))
        step = frozen_while(lambda: resent.optim_step(ADAM))
        after = _learner_stats(service)
        assert learner.pid == before["pid"] == after["pid"]  # the same process throughout: not restarted
        assert after["forward_backward"] - before["forward_backward"] == 1
        assert after["optim_steps"] - before["optim_steps"] == 1
        assert after["duplicates"] - before["duplicates"] == 2  # both calls were resent, and answered once
        # One gradient in the step (not two), one version, recorded.
        assert step.version == 1 == expected.version
        assert step.metrics["optim/tokens"] == expected.metrics["optim/tokens"]
        assert service.get_job(resent.job_id)["adapter"]["version"] == 1
        got, want = resent.forward(batch).result(), reference.forward(batch).result()
        pairs = [(a, b) for ra, rb in zip(got, want, strict=True) for a, b in zip(ra, rb, strict=True)]
        assert max(abs(a - b) for a, b in pairs) < 1e-5  # the same weights as one application
        resent.forward_backward(batch)
        assert resent.optim_step(ADAM).result().version == 2  # and the job goes on
