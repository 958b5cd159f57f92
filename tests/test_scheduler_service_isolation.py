"""A co-tenant on the host cannot reach into the runtime: worker sockets admit only their scheduler,
and no request, the scheduler's or a tenant's, makes a worker read or write a path of the caller's.

The real-process test takes the shared runtime (scheduler, engine, learner; tiny-random model) and
plays a local process with no key, with its own Curve key, and with keys derived from a wrong token
against every worker kind, then a tenant against the scheduler; the unit tests pin the name rules
and the key derivation underneath."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq
from fixtures.client import KEY_ALICE, KEY_BOB, MODEL, client, data, shared_runtime

from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import SamplingParams
from polytinker.engine.worker import layout
from polytinker.engine.worker import messages as wm
from polytinker.engine.worker.auth import (
    register_proof,
    scheduler_client_keypair,
    worker_keypair,
    worker_server_curve,
)
from polytinker.errors import ConfigError, ProtocolError, RemoteError, RequestTimeout, TransportError
from polytinker.scheduler.service import AuthError
from polytinker.scheduler.service import messages as m
from polytinker.transport import ClientCurve, RpcClient

WAIT_S = 2.0  # an unauthenticated peer gets no answer at all: this bounds each wait for one


def _worker_requests(adapter: str, version: int) -> list[tuple[str, Any]]:
    """One request of every worker kind, aimed at ``adapter`` (a real tenant's) at ``version``."""
    batch = tuple(data(99, n=2))
    datums = tuple(batch)
    export = wm.WeightsRef(adapter, version, "export")
    return [
        ("sched.w.sample", wm.EngineSample(adapter, version, export, (1, 2, 3), 1, SamplingParams(max_tokens=2))),
        ("sched.w.logprobs", wm.EngineLogprobs(adapter, version, export, ((1, 2, 3),))),
        ("sched.w.export", wm.LearnerExport(adapter, version, loaded_from="stolen")),
        ("sched.w.save", wm.LearnerSave(adapter, "stolen")),
        ("sched.w.load", wm.LearnerLoad(adapter, wm.WeightsRef(adapter, version))),
        ("sched.w.ensure", wm.EnsureAdapter(adapter, 0, rank=4)),
        ("sched.w.fb", wm.LearnerForwardBackward(adapter, datums, "cross_entropy")),
        ("sched.w.forward", wm.LearnerForward(adapter, datums)),
        ("sched.w.step", wm.LearnerStep(adapter, AdamParams(1.0, 0.9, 0.95, 1e-8, 0.0))),
        ("sched.w.stats", wm.WorkerStats()),
    ]


def _attackers(token: str, worker_id: str) -> dict[str, ClientCurve | None]:
    """How a process on the host that lacks the worker token may try to connect to a worker."""
    server_public = worker_keypair(token, worker_id)[0]  # public keys are not secrets: assume it leaked
    own_public, own_secret = zmq.curve_keypair()
    wrong_public, wrong_secret = scheduler_client_keypair("not-the-runtime-token-0123")
    return {
        "no key": None,
        "its own Curve key": ClientCurve(own_public, own_secret, server_public),
        "keys from a wrong token": ClientCurve(wrong_public, wrong_secret, server_public),
    }


def _answered(address: str, curve: ClientCurve | None, requests: list[tuple[str, Any]]) -> list[str]:
    """The kinds that got any answer (a result or a remote error) from ``address`` within WAIT_S;
    the requests go side by side, each on a connection of its own."""

    def send(kind: str, payload: Any) -> str | None:
        try:
            with RpcClient(address, curve=curve) as rpc:
                rpc.call(kind, payload, timeout_s=WAIT_S)
        except (RequestTimeout, TransportError, AuthError):
            return None  # never admitted (no answer, or the Curve handshake refused): no handler ran
        except RemoteError:
            pass  # a handler ran and refused: still an answer it should never have had
        return kind

    with ThreadPoolExecutor(len(requests)) as pool:
        return [kind for kind in pool.map(lambda r: send(*r), requests) if kind is not None]


def _counters(stats: dict[str, Any]) -> dict[str, Any]:
    learner, engine = stats["learner-0"], stats["engine-0"]
    keys = ("forward_backward", "optim_steps", "loads", "adapters_created", "duplicates")
    return {
        **{k: learner[k] for k in keys},
        "engine_requests": engine["requests"],
        "engine_loads": engine["adapter_loads"],
    }


def test_a_co_tenant_without_the_worker_token_gets_no_answer_from_any_worker(tmp_path: Path) -> None:
    runtime = shared_runtime()
    state = runtime.config.state_path
    with client(KEY_ALICE) as alice:
        trainer = alice.create_lora_training_client(MODEL, rank=4, agent="victim")
        trainer.forward_backward(data(31))
        version = trainer.optim_step(AdamParams(learning_rate=1e-2)).result().version
        sampler = trainer.save_weights_and_get_sampling_client()
        assert sampler.sample([5, 6, 7], 1).result().sequences
        adapter = f"alice/{trainer.job_id}/victim"
        before = _counters(alice.runtime_status()["stats"])
        workers = {w["worker_id"]: w["address"] for w in runtime.status()["workers"]}
        assert set(workers) == {"engine-0", "learner-0"}
        requests = _worker_requests(adapter, version)
        for worker_id, address in workers.items():
            for how, curve in _attackers(runtime.config.worker_token, worker_id).items():
                assert _answered(address, curve, requests) == [], f"{worker_id} answered a peer with {how}"
        # Nothing ran: no step, gradient, load or sample, and none of the files asked for exists.
        assert _counters(alice.runtime_status()["stats"]) == before
        assert not list(state.rglob("*stolen*"))
        # The workers still serve their scheduler, and alice's weights are unchanged.
        assert trainer.job_id in [j["job_id"] for j in alice.list_jobs()]
        assert alice.get_job(trainer.job_id)["adapter"]["version"] == version
        assert sampler.sample([5, 6, 7], 1).result().sequences


def _forged(cls: type, **fields: Any) -> Any:
    """A message of type ``cls`` holding ``fields`` as given: what a hostile client can put on the
    wire (``__post_init__`` would refuse to build it here; the scheduler's edge must refuse it)."""
    msg: Any = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(msg, f.name, fields.get(f.name, f.default))
    return msg


def test_a_tenant_names_checkpoints_never_paths_and_only_its_own(tmp_path: Path) -> None:
    runtime = shared_runtime()
    state = runtime.config.state_path
    evil = tmp_path / "evil"
    with client(KEY_ALICE) as alice, client(KEY_BOB) as bob:
        victim = alice.create_lora_training_client(MODEL, rank=4, agent="owner")
        victim.forward_backward(data(32))
        victim.optim_step(AdamParams(learning_rate=1e-2)).result()
        saved = victim.save_state("mine").result()
        mine = bob.create_lora_training_client(MODEL, rank=4, agent="intruder")
        # Another tenant's checkpoint, job or weights: refused as if they did not exist.
        with pytest.raises(AuthError):
            mine.load_state(saved).result()
        with pytest.raises(AuthError):
            mine.load_state(saved.replace("/mine", "/../../../evil")).result()
        # A path where a name belongs: refused, on the tenant's own job too.
        for path in (str(evil), "../evil", "named/../../evil", "./evil"):
            with pytest.raises(ConfigError, match="never a filesystem path"):
                mine.load_state(path).result()
        for name in (str(evil), "../evil", "a/evil", ".evil", ""):
            with pytest.raises(ConfigError, match="checkpoint name"):
                mine.save_state(name).result()
        with RpcClient(runtime.address) as rpc:
            # Fields a client library would refuse, forged onto the wire: refused at the edge.
            hostile = _forged(m.CreateJob, api_key=KEY_BOB, kind="lora_rl", base_model=MODEL, agent="../../../evil")
            with pytest.raises(ProtocolError, match="agent"):
                rpc.call("sched.create_job", hostile, timeout_s=10.0)
            forged = wm.Register("x" * 64, "engine-0", "engine", "tcp://127.0.0.1:1", "i", MODEL, "k" * 40)
            with pytest.raises(RemoteError, match="worker token"):
                rpc.call("sched.w.register", forged, timeout_s=10.0)
            # No key at all: nothing of anyone's is touched or shown.
            sampler_path = victim.save_weights_and_get_sampling_client().model_path
            keyless = [
                ("sched.save_state", m.SaveState("", victim.job_id, "evil")),
                ("sched.load_state", m.LoadState("", victim.job_id, "mine")),
                ("sched.sample", m.Sample("", sampler_path, MODEL, (1, 2, 3))),
                ("sched.job_query", m.JobQuery("", victim.job_id)),
            ]
            for kind, payload in keyless:
                with pytest.raises(RemoteError, match="no API key"):
                    rpc.call(kind, payload, timeout_s=10.0)
    assert not evil.exists()
    assert not [p for p in state.rglob("*evil*")]
    assert not (state.parent / "evil").exists()


# --- unit: the name rules and the keys ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["", ".", "..", ".hidden", "a/b", "/abs", "a\\b", "a\x00b", "x" * 129, "é"])
def test_a_name_that_could_leave_the_root_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="letters, digits"):
        layout.check_name("checkpoint name", name)
    with pytest.raises(ConfigError):
        wm.LearnerSave("alice/job-1/hero", name)
    with pytest.raises(ConfigError):
        wm.WeightsRef(f"alice/job-1/{name}", 1)


