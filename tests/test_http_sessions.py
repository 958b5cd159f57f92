"""Tinker sessions end when their client is gone, and a sampler handed out stays sampleable: the
official ``tinker`` SDK, unmodified, against a real ``polytinker serve --http`` on tiny-random, with
one engine of two adapter slots, ``keep_checkpoints = 2`` and no time window for old versions
(``sampler_keep_s = 0``: only what a session holds outlives pruning).

- A sampler from step 0 still samples after ten more steps (each a forward_backward, an optim_step
  and a new sampler) while its session lives; once the session closes, its versions are pruned.
  A named save answers ``tinker://RUN/sampler_weights/NAME``, which samples.
- A client process holding both adapter slots is killed with SIGKILL, without ``close``: within
  ``session_timeout_s`` plus a bound its slots are back and another tenant's run, queued meanwhile
  with a ``paused_capacity`` queue state that says why, starts; the killed run's saved weights
  sample and resume (``create_training_client_from_state``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _serve import KEY, KEY_BOB, Serve, _free_port

from polytinker import ServiceClient

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

MODEL = "tiny-random"
SESSION_TIMEOUT_S = 15.0  # above the SDK's 10 s heartbeat period, with room for a slow heartbeat
BOUND_S = 10.0  # slots back within the timeout plus this (a sweep, the waiting client's back-off, a step)
PARAMS = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


class SmallServe(Serve):
    def _pick_ports(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.scheduler = f"tcp://127.0.0.1:{_free_port()}"
        (self.root / "runtime.toml").write_text(
            f'model = "{MODEL}"\naddress = "{self.scheduler}"\n'
            "keep_checkpoints = 2\nsampler_keep_s = 0.0\n"
            # Only a session's end frees a slot here, not the reclaim of idle runs for a waiting one.
            "slot_reclaim_idle_s = 3600.0\n"
            f"[http]\nsession_timeout_s = {SESSION_TIMEOUT_S}\nlong_poll_s = 2.0\n"
            f'[[tenants]]\nname = "alice"\napi_key = "{KEY}"\n[[tenants]]\nname = "bob"\napi_key = "{KEY_BOB}"\n'
            "[[engines]]\nadapter_slots = 2\n"
        )


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallServe]:
    with SmallServe(tmp_path_factory.mktemp("sessions-serve")) as s:
        yield s


def _datum() -> types.Datum:
    return types.Datum(
        model_input=PROMPT, loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1.0, 1.0, 1.0]}
    )


def _step(tc: tinker.TrainingClient) -> None:
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def _samples(sampler: tinker.SamplingClient) -> int:
    return len(sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens)


def test_a_sampler_handed_out_samples_while_its_session_lives(serve: Serve) -> None:
    service = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    first = tc.save_weights_and_get_sampling_client().result()
    assert _samples(first) > 0
    samplers, named = [], ""
    for step in range(10):  # the cookbook's rl.train: a step, then a sampler of the new version
        _step(tc)
        samplers.append(tc.save_weights_and_get_sampling_client().result())
        if step == 0:
            named = tc.save_weights_for_sampler("step-1").result().path
    run_id = named.removeprefix("tinker://").split("/")[0]
    assert named == f"tinker://{run_id}/sampler_weights/step-1", named  # Tinker's path of a named save
    assert _samples(first) > 0  # step 0's version, ten steps behind with keep_checkpoints = 2
    assert _samples(samplers[3]) > 0
    assert _samples(service.create_sampling_client(model_path=named).result()) > 0
    service.close("success").result()  # the session ends: what only it held may be pruned now

    other = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    try:
        assert _samples(other.create_sampling_client(model_path=named).result()) > 0  # a named save stays
        for version in (0, 5):  # held by the closed session alone: pruned
            with pytest.raises(Exception, match="no saved weights"):
                other.create_sampling_client(model_path=f"tinker://{run_id}/sampler_weights/default@{version}").result()
        last = other.create_sampling_client(model_path=f"tinker://{run_id}/sampler_weights/default@10").result()
        assert _samples(last) > 0  # the last keep_checkpoints stay
    finally:
        other.close("success").result()


CLIENT = """
import json, sys, time
import tinker
from tinker import types
url, key, out = sys.argv[1:4]
service = tinker.ServiceClient(base_url=url, api_key=key)
datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4})
runs = []
for _ in range(2):  # every adapter slot of the engine
    tc = service.create_lora_training_client(base_model="tiny-random", rank=4).result()
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    runs.append(tc)
state = runs[0].save_state("before-kill").result().path
sampler = runs[0].save_weights_for_sampler("before-kill").result().path
json.dump({"models": [r.model_id for r in runs], "state": state, "sampler": sampler}, open(out, "w"))
time.sleep(3600)  # never closes: killed
"""


def _queue_state(serve: Serve, model_id: str) -> dict[str, object]:
    """What a poll of a call of ``model_id`` answers while it waits (a named sampler save, sent raw)."""
    headers = {"X-API-Key": KEY_BOB}
    body = {"model_id": model_id, "path": "probe"}
    sent = httpx.post(f"{serve.url}/api/v1/save_weights_for_sampler", json=body, headers=headers, timeout=30).json()
    got = httpx.post(f"{serve.url}/api/v1/retrieve_future", json=sent, headers=headers, timeout=30).json()
    assert isinstance(got, dict)
    return got


def test_a_killed_client_gives_its_slots_back_and_its_saved_weights_live_on(serve: SmallServe, tmp_path: Path) -> None:
    out = tmp_path / "client.json"
    child = subprocess.Popen([sys.executable, "-c", CLIENT, serve.url, KEY, str(out)])
    try:
        deadline = time.monotonic() + 120
        while not out.exists() or not out.read_text():
            assert child.poll() is None and time.monotonic() < deadline, "the client process did not get going"
            time.sleep(0.2)
        saved = json.loads(out.read_text())

        bob = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB)
        waiting = bob.create_lora_training_client(base_model=MODEL, rank=4).result()  # queued: no slot is free
        told = _queue_state(serve, waiting.model_id)
        assert told["type"] == "try_again" and told["queue_state"] == "paused_capacity", told
        assert "position 1 in the queue; waiting for an adapter slot" in str(told["queue_state_reason"]), told

        killed = time.monotonic()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        _step(waiting)  # waits for a slot, then runs
        recovered_s = time.monotonic() - killed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    assert recovered_s <= SESSION_TIMEOUT_S + BOUND_S, recovered_s

    state_run = saved["state"].removeprefix("tinker://").split("/")[0]
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    job_ids = [rest.get_training_run(m).result().training_run_id for m in saved["models"]]
    assert state_run in job_ids
    with ServiceClient(serve.scheduler, api_key=KEY) as jobs:  # what `polytinker jobs` shows
        for job_id in job_ids:
            assert jobs.get_job(job_id)["job"]["state"] == "done"  # finished, as close would
    alice = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    try:
        assert _samples(alice.create_sampling_client(model_path=saved["sampler"]).result()) > 0
        assert saved["sampler"].endswith("/sampler_weights/before-kill")
        _step(alice.create_training_client_from_state(saved["state"]).result())  # the killed run resumes
    finally:
        alice.close("success").result()
        bob.close("success").result()
    log = (serve.root / "serve.log").read_text()
    assert "no heartbeat for" in log  # the gateway says why the session ended
