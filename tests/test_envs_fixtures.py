"""Envs for the env tests (no tests here): one that misbehaves on demand, one that breaks the
conformance rules, and a small discrete PettingZoo AEC env for the adapter."""

from __future__ import annotations

import random
import time
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv

from polytinker.envs.base import TextAECEnv
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.types import AgentID


class FlakyEnv(TextAECEnv):
    """One agent; 'ok' three times ends it; 'boom' raises; 'sleep' hangs 3 s; 'grow' makes the
    observation huge."""

    metadata: ClassVar[dict[str, Any]] = {"name": "flaky_v0", "render_modes": ["ansi"]}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": RandomPolicy}

    def __init__(self, config: Any = None, render_mode: str | None = None) -> None:
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)
        self.oks = 0
        self.big = False

    def instructions(self, agent: AgentID) -> str:
        return "Say ok."

    def _new_game(self) -> None:
        self.oks, self.big = 0, False

    def _current_agent(self) -> AgentID:
        return "player_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return () if self._is_over() else ("ok", "boom", "sleep", "grow")

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        if move == "boom":
            raise RuntimeError("the env blew up")
        if move == "sleep":
            time.sleep(3.0)
        if move == "grow":
            self.big = True
        self.oks += move == "ok"
        return {agent: 1.0} if move == "ok" else {}

    def _is_over(self) -> bool:
        return self.oks >= 3

    def _render(self, agent: AgentID) -> str:
        return ("x" * 3000 if self.big else "") + f"oks: {self.oks}"


class SloppyEnv(TextAECEnv):
    """Breaks the rules the checker enforces: a global-random secret (not seeded), a listed
    legal move that the parser refuses, empty instructions."""

    metadata: ClassVar[dict[str, Any]] = {"name": "sloppy_v0", "render_modes": ["ansi"]}

    def __init__(self, config: Any = None, render_mode: str | None = None) -> None:
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)
        self.secret, self.moves = 0, 0

    def instructions(self, agent: AgentID) -> str:
        return ""

    def _new_game(self) -> None:
        self.secret, self.moves = random.randint(0, 10**9), 0

    def _current_agent(self) -> AgentID:
        return "player_0"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return () if self._is_over() else ("left", "right")

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        from polytinker.envs.base import parse_choice

        return parse_choice(text, ("left",))

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        self.moves += 1
        return {}

    def _is_over(self) -> bool:
        return self.moves >= 2

    def _render(self, agent: AgentID) -> str:
        return f"secret {self.secret}, moves {self.moves}"


class CountdownAEC(AECEnv):
    """A plain PettingZoo AEC env (not text): two players remove 1 or 2 from a counter; who
    reaches 0 wins. Discrete(2) actions, action mask in the info (not in the observation)."""

    metadata: ClassVar[dict[str, Any]] = {"name": "countdown_v0"}

    def __init__(self) -> None:
        super().__init__()
        self.possible_agents = ["player_0", "player_1"]
        self._obs = {a: spaces.Box(0, 20, (1,), np.int64) for a in self.possible_agents}
        self._act = {a: spaces.Discrete(2) for a in self.possible_agents}
        self.count = 0

    def observation_space(self, agent: AgentID) -> spaces.Space:
        return self._obs[agent]

    def action_space(self, agent: AgentID) -> spaces.Space:
        return self._act[agent]

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        self.count = int(np.random.default_rng(seed).integers(5, 10))
        self.agents = list(self.possible_agents)
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0.0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.agent_selection = self.agents[0]
        self._set_infos()

    def _set_infos(self) -> None:
        self.infos = {a: {"action_mask": np.array([1, int(self.count >= 2)], dtype=np.int8)} for a in self.agents}

    def observe(self, agent: AgentID) -> np.ndarray:
        return np.array([self.count], dtype=np.int64)

    def step(self, action: Any) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        self._cumulative_rewards[agent] = 0
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self.count -= int(action) + 1
        if self.count <= 0:
            self.rewards = {a: (1.0 if a == agent else -1.0) for a in self.agents}
            self.terminations = dict.fromkeys(self.agents, True)
        else:
            self.agent_selection = self.possible_agents[1 - self.possible_agents.index(agent)]
        self._set_infos()
        self._accumulate_rewards()