@pytest.mark.parametrize("key", ["alice/job", "alice/job/a/b", "alice/../hero", "/alice/job/hero", "a//b"])
def test_an_adapter_key_is_three_names(key: str) -> None:
    with pytest.raises(ConfigError, match="TENANT/JOB/AGENT"):
        wm.LearnerExport(key, 0)
    with pytest.raises(ConfigError):
        wm.EngineSample(key, 0, None, (1,), 1, SamplingParams())


def test_weights_refs_make_the_layouts_paths_and_read_back() -> None:
    cases = {
        wm.WeightsRef("t/j/a", 3): "checkpoints/t/j/a/v3",
        wm.WeightsRef("t/j/a", 3, "export"): "adapters/t/j/a/v3",
        wm.WeightsRef("t/j/a", 2, "checkpoint", "best"): "checkpoints/t/j/a/named/best",
        wm.WeightsRef("t/j/a", 2, "export", "best"): "adapters/t/j/a/v2-loaded-best",
    }
    for ref, path in cases.items():
        assert ref.relative_path == path
        adapter, kind, version, name = layout.parse_relative(path)
        assert (adapter, kind, name) == (ref.adapter, ref.kind, ref.name)
        assert version == (None if kind == "checkpoint" and name else ref.version)
        assert layout.under(Path("/srv/state"), path) == Path("/srv/state") / path
    for text in (
        "/etc/passwd",
        "checkpoints/t/j/a/../../x",
        "adapters/t/j/a/named/x",
        "checkpoints/t/j/a",
        "x/t/j/a/v1",
    ):
        with pytest.raises(ConfigError):
            layout.parse_relative(text)
    with pytest.raises(ConfigError):
        layout.under(Path("/srv/state"), "checkpoints/../../etc")


