"""tinker-cookbook's own recipes (``python -m tinker_cookbook.recipes...``), unmodified, against a
real ``polytinker serve --http``, as the cookbook's recipe tests (tests/recipes/ in its 0.5.8
source distribution) run them: the recipe test's arguments plus ``max_steps``, here with the
served model's hub id as ``model_name`` and smaller batches. Only the recipes that need no network
run here (docs/tinker.md, "Cookbook recipes", says why the others cannot). The recipes load the
tokenizer by hub id (``get_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")``) from the hub cache
serve fills, offline.

Also here: several copies of the cookbook's RL loop (tests/cookbook/rl_loop.py) at once, one
tenant, one server."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve import KEY, Serve

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "cookbook"
COOKBOOK_PYTHON = ROOT / ".venv-cookbook" / "bin" / "python"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the served default model's hub id
# The recipes default to qwen3_5_disable_thinking, whose parser asserts that "</think>" is one
# token: in SmolLM2's vocabulary it is three, so the first sampled turn fails. qwen3_instruct writes
# ChatML (<|im_start|>role ... <|im_end|>), exactly SmolLM2's own chat template, and stops at
# <|im_end|>, SmolLM2's end-of-sequence token.
RENDERER = "qwen3_instruct"
RECIPE_TIMEOUT_S = 240


def cookbook_env(serve: Serve, **extra: str) -> dict[str, str]:
    """The environment a Tinker user runs the cookbook in (``TINKER_BASE_URL``, ``TINKER_API_KEY``),
    offline; HF_HUB_CACHE (tests/conftest.py) is the cache serve placed the tokenizer in."""
    if not COOKBOOK_PYTHON.exists():
        pytest.skip("no .venv-cookbook: `make cookbook-venv` builds the environment tinker-cookbook runs in")
    env = {
        **os.environ,
        "TINKER_BASE_URL": serve.url,
        "TINKER_API_KEY": KEY,
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        **extra,
    }
    env.pop("PYTHONPATH", None)  # polytinker's environment is not the cookbook's
    return env


def sampler_version(serve: Serve, tinker_path: str) -> int:
    """The version a named sampler save holds: a sampling session on it, whose ``GET /samplers/ID``
    answers the version's path (``.../sampler_weights/AGENT@VERSION``)."""
    url, headers = f"{serve.url}/api/v1", {"X-API-Key": KEY}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        session = http.post("/create_session", json={}).raise_for_status().json()["session_id"]
        try:
            body = {"session_id": session, "sampling_session_seq_id": 0, "model_path": tinker_path}
            made = http.post("/create_sampling_session", json=body).raise_for_status().json()
            path = http.get(f"/samplers/{made['sampling_session_id']}").raise_for_status().json()["model_path"]
        finally:
            http.post(f"/sessions/{session}/finish", json={})
    return int(path.rsplit("@", 1)[1])


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with Serve(tmp_path_factory.mktemp("recipes-serve")) as s:
        yield s


# (recipe module, the recipe test's own arguments with ours, steps, episodes a step).
# Smaller than the recipe tests' batches: each episode here is sampled and trained on two CPU cores.
RECIPES = {
    # The test's batch_size=8 is 16 guessing games of up to 10 turns: each turn samples from the
    # whole conversation so far and each game is trained whole, minutes here. One number, its group
    # of 2 games (the test's group_size); the recipe's eval set (a tenth of 1024 numbers, 4 games
    # each) is left out.
    "guess_number": (
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        ["batch_size=1", "group_size=2", "max_tokens=8", "eval_every=0"],
        1,
        2,
    ),
    # The test's batch_size=16: 8 self-play games a step; here one, and one evaluation game
    # against the base model (the recipe's default opponent, sampled from the server) at step 0.
    "text_arena": (
        "tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
        ["batch_size=2", "num_train_datapoints=128", "num_test_datapoints=2", "max_tokens=8"],
        2,
        2,
    ),
    # The recipe test's second case: the evaluation game against an opponent moving at random.
    "text_arena_random_opponent": (
        "tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
        ["batch_size=2", "num_train_datapoints=128", "test_opponent=random", "num_test_datapoints=2", "max_tokens=8"],
        1,
        2,
    ),
    # Its test passes only behavior_if_log_dir_exists=delete (below for all); the defaults are
    # 32 prompts of 16 completions of 64 tokens.
    "shorter": (
        "tinker_cookbook.recipes.preference.shorter.train",
        ["batch_size=2", "group_size=2", "max_tokens=8"],
        2,
        4,
    ),
}


