"""tinker-cookbook's own training loops, unmodified, against a real ``polytinker serve --http``:
its supervised loop, its RL loop (synchronous and asynchronous) and a resume through its
checkpoint utilities. The cookbook needs an older transformers than polytinker's environment has,
so the scripts in tests/cookbook/ run in their own environment (``make cookbook-venv``) and reach
the server only through the tinker SDK, configured by ``TINKER_BASE_URL`` and ``TINKER_API_KEY``.

Also here: the SDK's ``RestClient`` calls the cookbook's checkpoint utilities rely on (training
runs, their checkpoints, sessions), from polytinker's environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from _serve import KEY, KEY_BOB, MODEL, Serve

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "cookbook"
COOKBOOK_PYTHON = ROOT / ".venv-cookbook" / "bin" / "python"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with Serve(tmp_path_factory.mktemp("cookbook-serve")) as s:
        yield s


def cookbook(serve: Serve, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the cookbook's python with ``args`` against ``serve``, configured as a Tinker user
    configures the SDK (``TINKER_BASE_URL``, ``TINKER_API_KEY``)."""
    from polytinker.engine.models import resolve_model

    if not COOKBOOK_PYTHON.exists():
        pytest.skip("no .venv-cookbook: `make cookbook-venv` builds the environment tinker-cookbook runs in")

    env = {
        **os.environ,
        "TINKER_BASE_URL": serve.url,
        "TINKER_API_KEY": KEY,
        "TINKER_MODEL": MODEL,
        "TOKENIZER_DIR": str(resolve_model(MODEL)),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("PYTHONPATH", None)  # polytinker's environment is not the cookbook's
    return subprocess.run([str(COOKBOOK_PYTHON), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def run_script(serve: Serve, name: str, log_dir: Path) -> str:
    """Run tests/cookbook/NAME.py with the cookbook's python; its output, after checking it passed."""
    started = time.monotonic()
    proc = cookbook(serve, [str(SCRIPTS / f"{name}.py"), str(log_dir)], SCRIPTS)
    took = time.monotonic() - started
    out = proc.stdout
    print(f"--- {name}.py ({took:.0f} s)\n{out}")
    assert proc.returncode == 0, f"{name}.py exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert f"OK {name}" in out, out
    return out


def words(out: str, label: str) -> list[str]:
    """What follows ``LABEL:`` on its line of a script's output, split at spaces."""
    line = next(x for x in out.splitlines() if x.startswith(f"{label}:"))
    return line[len(label) + 1 :].split()


def figures(out: str, label: str) -> list[float]:
    """The numbers on the line ``LABEL: ...`` of a script's output."""
    return [float(v) for w in words(out, label) for v in re.findall(r"-?\d+(?:\.\d+)?", w)]


@pytest.mark.timeout(900)
def test_supervised_loop_loss_falls(serve: Serve, tmp_path: Path) -> None:
    out = run_script(serve, "sl_loop", tmp_path)
    nll = figures(out, "train_mean_nll")
    assert len(nll) == 12, nll  # 8 training conversations, batches of 2, 3 epochs
    assert sum(nll[-2:]) < 0.7 * sum(nll[:2]), nll
    assert figures(out, "test/nll"), out  # the cookbook's held-out evaluator sampled too


@pytest.mark.timeout(900)
def test_rl_loop_sync_and_async(serve: Serve, tmp_path: Path) -> None:
    out = run_script(serve, "rl_loop", tmp_path)
    for label, steps in (("sync", {3}), ("async", {2, 3, 4})):  # async may drop a last, stale batch
        rewards = figures(out, f"{label} reward per step")
        assert len(rewards) in steps and all(-0.1 <= r <= 1.0 for r in rewards), rewards
        versions = [int(w.rsplit("@", 1)[1]) for w in words(out, f"{label} sampler checkpoints")]
        assert versions == sorted(versions) and versions[-1] == len(rewards), versions  # an optimizer step each
        assert any(n > 0 for n in figures(out, f"{label} trained tokens per step")), out
    assert figures(out, "async sampler step per step"), out


@pytest.mark.timeout(900)
def test_resume_from_the_checkpoint_a_run_left(serve: Serve, tmp_path: Path) -> None:
    out = run_script(serve, "resume", tmp_path)
    batch = int(re.search(r"checkpoint found: \S+ \(batch (\d+)\)", out).group(1))  # type: ignore[union-attr]
    second = words(out, "second run (step:NLL)")
    assert int(second[0].split(":")[0]) == batch, out
    assert "metadata {'renderer_name': 'role_colon'}" in out, out
    assert any(w.startswith("weights/") for w in words(out, "its checkpoints")), out
    assert "base HuggingFaceTB/SmolLM2-135M-Instruct" in " ".join(words(out, "downloaded")), out


def test_rest_client_reads_runs_checkpoints_and_sessions(serve: Serve) -> None:
    tinker = pytest.importorskip("tinker")
    service = tinker.ServiceClient(base_url=serve.url, api_key=KEY, user_metadata={"purpose": "rest"})
    tc = service.create_lora_training_client(
        base_model=MODEL, rank=4, train_mlp=False, user_metadata={"renderer_name": "x"}
    ).result()
    state = tc.save_state("kept").result().path
    sampler = tc.save_weights_for_sampler("for-eval").result().path
    tc.save_weights_and_get_sampling_client().result()  # unnamed: a sampling session, not a listed checkpoint
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)

    run = rest.get_training_run_by_tinker_path(state).result()
    assert run.training_run_id == state.removeprefix("tinker://").split("/")[0]
    assert run.base_model == MODEL and run.is_lora and run.lora_rank == 4
    assert run.user_metadata == {"renderer_name": "x"}
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run(tc.model_id).result().training_run_id == run.training_run_id  # by model id too

    listed = rest.list_checkpoints(run.training_run_id).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("training", state), ("sampler", sampler)]
    assert listed[0].checkpoint_id == "weights/kept" and listed[0].time <= listed[1].time
    assert state in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    runs = rest.list_training_runs(limit=100).result()
    assert run.training_run_id in {r.training_run_id for r in runs.training_runs}
    assert runs.cursor.total_count >= len(runs.training_runs)
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp) == (4, True, False)

    session_id = tc.model_id.partition(":")[0]
    session = rest.get_session(session_id).result()
    assert run.training_run_id in session.training_run_ids and session.sampler_ids
    assert session.user_metadata == {"purpose": "rest"}
    assert session_id in rest.list_sessions(limit=1000).result().sessions

    with pytest.raises(tinker.NotFoundError, match="unknown training run"):
        rest.get_training_run("no-such-run").result()
    bob = tinker.RestClient(base_url=serve.url, api_key=KEY_BOB)
    with pytest.raises(tinker.NotFoundError):  # another tenant's run and session read as unknown
        bob.get_training_run(run.training_run_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob.list_checkpoints(run.training_run_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob.get_session(session_id).result()


def test_the_cookbooks_audit_log_script_saves_who_did_what_to_checkpoints(serve: Serve, tmp_path: Path) -> None:
    """The cookbook's ``scripts/save_audit_log`` (through the SDK's deprecated RestClient form)
    writes today's entries; the SDK's ``AdminClient`` reads the same log, with event details, and
    the run's usage by the hour and the storage held."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    service = tinker.ServiceClient(base_url=serve.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 17, 230]),
        loss_fn_inputs={"target_tokens": [17, 230, 9], "weights": [0.0, 1.0, 1.0]},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    state = tc.save_state("audited").result().path
    sampler = tc.save_weights_for_sampler("audited").result().path
    rest = tinker.RestClient(base_url=serve.url, api_key=KEY)
    rest.publish_checkpoint_from_tinker_path(state).result()
    bob = tinker.ServiceClient(base_url=serve.url, api_key=KEY_BOB)
    bob.create_training_client_from_state(state).result()  # another tenant reads it
    rest.delete_checkpoint_from_tinker_path(sampler).result()

    out = tmp_path / "audit"
    module = ["-m", "tinker_cookbook.scripts.save_audit_log", "--once", "--backfill-days", "1"]
    proc = cookbook(serve, [*module, "--output-dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    today = datetime.now(UTC).date()
    assert sorted(p.name for p in out.iterdir()) == [
        f"audit_log_{today - timedelta(days=1)}.jsonl",
        f"audit_log_{today}.jsonl",
    ]
    rows = [json.loads(line) for line in (out / f"audit_log_{today}.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row["tinker_path"] in (state, sampler)]
    ours = [(row["event"], row["tinker_path"], row["purpose"]) for row in rows]
    assert ours == [
        ("checkpoint_create", state, None),
        ("checkpoint_create", sampler, None),
        ("checkpoint_publish", state, None),
        ("checkpoint_read", state, "load_state"),
        ("checkpoint_delete", sampler, None),
    ]
    assert all(row["model_id"] == tc.model_id for row in rows)

    admin = tinker.AdminClient(base_url=serve.url, api_key=KEY)
    # This module's other runs read their own checkpoints too: the read of this one is bob's.
    entries = admin.get_audit_log("checkpoints").result().entries
    read = next(e for e in entries if e.event == "checkpoint_read" and e.tinker_path == state)
    assert read.event_details["tenant"] == "bob" and read.event_details["tinker_path"] == state
    assert admin.get_audit_log("projects").result().entries == []
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    used = admin.get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=1)).result()
    run = [e for e in used.data if e.session_id == tc.model_id.partition(":")[0] and e.base_model == MODEL]
    assert sum(e.event_info.token_count for e in run if e.event_info.type == "training") == 3
    assert sum(e.event_info.count for e in run if e.event_info.type == "checkpoint") == 2  # both saves
    assert all(e.estimated_cost_usd is None for e in used.data)  # polytinker keeps no prices
    storage = admin.get_current_checkpoint_storage_usage().result().data
    assert storage[0].checkpoint_count >= 1 and storage[0].size_bytes > 0  # the state kept; the sampler deleted
    bad = httpx.get(
        f"{serve.url}/api/v1/billing/usage/events",
        params={"starting_on": "yesterday", "ending_before": hour.isoformat()},
        headers={"X-API-Key": KEY},
    )
    error = bad.json()["error"]  # a type, a message and an error id, no traceback
    assert bad.status_code == 400 and "RFC 3339" in error["message"] and error["error_id"], bad.text
    with pytest.raises(tinker.BadRequestError, match="event_type"):
        tinker.AdminClient(base_url=serve.url, api_key=KEY_BOB).get_audit_log("everything").result()  # type: ignore[arg-type]
    for c in (service, bob):
        c.close("success").result()
