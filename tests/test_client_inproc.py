"""``ServiceClient(inproc=True)``: the scheduler, engine and learner as objects in the test's process.

The same seeded experiment runs against the in-process runtime and against the real one (three
processes over ZeroMQ) and must give the same losses, sampled tokens and logprobs; the in-process
one must start no process and create no ZeroMQ socket."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import zmq
from fixtures.client import data

from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import SamplingParams
from polytinker.errors import ConfigError, PolytinkerError, RemoteError
from polytinker.scheduler.service import InprocRuntime, LearnerWorkerConfig, RuntimeConfig
from polytinker.scheduler.service.config import HttpConfig

MODEL = "tiny-random"
ADAM = AdamParams(learning_rate=1e-2)
SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, seed=5)

pytestmark = pytest.mark.timeout(600)  # the real runtime starts three processes: a minute on a busy machine


def experiment(service: ServiceClient) -> dict[str, Any]:
    """A seeded sequence of client calls; what it observed."""
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=11, agent="same")
    seen: dict[str, Any] = {"losses": [], "fb_logprobs": []}
    for step in range(2):
        fb = trainer.forward_backward(data(step), "cross_entropy").result()
        seen["losses"].append(fb.loss)
        seen["fb_logprobs"].append([list(lp) for lp in fb.logprobs])
        seen[f"version_{step}"] = trainer.optim_step(ADAM).result().version
    seen["checkpoint"] = trainer.save_state("after-two").result().rsplit("/", 1)[-1]
    sampler = trainer.save_weights_and_get_sampling_client("v2")
    prompt = data(9)[0].input_tokens[:5]
    out = sampler.sample(prompt, num_samples=2, sampling_params=SAMPLING).result()
    seen["tokens"] = [list(s.tokens) for s in out.sequences]
    seen["sample_logprobs"] = [list(s.logprobs) for s in out.sequences]
    seen["scored"] = sampler.compute_logprobs(prompt + out.sequences[0].tokens).result()
    base = service.create_sampling_client(base_model=MODEL)
    seen["base_tokens"] = [list(s.tokens) for s in base.sample(prompt, 1, SAMPLING).result().sequences]
    for name, call in (("unknown_job", lambda: service.get_job("no-such-job")), ("bad_load", _bad_load(trainer))):
        with pytest.raises(PolytinkerError) as err:
            call()
        seen[name] = (type(err.value), str(err.value), type(err.value.__cause__))
    return seen


def _bad_load(trainer: Any) -> Any:
    return lambda: trainer.load_state("/etc/passwd").result()  # a path, not a checkpoint name: refused


def config() -> RuntimeConfig:
    return RuntimeConfig(model=MODEL, learners=(LearnerWorkerConfig(micro_batch_size=8),), start_timeout_s=240.0)


def test_inproc_gives_the_real_runtimes_results_without_processes_or_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    listening_before = {c.laddr for c in me.net_connections("all") if c.status == psutil.CONN_LISTEN}
    sockets: list[int] = []
    real_socket = zmq.Context.socket

    def counted(self: zmq.Context, *args: Any, **kw: Any) -> Any:
        sockets.append(args[0] if args else kw.get("socket_type", 0))
        return real_socket(self, *args, **kw)

    monkeypatch.setattr(zmq.Context, "socket", counted)
    # Float sums depend on torch's thread count: run with the count a worker process sets
    # (engine/worker/server.py), whatever an earlier test in this process left.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        with ServiceClient(inproc=True, runtime_config=config()) as service:
            inproc = experiment(service)
            assert {p.pid for p in me.children(recursive=True)} == children_before
            listening = {c.laddr for c in me.net_connections("all") if c.status == psutil.CONN_LISTEN}
            assert listening == listening_before
            assert service.runtime_status()["actors"] == []  # nothing supervised: no process to supervise
    finally:
        torch.set_num_threads(threads)
    assert sockets == []
    monkeypatch.undo()

    with ServiceClient(runtime_config=config()) as service:
        real = experiment(service)
        assert len({p.pid for p in me.children(recursive=True)} - children_before) == 3

    assert inproc["version_0"] == real["version_0"] == 1 and inproc["version_1"] == real["version_1"] == 2
    assert inproc["losses"] == real["losses"] and inproc["losses"][1] != inproc["losses"][0]
    assert inproc["fb_logprobs"] == real["fb_logprobs"]
    assert inproc["checkpoint"] == real["checkpoint"] == "after-two"
    assert inproc["tokens"] == real["tokens"] and all(len(t) == 6 for t in inproc["tokens"])
    assert inproc["sample_logprobs"] == real["sample_logprobs"]
    assert inproc["scored"] == real["scored"]
    assert inproc["base_tokens"] == real["base_tokens"]
    assert inproc["unknown_job"] == real["unknown_job"] and inproc["bad_load"] == real["bad_load"]
    assert inproc["bad_load"][0] is ConfigError and inproc["bad_load"][2] is RemoteError


def test_inproc_refuses_an_address_and_the_http_front_door() -> None:
    with pytest.raises(ConfigError, match="inproc=True"):
        ServiceClient("tcp://127.0.0.1:7000", api_key="k" * 20, inproc=True)
    with pytest.raises(ConfigError, match="HTTP front door"):
        InprocRuntime(RuntimeConfig(model=MODEL, http=HttpConfig(address="127.0.0.1:8000")))


def test_a_local_runtime_refuses_an_http_address_and_names_the_gateway_s_runtime(tmp_path: Path) -> None:
    """The HTTP front door is the gateway's (a client of the scheduler): the scheduler's own
    runtime refuses an ``[http] address`` before it makes anything, naming what serves one."""
    from polytinker.scheduler.service.runtime import LocalRuntime

    state = tmp_path / "state"
    with pytest.raises(ConfigError, match=r"polytinker\.gateway\.HttpRuntime.*serve --http"):
        LocalRuntime(RuntimeConfig(model=MODEL, state_dir=str(state), http=HttpConfig(address="127.0.0.1:0")))
    assert not state.exists()
    from polytinker.gateway import HttpRuntime

    assert issubclass(HttpRuntime, LocalRuntime) and HttpRuntime.serves_http