def run_recipe(serve: Serve, module: str, args: list[str], steps: int, log: Path) -> list[dict[str, Any]]:
    """Run the recipe for ``steps`` steps; the metrics rows it wrote, after checking it exited 0."""
    command = [
        str(COOKBOOK_PYTHON),
        "-m",
        module,
        *args,
        f"model_name={HUB_ID}",
        f"renderer_name={RENDERER}",
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
        f"max_steps={steps}",
    ]
    started = time.monotonic()
    proc = subprocess.run(
        command, cwd=log.parent, env=cookbook_env(serve), capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S
    )
    print(f"--- {' '.join(command[1:])}: {time.monotonic() - started:.0f} s")
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.timeout(RECIPE_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_trains_against_serve(serve: Serve, tmp_path: Path, name: str) -> None:
    module, args, steps, episodes = RECIPES[name]
    log = tmp_path / "log"
    rows = run_recipe(serve, module, args, steps, log)
    trained = [r for r in rows if "env/all/total_episodes" in r]
    assert [r["step"] for r in trained] == list(range(steps)), rows
    assert all(r["env/all/total_episodes"] == episodes and "optim/entropy" in r for r in trained), trained
    if "num_test_datapoints=2" in args:  # step 0 played the evaluation game too
        assert any(k.startswith("test/env/all/") for k in rows[0]), rows[0]
    # The run's last checkpoint holds the weights of its last step: one optimizer step a step.
    final = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()][-1]
    assert final["name"] == "final" and final["batch"] == steps, final
    assert sampler_version(serve, final["sampler_path"]) == steps, final


@pytest.fixture
def tiny_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with Serve(tmp_path_factory.mktemp("tiny-serve"), model="tiny-random") as s:
        yield s


@pytest.mark.timeout(240)
def test_three_cookbook_rl_loops_at_once_on_one_serve(tiny_serve: Serve, tmp_path: Path) -> None:
    """Three copies of the cookbook's RL loop (each a synchronous and an asynchronous run), started
    together with one tenant's key: each finishes, and each of its runs' versions advance."""
    from polytinker.engine.models import resolve_model

    env = cookbook_env(tiny_serve, TINKER_MODEL="tiny-random", TOKENIZER_DIR=str(resolve_model("tiny-random")))
    procs = []
    for i in range(3):
        script = [str(COOKBOOK_PYTHON), str(SCRIPTS / "rl_loop.py"), str(tmp_path / f"log{i}")]
        with (tmp_path / f"copy{i}.out").open("w") as sink:  # the child writes to its own copy of the file
            procs.append(subprocess.Popen(script, cwd=SCRIPTS, env=env, stdout=sink, stderr=subprocess.STDOUT))
    started, deadline = time.monotonic(), time.monotonic() + 170
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # each copy that is still running is killed below and fails the test with its output
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"--- 3 x rl_loop.py on tiny-random: {time.monotonic() - started:.0f} s")
    for i, p in enumerate(procs):
        out = (tmp_path / f"copy{i}.out").read_text()
        assert p.returncode == 0 and "OK rl_loop" in out, f"copy {i} exited {p.returncode}\n{out[-4000:]}"
        for label in ("sync", "async"):
            line = next(x for x in out.splitlines() if x.startswith(f"{label} sampler checkpoints:"))
            versions = [int(w.rsplit("@", 1)[1]) for w in line.split(":", 1)[1].split()]
            rewards = next(x for x in out.splitlines() if x.startswith(f"{label} reward per step:")).split()[4:]
            assert versions == sorted(versions) and versions[-1] == len(rewards) >= 2, (i, label, out)
