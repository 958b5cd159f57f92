"""Aborted episodes in training are never silent: counted per step and per evaluation, shown on
the console, and past train.max_aborted_share the run stops with the first reasons (the real
Trainer and evaluation on an env that raises; no model is asked: the episodes end before a
decision)."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, ClassVar

import pytest

from polytinker.agents.aborts import aborted_metrics, check_aborted, first_reasons
from polytinker.agents.config import EnvSetup, EvalConfig, ExperimentConfig, TrainConfig
from polytinker.agents.loop import Learners, Trainer
from polytinker.agents.mapping import PolicyMapping
from polytinker.agents.rollout import Players
from polytinker.agents.spec import AgentSpec
from polytinker.envs import EnvConfig, EnvServer, RandomPolicy, TextAECEnv, register
from polytinker.envs.registry import unregister
from polytinker.envs.types import AgentID, EpisodeResult
from polytinker.errors import ConfigError, EnvError


class OddSeedsBreak(TextAECEnv):
    """One agent. Odd seeds: the env raises in reset. Even seeds: the episode is over at once
    (nobody has to move), so no policy is ever asked."""

    metadata: ClassVar[dict[str, Any]] = {"name": "odd_seeds_break_v0", "render_modes": ["ansi"]}
    scripted: ClassVar[dict] = {"random": RandomPolicy}
    always = False  # every seed breaks

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None) -> None:
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)

    def instructions(self, agent: AgentID) -> str:
        return "Nothing to do."

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        super().reset(seed=seed, options=options)
        if self.always or (seed or 0) % 2:
            raise RuntimeError(f"no board for seed {seed}")
        self.agents = []

    def _new_game(self) -> None:
        pass

    def _current_agent(self) -> AgentID:
        return "player_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return ("go",)

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        return {}

    def _is_over(self) -> bool:
        return False

    def _render(self, agent: AgentID) -> str:
        return "empty"


class AlwaysBreaks(OddSeedsBreak):
    always = True


class BreaksTheSameWay(OddSeedsBreak):
    """Every episode raises the same error, whatever its seed."""

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        raise RuntimeError("no board")


class Hooks:
    """What the Trainer reports to (the Experiment's part): here it keeps the transcripts."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def transcripts(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows

    async def after_update(self, step: int) -> None:
        pass

    async def end_step(self, step: int, metrics: dict[str, float]) -> None:
        pass


def trainer(env_class: type, max_share: float = 0.5, env: EnvSetup | None = None, groups: int = 4) -> Trainer:
    config = ExperimentConfig(
        name="aborts",
        env=env or EnvSetup(id=f"{__name__}:{env_class.__name__}"),
        agents=(AgentSpec("alice"),),
        train=TrainConfig(steps=1, groups=groups, group_size=2, max_aborted_share=max_share),
        eval=EvalConfig(episodes=6),
    )
    env = env_class()
    players = Players({"alice": config.agents[0]}, {}, {"random": RandomPolicy(0)})
    mapping = PolicyMapping(config.mapping, env.possible_agents, config.agents)
    return Trainer(config, players, mapping, Learners({}, {}, config), config.env.source().factory(), Hooks())


def test_a_step_whose_episodes_all_abort_stops_the_run_with_the_reason():
    with pytest.raises(EnvError) as info:
        asyncio.run(trainer(AlwaysBreaks).rollouts(0))
    message = str(info.value)
    assert message.startswith("step 0: 8 of 8 episodes aborted: RuntimeError: no board for seed")
    assert "test_agents_aborts.py:" in message and "in reset" in message  # where in the env's code
    assert "train.max_aborted_share = 0.5" in message and "polytinker env check" in message


def test_an_evaluation_whose_episodes_all_abort_stops_the_run_too():
    with pytest.raises(EnvError, match=r"evaluation at step 0: 6 of 6 episodes aborted: RuntimeError"):
        asyncio.run(trainer(AlwaysBreaks).evaluate(0))


def test_up_to_the_share_they_are_counted_and_shown(caplog):
    caplog.set_level(logging.WARNING, logger="polytinker.agents")
    results, _ = asyncio.run(trainer(OddSeedsBreak, max_share=0.5).rollouts(0))
    assert aborted_metrics(results) == {"aborted": 4.0, "aborted_share": 0.5}
    assert "step 0: 4 of 8 episodes aborted" in caplog.text and "left out" in caplog.text
    with pytest.raises(EnvError, match="4 of 8 episodes aborted"):
        asyncio.run(trainer(OddSeedsBreak, max_share=0.4).rollouts(0))
    metrics = asyncio.run(trainer(OddSeedsBreak).evaluate(0))
    assert metrics["eval/aborted"] == 3.0 and metrics["eval/aborted_share"] == 0.5


def test_identical_failures_of_a_remote_env_are_one_reason_and_the_fix_names_its_address():
    # A real env server; every episode raises there, so each reason names its own episode id.
    register("breaks_the_same_way-v0", entry_point=BreaksTheSameWay)
    try:
        with EnvServer("tcp://127.0.0.1:0", env_ids=["breaks_the_same_way-v0"]) as server:
            remote = EnvSetup("breaks_the_same_way-v0", address=server.address)
            with pytest.raises(EnvError) as info:
                asyncio.run(trainer(BreaksTheSameWay, env=remote, groups=16).rollouts(0))
    finally:
        unregister("breaks_the_same_way-v0")
    message = str(info.value)
    assert message.startswith("step 0: 32 of 32 episodes aborted: EnvError: env.reset of breaks_the_same_way-v0 ")
    assert "RuntimeError: no board" in message and "other reasons" not in message
    assert "(32 episodes, each with its own episode id: one shown)" in message
    assert len(set(re.findall(r"episode ([0-9a-f]{32})", message))) == 1  # the example's id
    assert f"polytinker env check breaks_the_same_way-v0 --env-address {server.address}" in message
    # A local env's fix names the check without an address.
    with pytest.raises(EnvError) as local:
        asyncio.run(trainer(AlwaysBreaks).rollouts(0))
    assert f"`polytinker env check {__name__}:AlwaysBreaks` runs it" in str(local.value)


def test_reasons_are_counted_and_the_share_is_a_setting():
    results = [EpisodeResult(str(i), "x", i, {}, 0, 0.0, aborted=["boom", "boom", "bang", None][i]) for i in range(4)]
    assert first_reasons(results) == "boom (2 episodes); bang (1 episode)"
    ids = ["0123456789ab", "ba9876543210", "00000000000a"]
    named = [EpisodeResult(i, "x", 0, {}, 0, 0.0, aborted=f"step of x episode {i}: boom") for i in ids]
    named.append(EpisodeResult("1", "x", 0, {}, 0, 0.0, aborted="bang"))
    assert first_reasons(named, limit=1) == (
        "step of x episode 0123456789ab: boom (3 episodes, each with its own episode id: one shown); and 1 other reason"
    )
    check_aborted(results, 0.75, "step 3")  # 3 of 4 is not more than 0.75
    with pytest.raises(EnvError, match="step 3: 3 of 4 episodes aborted: boom"):
        check_aborted(results, 0.5, "step 3")
    with pytest.raises(ConfigError, match="max_aborted_share must be in"):
        TrainConfig(max_aborted_share=1.5)