def test_worker_keys_and_register_proofs_derive_from_the_token_alone() -> None:
    token = "runtime-token-0123456789"
    assert worker_keypair(token, "engine-0") == worker_keypair(token, "engine-0")  # a restart finds the same keys
    keys = {worker_keypair(token, "engine-0"), worker_keypair(token, "learner-0"), scheduler_client_keypair(token)}
    keys.add(worker_keypair("another-token-0123456789", "engine-0"))
    assert len(keys) == 4 and all(zmq.curve_public(secret) == public for public, secret in keys)
    curve = worker_server_curve(token, "engine-0")
    assert curve.allowed_clients == frozenset({scheduler_client_keypair(token)[0]})
    own = zmq.curve_keypair()
    assert worker_server_curve(token, "engine-0", own).public_key == own[0]  # a worker's own keys serve instead
    fields = ["engine-0", "engine", "tcp://127.0.0.1:5000", "inc-1", MODEL, curve.public_key.decode()]
    proof = register_proof(token, *fields)
    assert token not in proof and register_proof("another-token-0123456789", *fields) != proof
    for i in range(len(fields)):  # the proof binds every field: a stolen one registers nothing else
        changed = [*fields[:i], fields[i] + "x", *fields[i + 1 :]]
        assert register_proof(token, *changed) != proof


