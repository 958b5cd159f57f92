"""Turn a PettingZoo AEC env with discrete actions and action masks (``pettingzoo.classic``)
into a text env: rendered observations, lists of legal moves, action parsing.

    env = pettingzoo_text_env("pettingzoo.classic.tictactoe_v3")

Moves are the action numbers (``"0"``..``"n-1"``), or the names given in ``action_names``.
Board observations of shape (H, W, 2) (own pieces, opponent's pieces, as in the classic games)
render as a grid; anything else renders as the array's text. ``describe`` adds game rules to
the instructions; ``render`` replaces the renderer. An inner truncation ends the episode as a
termination (text envs end all agents together). An env without an action mask is refused when
the adapter is made (``ConfigError``): its legal moves cannot be read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.registry import load_entry_point
from polytinker.envs.types import AgentID
from polytinker.errors import ConfigError, EnvError

Renderer = Callable[[Any, Sequence[str], int], str]


def render_board(observation: Any, legal: Sequence[str], num_actions: int) -> str:
    """A grid for (H, W, 2) planes: X own piece, O opponent's, the move number (when each cell is
    a move) or '.' for an empty cell, with column numbers under it when each column is a move;
    anything else as the array's text."""
    arr = np.asarray(observation)
    if arr.ndim == 3 and arr.shape[2] == 2:
        rows, cols = arr.shape[:2]
        width = len(str(rows * cols - 1))
        cell_moves = num_actions == rows * cols
        lines = []
        for r in range(rows):
            cells = []
            for c in range(cols):
                if arr[r, c, 0]:
                    cells.append("X".rjust(width))
                elif arr[r, c, 1]:
                    cells.append("O".rjust(width))
                else:
                    idx = str(r * cols + c)
                    cells.append(idx.rjust(width) if cell_moves and idx in legal else ".".rjust(width))
            lines.append(" ".join(cells))
        if num_actions == cols:
            lines.append(" ".join(str(c).rjust(width) for c in range(cols)))
        return "You are X, the opponent is O.\n" + "\n".join(lines)
    return np.array2string(arr, threshold=2000)


def _make_inner(env: str | AECEnv | Callable[[], AECEnv]) -> AECEnv:
    if isinstance(env, AECEnv):
        return env
    if isinstance(env, str):
        if ":" in env:
            return load_entry_point(env)()  # type: ignore[no-any-return]
        try:
            module = importlib.import_module(env)
        except ImportError as exc:
            raise ConfigError(f"cannot import {env!r}: {exc} (pettingzoo's classic games need pygame)") from exc
        if not hasattr(module, "env"):
            raise ConfigError(
                f"module {env!r} has no env() function; name a PettingZoo env module or 'module:function'"
            )
        return module.env()  # type: ignore[no-any-return]
    return env()


