"""The runtime's own servers under the hostile storm of tests/storm.py: the scheduler (its tenant
socket) and each worker, reached as the scheduler reaches it. Every server stays up, answers every
request it owes with one well-formed error (no traceback), keeps its memory bounded, and serves
real requests afterwards (a training step and a sample through the real client)."""

from __future__ import annotations

import psutil
from fixtures.client import KEY_ALICE, MODEL, client, data, shared_runtime
from storm import storm

from polytinker.engine.types import SamplingParams
from polytinker.engine.worker.auth import launcher_credential, scheduler_client_keypair, worker_keypair
from polytinker.engine.worker.messages import WorkersQuery
from polytinker.transport import ClientCurve, RpcClient

SCHEDULER_KINDS = ["sched.create_job", "sched.sample", "sched.forward_backward", "sched.runtime_status"]
ENGINE_KINDS = ["sched.w.sample", "sched.w.logprobs", "sched.w.stats"]
LEARNER_KINDS = ["sched.w.fb", "sched.w.step", "sched.w.export", "sched.w.ensure", "sched.w.stats"]


def _pid(name: str) -> int:
    return next(a.pid for a in shared_runtime().actors() if a.name == name)


def _still_serves() -> None:
    with client(KEY_ALICE) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, agent="storm")
        trainer.forward_backward(data(1), "cross_entropy").result()
        trainer.optim_step().result()
        sampler = trainer.save_weights_and_get_sampling_client("after-storm")
        assert sampler.sample([1, 2, 3], 1, SamplingParams(max_tokens=2)).result().sequences


def test_the_scheduler_survives_the_storm_and_serves_after_it():
    runtime = shared_runtime()
    pid = _pid("scheduler")
    report = storm(runtime.address, SCHEDULER_KINDS, pid=pid)
    assert psutil.pid_exists(pid) and _pid("scheduler") == pid, "the scheduler died (and was restarted)"
    assert report.growth_bytes < 96 << 20, report
    _still_serves()


def test_the_workers_survive_the_storm_and_serve_after_it():
    runtime = shared_runtime()
    token = runtime.config.worker_token
    with RpcClient(runtime.address) as c:
        workers = c.call("sched.w.workers", WorkersQuery(launcher_credential(token)), timeout_s=10).workers
    assert {w["role"] for w in workers} == {"engine", "learner"}
    for w in workers:
        pid = _pid(w["worker_id"])
        kinds = ENGINE_KINDS if w["role"] == "engine" else LEARNER_KINDS
        # The storm comes with the scheduler's own keys: an authenticated peer gone hostile (without
        # them a worker answers nothing at all: tests/test_scheduler_service_isolation.py).
        public, secret = scheduler_client_keypair(token)
        curve = ClientCurve(public, secret, worker_keypair(token, w["worker_id"])[0])
        report = storm(w["address"], kinds, pid=pid, curve=curve)
        assert _pid(w["worker_id"]) == pid, f"{w['worker_id']} died (and was restarted)"
        assert report.growth_bytes < 96 << 20, (w["worker_id"], report)
    _still_serves()
