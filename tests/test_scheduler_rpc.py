"""The scheduler service's RPC surface and the client's side of it: malformed and hostile
requests that never take the scheduler down, the training bound answering overloaded, a client
connection retrying overloaded and waiting answers, message validation and model paths, a closed
``ServiceClient`` refusing calls, and training data in both shapes becoming the same message."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
from _scheduler_helpers import KEY_A, KEY_B, config

from polytinker.client._connection import Connection
from polytinker.engine.types import Datum
from polytinker.engine.worker import messages as wm
from polytinker.errors import ConfigError, ProtocolError, RemoteError
from polytinker.model_path import CheckpointPath, ModelPath, from_tinker
from polytinker.scheduler.service import OverloadedError, SchedulerService
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.types import JobState
from polytinker.transport import RpcClient, RpcServer


@pytest.fixture
def service(tmp_path: Path):
    cfg = config(tmp_path, max_inflight_train=1)
    svc = SchedulerService(cfg, cfg.worker_token).start("tcp://127.0.0.1:0")
    assert svc.server is not None
    yield svc, svc.server.address
    svc.stop()


def test_malformed_and_hostile_requests_never_take_the_scheduler_down(service) -> None:
    _svc, address = service
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(address)
    for frames in ([b"garbage"], [b"\x94\x01\x01\x07\xa3abc", b"\xc1"], [b""] * 3):
        raw.send_multipart(frames)
    raw.close()
    with RpcClient(address) as client:
        with pytest.raises(ProtocolError, match="takes a"):
            client.call("sched.create_job", {"api_key": KEY_A, "kind": "lora_rl"})
        with pytest.raises(ProtocolError):
            client.call("sched.create_job", m.ListJobs(KEY_A))
        with pytest.raises(RemoteError, match="unknown API key"):
            client.call("sched.list_jobs", m.ListJobs("wrong-key-wrong-key"))
        with pytest.raises(RemoteError, match="worker token"):
            forged = wm.Register("bad", "engine-0", "engine", "tcp://x:1", "i", "tiny-random", "k" * 40)
            client.call("sched.w.register", forged)
        reply = client.call("sched.create_job", m.CreateJob(KEY_A, "lora_rl", "tiny-random", rank=4))
        assert isinstance(reply, r.JobReply) and reply.job["state"] == "running"
        jobs = client.call("sched.list_jobs", m.ListJobs(KEY_B)).jobs
        assert jobs == []  # bob sees none of alice's jobs


def test_training_without_a_learner_waits_then_the_bound_answers_overloaded(service) -> None:
    svc, address = service
    with RpcClient(address) as client:
        job = client.call("sched.create_job", m.CreateJob(KEY_A, "lora_rl", "tiny-random", rank=4)).job
        with svc.admission.admit("alice", "train"):  # one training call in flight: the bound (1) is reached
            reply = client.call("sched.optim_step", m.OptimStep(KEY_A, job["job_id"]))
        assert isinstance(reply, r.OverloadedReply) and reply.retry_after_s > 0


def test_client_connection_retries_overloaded_answers_then_succeeds() -> None:
    answers = iter(
        [
            r.OverloadedReply(0.05, "busy"),
            r.WaitingReply(JobState.QUEUED, 0.05, "queued"),
            r.JobListReply([], {}),
        ]
    )
    with RpcServer("tcp://127.0.0.1:0", {"sched.list_jobs": lambda _msg: next(answers)}) as server:
        conn = Connection(server.address, KEY_A)
        try:
            assert conn.request("sched.list_jobs", m.ListJobs(KEY_A), r.JobListReply) == r.JobListReply([], {})
        finally:
            conn.close()
    busy = r.OverloadedReply(0.01, "busy")
    with RpcServer("tcp://127.0.0.1:0", {"x": lambda _msg: busy}) as server:
        conn = Connection(server.address, KEY_A, overload_wait_s=0.05)
        try:
            with pytest.raises(OverloadedError):
                conn.request("x", None, r.JobListReply)
        finally:
            conn.close()


def test_message_validation_and_model_paths() -> None:
    with pytest.raises(ConfigError):
        Datum((1, 2), (2,), (1.0,))
    with pytest.raises(ConfigError):
        m.CreateJob(KEY_A, "training", "tiny-random")
    with pytest.raises(ConfigError):
        m.Sample(KEY_A, "", "tiny-random", (), 1)
    path = ModelPath.parse("polytinker://job-1/agent@3")
    assert (path.job_id, path.agent, path.version) == ("job-1", "agent", 3)
    assert str(path) == "polytinker://job-1/agent@3"
    assert path.tinker == "tinker://job-1/sampler_weights/agent@3"
    assert ModelPath.from_tinker(path.tinker) == path
    with pytest.raises(ConfigError):
        ModelPath.parse("polytinker://job-1@x")
    with pytest.raises(ConfigError):
        ModelPath.from_tinker("tinker://job-1/weights/agent@3")
    checkpoint = CheckpointPath.parse("polytinker-ckpt://job-1/after-two")
    assert checkpoint == CheckpointPath("job-1", "after-two") and str(checkpoint) == "polytinker-ckpt://job-1/after-two"
    assert checkpoint.tinker == "tinker://job-1/weights/after-two"
    assert CheckpointPath.from_tinker(checkpoint.tinker) == checkpoint
    assert from_tinker(checkpoint.tinker) == str(checkpoint) and from_tinker(path.tinker) == str(path)
    with pytest.raises(ConfigError):
        CheckpointPath.from_tinker(path.tinker)
    with pytest.raises(ConfigError):
        from_tinker("tinker://job-1/external_weights/x")
    assert CheckpointPath.parse("after-two") is None and CheckpointPath.parse("polytinker://job-1/agent@3") is None


def test_a_closed_service_client_refuses_calls_instead_of_starting_a_runtime() -> None:
    from polytinker.client import ServiceClient
    from polytinker.errors import TransportError

    service = ServiceClient("tcp://127.0.0.1:9", api_key=KEY_A)
    service.close()
    with pytest.raises(TransportError, match="closed"):
        service.list_jobs()
    assert service.runtime is None


def test_training_data_in_polytinker_and_tinker_shapes_become_the_same_message() -> None:
    import numpy as np

    from polytinker.client.training_client import to_datum

    ours = to_datum(Datum([1, 2, 3], [2, 3, 4], [0.0, 1.0, 1.0], [0.5] * 3, [-1.0] * 3))
    tinker = to_datum(
        {
            "model_input": [1, 2, 3],
            "loss_fn_inputs": {"target_tokens": np.array([2, 3, 4]), "weights": [0, 1, 1],
                               "advantages": [0.5] * 3, "logprobs": [-1.0] * 3},
        }
    )  # fmt: skip
    assert ours == tinker
    with pytest.raises(TypeError, match="target_tokens"):
        to_datum({"model_input": [1, 2], "loss_fn_inputs": {}})