class PettingZooTextEnv(TextAECEnv):
    """A discrete-action PettingZoo AEC env seen through text."""

    metadata: ClassVar[dict[str, Any]] = {
        "name": "pettingzoo_text",
        "render_modes": ["ansi"],
        "is_parallelizable": False,
    }
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": RandomPolicy}

    def __init__(
        self,
        env: str | AECEnv | Callable[[], AECEnv],
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        action_names: Sequence[str] | None = None,
        describe: str = "",
        render: Renderer | None = None,
    ) -> None:
        self.inner = _make_inner(env)
        self.possible_agents = list(self.inner.possible_agents)
        n = getattr(self.inner.action_space(self.possible_agents[0]), "n", None)
        if n is None:
            raise ConfigError(f"{self.inner} has no discrete action space; only Discrete actions can be text moves")
        self.num_actions = int(n)
        if action_names is not None and len(action_names) != self.num_actions:
            raise ConfigError(f"action_names has {len(action_names)} names for {self.num_actions} actions")
        self.action_names = [str(x) for x in (action_names or range(self.num_actions))]
        self._require_mask()
        # Per instance: the name follows the wrapped game (metadata is a class attribute elsewhere).
        name = f"text_{self.inner.metadata.get('name', 'pettingzoo')}"
        object.__setattr__(self, "metadata", {**type(self).metadata, "name": name})
        self.describe = describe
        self.renderer = render or render_board
        super().__init__(config, render_mode)

    def _require_mask(self) -> None:
        """Refuse now an env whose legal moves cannot be read, rather than abort every episode
        later: a Dict observation space with ``action_mask`` says so without a reset; otherwise one
        reset shows whether the first mover's observation or info carries one."""
        space = self.inner.observation_space(self.possible_agents[0])
        if isinstance(space, spaces.Dict) and "action_mask" in space.spaces:
            return
        self.inner.reset(seed=0)  # _new_game resets it again, with a seed drawn from ours
        first = self.inner.agent_selection
        observation = self.inner.observe(first)
        if (isinstance(observation, dict) and "action_mask" in observation) or "action_mask" in (
            self.inner.infos.get(first) or {}
        ):
            return
        name = self.inner.metadata.get("name", type(self.inner).__name__)
        raise ConfigError(
            f"{name} cannot be adapted to text: PettingZooTextEnv reads each turn's legal moves from an action "
            f"mask, and {name} has none (observe(agent) is not a dict with 'action_mask' and infos[agent] has no "
            f"'action_mask' after reset). Give the env a 0/1 'action_mask' over its {self.num_actions} actions, in "
            "the observation dict or the info as pettingzoo.classic's board games do, or write it as a TextAECEnv "
            "whose legal_moves(agent) lists the moves (docs/envs.md, Writing a game)"
        )

    def instructions(self, agent: AgentID) -> str:
        name = self.inner.metadata.get("name", "a PettingZoo game")
        rules = f" {self.describe}" if self.describe else ""
        return (
            f"You play {name} as {agent}.{rules} Each observation shows the game and your legal moves. "
            "Answer with exactly one legal move."
        )

    def _new_game(self) -> None:
        # The inner env draws its randomness from the seed we drew from ours.
        self.inner.reset(seed=int(self._rng.integers(2**31)))

    def _current_agent(self) -> AgentID:
        return str(self.inner.agent_selection)

    def _mask(self, agent: AgentID) -> np.ndarray:
        obs = self.inner.observe(agent)
        if isinstance(obs, dict) and "action_mask" in obs:
            return np.asarray(obs["action_mask"])
        info = self.inner.infos.get(agent, {})
        if "action_mask" in info:
            return np.asarray(info["action_mask"])
        raise EnvError(f"{self.inner} gives no action_mask (in the observation dict or the info); it cannot be adapted")

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if self._is_over() or agent != self._current_agent():
            return ()
        mask = self._mask(agent)
        return tuple(self.action_names[i] for i in np.flatnonzero(mask))

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        self.inner.step(self.action_names.index(str(move)))
        return {a: float(r) for a, r in self.inner.rewards.items()}

    def _is_over(self) -> bool:
        inner = self.inner
        return not inner.agents or all(inner.terminations[a] or inner.truncations[a] for a in inner.agents)

    def _render(self, agent: AgentID) -> str:
        obs = self.inner.observe(agent)
        board = obs["observation"] if isinstance(obs, dict) and "observation" in obs else obs
        legal = self.legal_moves(agent)
        text = self.renderer(board, legal, self.num_actions)
        if self._is_over():
            return f"{text}\nGame over."
        if legal:
            return f"{text}\nYour turn. Legal moves: {', '.join(legal)}."
        return f"{text}\nWaiting for the other player."

    def view(self, agent: AgentID) -> dict[str, Any]:
        obs = self.inner.observe(agent)
        board = obs["observation"] if isinstance(obs, dict) and "observation" in obs else obs
        return {"observation": np.asarray(board).tolist()}

    def close(self) -> None:
        self.inner.close()


def pettingzoo_text_env(env: str | AECEnv | Callable[[], AECEnv], **kwargs: Any) -> PettingZooTextEnv:
    """Entry point for the registry: ``make("pz_tictactoe-v3")`` wraps ``tictactoe_v3``."""
    return PettingZooTextEnv(env, **kwargs)


__all__ = ["PettingZooTextEnv", "pettingzoo_text_env", "render_board"]
