"""Training against a remote env server (`[env] address`, `polytinker train --env-address`): the
episodes and the evaluation's scripted opponents run on the server; and a run whose env raises
fails with the reason instead of reporting zeros. The tiny random model, in-process runtime."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from fixtures.client import inproc_tiny_client

from polytinker import cli
from polytinker.agents import AdapterSpec, AgentSpec, AlgorithmConfig, EvalConfig, Experiment, SamplingConfig
from polytinker.agents.config import EnvSetup, ExperimentConfig, OutputConfig, TrainConfig
from polytinker.agents.metrics import read_metrics
from polytinker.envs import EnvServer, register
from polytinker.envs.games.prisoners_dilemma import PrisonersDilemmaEnv
from polytinker.envs.registry import unregister
from polytinker.errors import EnvError

TINY = "tiny-random"
pytestmark = pytest.mark.timeout(600)


class BrokenDilemma(PrisonersDilemmaEnv):
    """The prisoner's dilemma whose rounds never resolve: every episode aborts."""

    metadata: ClassVar[dict[str, Any]] = {"name": "broken_dilemma_v0", "render_modes": ["ansi"]}

    def _resolve(self, moves: dict[str, Any]) -> dict[str, float]:
        raise ZeroDivisionError("the payoff table is empty")


@pytest.fixture(scope="module")
def server():
    register("broken_dilemma-v0", entry_point=BrokenDilemma)
    try:
        with EnvServer("tcp://127.0.0.1:0", env_ids=["prisoners_dilemma-v0", "broken_dilemma-v0"]) as srv:
            yield srv
    finally:
        unregister("broken_dilemma-v0")


@pytest.fixture(scope="module")
def service():
    client = inproc_tiny_client()
    yield client
    client.close()


def agent(name: str) -> AgentSpec:
    return AgentSpec(
        name,
        base_model=TINY,
        adapter=AdapterSpec(rank=4, alpha=8),
        algorithm=AlgorithmConfig(name="reinforce", learning_rate=1e-3),  # type: ignore[arg-type]
        sampling=SamplingConfig(max_tokens=4),
    )


def test_training_and_evaluation_against_an_env_server(server, service, tmp_path):
    config = ExperimentConfig(
        name="remote",
        env=EnvSetup("prisoners_dilemma-v0", address=server.address, kwargs={"rounds": 1}),
        agents=(agent("alice"), agent("bob")),
        train=TrainConfig(steps=1, groups=2, group_size=2),
        eval=EvalConfig(episodes=2, opponents=("random", "heuristic")),
        output=OutputConfig(root=str(tmp_path), progress=False, tensorboard=False),
    )
    summary = Experiment(config).train(service=service)
    rows = read_metrics(tmp_path / "remote")
    assert [r["step"] for r in rows] == [0, 1, 1]
    assert rows[1]["aborted"] == 0 and rows[1]["episodes"] == 4
    for name in ("alice", "bob"):
        for opponent in ("random", "heuristic"):  # played by the server
            assert f"eval/{name}/{opponent}/win_rate" in summary.after
    assert rows[-1]["eval/aborted"] == 0
    assert server.num_episodes == 0  # the probe and every episode closed


def test_a_run_whose_env_raises_fails_with_the_reason(server, tmp_path, capsys):
    path = tmp_path / "broken.toml"
    path.write_text(
        f'name = "broken"\n[env]\nid = "broken_dilemma-v0"\n[[agents]]\nname = "alice"\nbase_model = "{TINY}"\n'
        f'[[agents]]\nname = "bob"\nbase_model = "{TINY}"\n[train]\nsteps = 1\ngroups = 1\ngroup_size = 2\n'
        f'[eval]\nepisodes = 2\n[output]\nroot = "{tmp_path}"\ntensorboard = false\n[runtime]\nmode = "inproc"\n'
    )
    assert cli.main(["train", str(path), "--env-address", server.address, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "polytinker train: error: evaluation at step 0: 4 of 4 episodes aborted" in err
    assert "ZeroDivisionError: the payoff table is empty (at " in err and "test_train_remote_env.py:" in err
    assert "train.max_aborted_share = 0.5" in err
    with pytest.raises(EnvError, match="the env raised in step"):
        Experiment.from_toml(path, {"env.address": server.address, "eval.at_start": False}).train(overwrite=True)
    assert server.num_episodes == 0
