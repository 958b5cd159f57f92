"""The default ``ServiceClient()``'s runtime keeps its state in a persistent directory: one runtime
holds it at a time, another script's client attaches to it while it runs, and the paths one
script saved sample in the next runtime there; a finished job leaves its exports, not its
learner state."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polytinker import ServiceClient
from polytinker.scheduler.service.home import (
    STATE_ENV,
    Holder,
    StateDirInUse,
    StateLock,
    default_state_dir,
    running_holder,
)

MODEL = "tiny-random"
SEQUENCE = [5, 17, 230, 1400, 9]

OWNER = textwrap.dedent(
    """
    import sys
    from polytinker import ServiceClient

    sequence = [int(t) for t in sys.argv[1:]]
    datum = {"model_input": sequence[:-1], "loss_fn_inputs": {"target_tokens": sequence[1:]}}
    with ServiceClient() as service:
        trainer = service.create_lora_training_client("tiny-random", rank=4, agent="keeper", seed=3)
        for _ in range(2):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step({"learning_rate": 0.05}).result()
        path = trainer.save_weights_for_sampler("kept").result().path
        scored = service.create_sampling_client(model_path=path).compute_logprobs(sequence).result()
        print("PATH", path, trainer.job_id, flush=True)
        print("SCORED", " ".join(f"{x:.6f}" for x in scored[1:]), flush=True)
        sys.stdin.readline()  # hold the runtime until the test says so
    """
)


def test_one_runtime_holds_a_state_dir_and_says_where_it_is(tmp_path: Path) -> None:
    first, second = StateLock(tmp_path), StateLock(tmp_path)
    assert running_holder(tmp_path) is None
    first.acquire()
    first.publish(Holder(123, "ipc:///x", "key"))
    with pytest.raises(StateDirInUse, match="process 123 at ipc:///x"):
        second.acquire()
    assert running_holder(tmp_path, wait_s=1) == Holder(123, "ipc:///x", "key")
    assert (tmp_path / "runtime.json").stat().st_mode & 0o077 == 0
    first.release()
    assert running_holder(tmp_path) is None
    second.acquire()
    second.release()


def test_the_default_state_dir_is_per_model_under_the_env_or_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATE_ENV, "/srv/state")
    assert default_state_dir("HuggingFaceTB/SmolLM2-135M") == Path("/srv/state/HuggingFaceTB_SmolLM2-135M")
    monkeypatch.delenv(STATE_ENV)
    monkeypatch.setenv("POLYTINKER_CACHE", "/var/cache/pt")
    assert default_state_dir("../x") == Path("/var/cache/pt/runtime/_x")


@pytest.mark.slow
def test_scripts_share_the_default_runtime_and_its_paths_outlive_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "state"))
    monkeypatch.delenv("POLYTINKER_SCHEDULER", raising=False)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, *map(str, SEQUENCE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        _, path, job_id = owner.stdout.readline().split()
        expected = [float(x) for x in owner.stdout.readline().split()[1:]]
        state = default_state_dir(MODEL)
        with ServiceClient() as attached:  # the owner's runtime runs: this client uses it
            got = attached.create_sampling_client(model_path=path, base_model=MODEL).compute_logprobs(SEQUENCE)
            assert got.result()[1:] == pytest.approx(expected, abs=1e-5)
            assert attached.runtime is None
        with pytest.raises(StateDirInUse):
            from polytinker.scheduler.service.config import RuntimeConfig
            from polytinker.scheduler.service.runtime import LocalRuntime

            LocalRuntime(RuntimeConfig(model=MODEL, state_dir=str(state))).start()
    finally:
        owner.communicate("\n", timeout=120)
    assert owner.returncode == 0

    # The owner closed: its job finished, its runtime stopped. Its exports stay, its learner state goes.
    agent_dir = next((state / "checkpoints").glob(f"*/{job_id}/keeper"))
    assert not list(agent_dir.glob("v*")), sorted(agent_dir.iterdir())
    assert list(next((state / "adapters").glob(f"*/{job_id}/keeper")).glob("v*"))
    assert running_holder(state) is None
    with ServiceClient() as later:  # a runtime of its own on the same directory
        got = later.create_sampling_client(model_path=path, base_model=MODEL).compute_logprobs(SEQUENCE)
        assert got.result()[1:] == pytest.approx(expected, abs=1e-5)
        assert later.runtime is not None