def test_a_tenant_may_not_name_an_agent_that_is_a_path() -> None:
    for agent in ("../x", "a/b", ".x", ""):
        with pytest.raises(ConfigError, match="agent"):
            m.CreateJob(KEY_BOB, "lora_rl", MODEL, agent=agent)


def _pruning_service(tmp_path: Path) -> Any:
    """A scheduler service keeping one per-step version, not started: its store and layout are
    enough for pruning."""
    from polytinker.scheduler.service import RuntimeConfig, SchedulerService, TenantConfig

    cfg = RuntimeConfig(
        model=MODEL,
        state_dir=str(tmp_path / "state"),
        tenants=(TenantConfig("alice", api_key=KEY_ALICE),),
        worker_token="prune-token-0123456789",
        keep_checkpoints=1,
    )
    return SchedulerService(cfg, cfg.worker_token)


def test_pruning_deletes_only_this_adapters_old_step_files_under_the_root(tmp_path: Path) -> None:
    svc = _pruning_service(tmp_path)
    try:
        key, other = "alice/job-1/hero", "alice/job-2/hero"
        outside = tmp_path / "outside" / "v1"  # a path an old database might hold: never deleted
        made = [
            wm.WeightsRef(key, 1).relative_path,
            wm.WeightsRef(key, 1, "export", "best").relative_path,  # the export after a load: a step file
            wm.WeightsRef(key, 1, "checkpoint", "best").relative_path,  # save_state's: kept
            wm.WeightsRef(other, 1).relative_path,  # another adapter's version loaded into this one
            wm.WeightsRef(key, 3).relative_path,
            wm.WeightsRef(key, 3, "export").relative_path,
        ]
        for rel in made:
            (svc.root / rel).mkdir(parents=True)
        outside.mkdir(parents=True)
        a = svc.store.ensure_adapter(key, "alice", "job-1", "hero")
        svc.store.record_version(key, 0, made[2], "")
        svc.store.record_version(key, 1, made[0], made[1])
        svc.store.record_version(key, 2, made[3], str(outside))
        svc.store.record_version(key, 3, made[4], made[5])
        svc.store.add_checkpoint("job-1", "best", made[2], 1)
        svc.weights.prune(a, 3)  # keeps version 3 alone
        assert [rel for rel in made if (svc.root / rel).exists()] == made[2:]
        assert outside.exists()
        assert svc.store.version_row(key, 1) is None and svc.store.version_row(key, 3) is not None
    finally:
        svc.stop()


def test_a_named_samplers_version_outlives_pruning(tmp_path: Path) -> None:
    """save_weights_for_sampler(name) keeps its version sampleable for good: pruning leaves the
    version's row (its model path resolves) and its export. A league samples its pool this way."""
    svc = _pruning_service(tmp_path)
    try:
        key = "alice/job-1/hero"
        a = svc.store.ensure_adapter(key, "alice", "job-1", "hero")
        step_files = {v: wm.WeightsRef(key, v).relative_path for v in (1, 2, 3)}
        made = {v: (ckpt, wm.WeightsRef(key, v, "export").relative_path) for v, ckpt in step_files.items()}
        for version, (ckpt, export) in made.items():
            (svc.root / ckpt).mkdir(parents=True)
            (svc.root / export).mkdir(parents=True)
            svc.store.record_version(key, version, ckpt, export)
        svc.store.add_checkpoint("job-1", "sampler-pool-v1", made[1][1], 1)  # what a named save records
        svc.weights.prune(a, 3)
        assert svc.store.version_row(key, 1) is not None and (svc.root / made[1][1]).exists()
        assert svc.store.version_row(key, 2) is None and not (svc.root / made[2][1]).exists()
    finally:
        svc.stop()
