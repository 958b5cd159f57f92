"""Base classes of text environments: ``TextAECEnv`` (turn-taking) and ``TextParallelEnv``
(simultaneous moves), both real PettingZoo envs.

A game subclasses one of them and writes only the rules (hooks named ``_new_game``,
``_apply``/``_resolve``, ``_render`` ...); the bases keep the PettingZoo contract (agents,
rewards accumulation, termination bookkeeping) and the text-specific parts that every env
shares: per-agent instructions, parsing action text into a legal move, invalid actions with a
penalty and retries, seeded randomness.

Observation of an agent (space ``Dict``)::

    {"text": str, "legal_moves": tuple[str, ...], "current_player": str}

There is deliberately no ``"observation"`` key: PettingZoo's checker compares the dtype of
that key with numpy's, which a ``str`` has not. Actions are plain ``str`` (space ``Text``).
Each agent's info dict carries ``view`` (the agent-visible state as plain data, what scripted
opponents read) and, after a refused action, ``invalid_action`` and ``retries_left``.

What a hook returns is checked where the base uses it (``_render`` text, ``legal_moves`` strings,
``_apply``/``_resolve`` rewards for the game's agents, ``_current_agent``, ``view``): a wrong
type raises ``EnvHookError`` naming the hook and the file and line of the game's ``def``, since
the traceback of such an error holds only the base's frames.
"""

from __future__ import annotations

import copy
import functools
import re
import string
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv, ParallelEnv

from polytinker.envs._trace import hook_location
from polytinker.envs.config import EnvConfig
from polytinker.envs.types import AgentID, InvalidAction
from polytinker.errors import EnvHookError

TEXT_CHARSET = frozenset(string.printable)
_OUTSIDE_CHARSET = re.compile(f"[^{re.escape(string.printable)}]")
_AGENT_CHARSET = frozenset(string.ascii_letters + string.digits + "_-.")


def parse_choice(text: str, legal: Sequence[str]) -> str | InvalidAction:
    """Read a move out of free text: an exact (case-insensitive) legal move, or else the *last*
    legal move the text names as a whole word (an answer usually comes last)."""
    stripped = text.strip()
    if not legal:
        return InvalidAction("there is no legal move now")
    canonical = {m.lower(): m for m in legal}
    if stripped.lower() in canonical:
        return canonical[stripped.lower()]
    alternatives = "|".join(re.escape(m) for m in sorted(legal, key=len, reverse=True))
    found = re.findall(rf"(?<![\w])({alternatives})(?![\w])", stripped, flags=re.IGNORECASE)
    if found:
        return canonical[found[-1].lower()]
    shown = stripped if len(stripped) <= 40 else stripped[:37] + "..."
    return InvalidAction(f"{shown!r} is not a legal move; answer with one of: {', '.join(legal)}")


@functools.lru_cache(maxsize=64)
def _space_prototypes(max_observation_chars: int, max_action_chars: int) -> tuple[spaces.Dict, spaces.Text]:
    # Building a Text space indexes its charset (~0.1 ms); envs are made per episode, so build once.
    text = spaces.Text(max_observation_chars, min_length=0, charset=TEXT_CHARSET)
    move = spaces.Text(max_action_chars, min_length=1, charset=TEXT_CHARSET)
    observation = spaces.Dict(
        {
            "text": text,
            "legal_moves": spaces.Sequence(move, stack=False),
            "current_player": spaces.Text(64, min_length=0, charset=_AGENT_CHARSET),
        }
    )
    action = spaces.Text(max_action_chars, min_length=0, charset=TEXT_CHARSET)
    return observation, action


def text_spaces(agents: Sequence[AgentID], config: EnvConfig) -> tuple[dict[AgentID, Any], dict[AgentID, Any]]:
    """Observation and action spaces of a text env: one object per agent, fixed for the env's life.

    Action spaces are shallow copies of a cached prototype, so seeding one (``reset(seed)`` does)
    touches no other env; observation spaces are shared between envs of the same bounds (nothing
    samples them)."""
    observation, action = _space_prototypes(config.max_observation_chars, config.max_action_chars)
    return dict.fromkeys(agents, observation), {a: copy.copy(action) for a in agents}


def _returned_wrong(env: Any, hook: str, value: Any, expected: str, why: str = "") -> EnvHookError:
    """The error for a hook of ``env`` that returned ``value`` where the contract wants
    ``expected``. Nothing raised in the game's code, so the traceback shows only polytinker's
    frames: the message names the hook and the line of the game that defines it."""
    where = hook_location(env, hook)
    name = f"{type(env).__name__}.{hook}"
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    because = f": {why}" if why else ""
    return EnvHookError(
        f"{name} ({where or 'no source'}) returned {shown}{because}; it must return {expected}",
        hook=name,
        where=where,
        expected=expected,
    )


def declared_tools(env: Any, agent: AgentID) -> tuple[str, ...]:
    """The tools ``env`` lets ``agent`` call: what its ``tools(agent)`` says (text envs and remote
    envs have one), or none (a PettingZoo env without it)."""
    declare = getattr(env, "tools", None)
    return tuple(str(name) for name in declare(agent)) if callable(declare) else ()


class _TextEnvCore:
    """What both bases share: config, spaces, instructions, parsing, invalid-action feedback."""

    metadata: ClassVar[dict[str, Any]] = {"name": "text_env", "render_modes": ["ansi"]}
    possible_agents: list[AgentID]
    config: EnvConfig

    def _init_core(self, config: EnvConfig | None, render_mode: str | None) -> None:
        self.config = config or EnvConfig()
        self.render_mode = render_mode
        self._obs_spaces, self._act_spaces = text_spaces(self.possible_agents, self.config)
        self._rng = np.random.default_rng()
        self._retries: dict[AgentID, int] = {}  # invalid actions in a row, this decision
        self._retries_left: dict[AgentID, int] = {}
        self._feedback: dict[AgentID, str] = {}

    # -- PettingZoo spaces: the same object on every call, as seeding of spaces requires.
    def observation_space(self, agent: AgentID) -> spaces.Space:
        return self._obs_spaces[agent]

    def action_space(self, agent: AgentID) -> spaces.Space:
        return self._act_spaces[agent]

    # -- what a game provides
    def instructions(self, agent: AgentID) -> str:
        """The agent's system prompt: rules, its role, the answer format."""
        raise NotImplementedError

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        """Canonical spellings of the moves the agent may play now (empty: free-form or not its turn)."""
        raise NotImplementedError

    def _render(self, agent: AgentID) -> str:
        """The game state as the agent may see it."""
        raise NotImplementedError

    def view(self, agent: AgentID) -> dict[str, Any]:
        """The agent-visible state as plain data (msgpack-able), for scripted opponents."""
        return {}

    def tools(self, agent: AgentID) -> tuple[str, ...]:
        """Names of the tools (``polytinker.envs.tools``) the agent may call during its turns,
        before it answers; none by default. A tool's result is shown to the model only."""
        return ()

    def render_for(self, agent: AgentID) -> str:
        """The game as ``agent`` sees it now, also after the episode ended (for display)."""
        return self._render(agent)

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        """Text to a move; the default reads one of ``legal_moves``."""
        return parse_choice(text, self._legal(agent))

    def fallback_move(self, agent: AgentID) -> Any:
        """The move played for an agent whose retries ran out: a seeded random legal move."""
        legal = self._legal(agent)
        return self._parse_move(agent, legal[int(self._rng.integers(len(legal)))])

    # -- shared behaviour
    def _legal(self, agent: AgentID) -> tuple[str, ...]:
        """``legal_moves(agent)``, refused with the hook's place when it is not a sequence of str.
        Only the ends are looked at: this runs at every observation and every parse, and a game that
        spells moves as numbers spells them all so."""
        legal = self.legal_moves(agent)
        if type(legal) is tuple and (not legal or (type(legal[0]) is str and type(legal[-1]) is str)):
            return legal
        if isinstance(legal, tuple | list) and all(isinstance(m, str) for m in legal):
            return tuple(legal)
        raise _returned_wrong(self, "legal_moves", legal, "a tuple of str: the moves' canonical spellings")

    def _add_rewards(self, hook: str, rewards: Any, into: dict[AgentID, float]) -> None:
        """Add a hook's ``{agent: reward}`` into ``into`` (one entry per live agent)."""
        try:
            for a, r in rewards.items():
                into[a] += float(r)
        except (AttributeError, KeyError, TypeError, ValueError):
            expected = f"a dict {{agent: reward}} of float rewards for agents of {sorted(into)}"
            unknown = sorted(str(a) for a in rewards if a not in into) if isinstance(rewards, dict) else []
            why = f"{', '.join(map(repr, unknown))} is not an agent of this game" if unknown else ""
            raise _returned_wrong(self, hook, rewards, expected, why) from None

    def parse_action(self, agent: AgentID, text: Any) -> Any:
        """A legal move for ``text``, or an ``InvalidAction`` saying why there is none."""
        if not isinstance(text, str):
            return InvalidAction(f"the action must be text, got {type(text).__name__}")
        if not text.strip():
            return InvalidAction("the action is empty")
        if len(text) > self.config.max_action_chars:
            return InvalidAction(f"the action is longer than {self.config.max_action_chars} characters")
        return self._parse_move(agent, text)

    def _observation(self, agent: AgentID, current_player: str, legal: tuple[str, ...]) -> dict[str, Any]:
        text = self._render(agent)
        if not isinstance(text, str):
            raise _returned_wrong(self, "_render", text, "str: the game as the agent sees it")
        if agent in self._feedback:
            text = f"{text}\n{self._feedback[agent]}"
        # Actions are echoed back (clues, refused text): keep the text inside the space's charset.
        text = _OUTSIDE_CHARSET.sub("?", text)
        limit = self.config.max_observation_chars
        if len(text) > limit:
            # Keep the end: the latest state and the feedback matter most.
            text = "[...]" + text[-(limit - 5) :]
        return {"text": text, "legal_moves": legal, "current_player": current_player}

    def _refuse(self, agent: AgentID, reason: str) -> bool:
        """Book an invalid action; True when the agent may try again."""
        self._retries[agent] = self._retries.get(agent, 0) + 1
        left = self.config.max_retries - self._retries[agent] + 1
        self._retries_left[agent] = max(0, left)
        if left > 0:
            self._feedback[agent] = f"Invalid action: {reason}. Try again ({left} tries left)."
            return True
        self._feedback[agent] = f"Invalid action: {reason}. No tries left."
        self._retries[agent] = 0  # the fallback or forfeit settles it: the next decision starts afresh
        return False

    def _accept(self, agent: AgentID) -> None:
        self._retries[agent] = 0
        self._feedback.pop(agent, None)
        self._retries_left.pop(agent, None)

    def _agent_info(self, agent: AgentID) -> dict[str, Any]:
        view = self.view(agent)
        if not isinstance(view, dict):
            raise _returned_wrong(self, "view", view, "a dict of plain data (what scripted opponents read)")
        info: dict[str, Any] = {"view": view}
        if agent in self._feedback:
            info["invalid_action"] = self._feedback[agent]
            info["retries_left"] = self._retries_left.get(agent, 0)
        return info

    def _seed(self, seed: int | None) -> None:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
            for a in self.possible_agents:
                self._act_spaces[a].seed(int(self._rng.integers(2**31)))
        self._retries, self._retries_left, self._feedback = {}, {}, {}


class TextAECEnv(_TextEnvCore, AECEnv):
    """A turn-taking text game. Subclasses set ``metadata["name"]`` and ``possible_agents`` and
    implement ``_new_game``, ``_current_agent``, ``_apply``, ``_is_over``, ``_render``,
    ``legal_moves``, ``instructions`` (and ``view``, ``_parse_move``, ``fallback_move`` as needed).
    """

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None) -> None:
        AECEnv.__init__(self)
        self._init_core(config, render_mode)
        self.agents: list[AgentID] = []

    # -- game hooks
    def _new_game(self) -> None:
        raise NotImplementedError

    def _current_agent(self) -> AgentID:
        raise NotImplementedError

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        """Play ``move`` for ``agent``; the rewards it earns (any agent)."""
        raise NotImplementedError

    def _is_over(self) -> bool:
        raise NotImplementedError

    def _is_truncated(self) -> bool:
        """True when the episode is cut short (a turn limit that is not a game rule)."""
        return False

    # -- PettingZoo
    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        self._seed(seed)
        self.agents = list(self.possible_agents)
        self._new_game()
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0.0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.agent_selection = self._next_agent()
        self._refresh_infos()

    def observe(self, agent: AgentID) -> dict[str, Any]:
        live = agent in self.terminations and not (self.terminations[agent] or self.truncations[agent])
        mover = agent == self.agent_selection and live
        return self._observation(agent, self.agent_selection, self._legal(agent) if mover else ())

    def step(self, action: Any) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        self._cumulative_rewards[agent] = 0.0
        self.rewards = dict.fromkeys(self.agents, 0.0)
        move = self.parse_action(agent, action)
        if isinstance(move, InvalidAction):
            self.rewards[agent] += self.config.invalid_action_penalty
            if self._refuse(agent, move.reason):
                pass  # the same agent moves again
            elif self.config.on_retries_exhausted == "forfeit":
                self.rewards[agent] += self.config.forfeit_reward
                self.terminations = dict.fromkeys(self.agents, True)
            else:
                self._play(agent, self.fallback_move(agent))
        else:
            self._accept(agent)
            self._play(agent, move)
        self._refresh_infos()
        self._accumulate_rewards()

    def _play(self, agent: AgentID, move: Any) -> None:
        self._add_rewards("_apply", self._apply(agent, move), self.rewards)
        if self._is_over():
            self.terminations = dict.fromkeys(self.agents, True)
        elif self._is_truncated():
            self.truncations = dict.fromkeys(self.agents, True)
        else:
            self.agent_selection = self._next_agent()

    def _next_agent(self) -> AgentID:
        agent = self._current_agent()
        if agent not in self.terminations:
            raise _returned_wrong(self, "_current_agent", agent, f"one of the agents {self.agents}")
        return agent

    def _refresh_infos(self) -> None:
        self.infos = {a: self._agent_info(a) for a in self.agents}

    def render(self) -> str:
        return self._render(self.agent_selection)

    def close(self) -> None:
        pass


class TextParallelEnv(_TextEnvCore, ParallelEnv):
    """A simultaneous-move text game. Subclasses implement ``_new_game``, ``_resolve`` (all
    moves of a round to rewards), ``_is_over``, ``_render``, ``legal_moves``, ``instructions``.

    An agent whose action is refused with retries left is asked again while the others' moves
    wait (``infos[agent]["needs_action"]`` tells who must act; actions of the others are ignored
    until the round resolves).
    """

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None) -> None:
        self._init_core(config, render_mode)
        self.agents: list[AgentID] = []
        self._pending: dict[AgentID, Any] = {}

    def _new_game(self) -> None:
        raise NotImplementedError

    def _resolve(self, moves: dict[AgentID, Any]) -> dict[AgentID, float]:
        raise NotImplementedError

    def _is_over(self) -> bool:
        raise NotImplementedError

    def _is_truncated(self) -> bool:
        return False

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self._seed(seed)
        self.agents = list(self.possible_agents)
        self._pending = {}
        self._new_game()
        return self._observations(), self._infos()

    def step(self, actions: dict[AgentID, Any]) -> tuple[dict, dict, dict, dict, dict]:
        rewards = dict.fromkeys(self.agents, 0.0)
        forfeit = False
        for agent in self.agents:
            if agent in self._pending:
                continue  # its move for this round is already in
            move = self.parse_action(agent, actions.get(agent))
            if not isinstance(move, InvalidAction):
                self._accept(agent)
                self._pending[agent] = move
                continue
            rewards[agent] += self.config.invalid_action_penalty
            if self._refuse(agent, move.reason):
                continue
            if self.config.on_retries_exhausted == "forfeit":
                rewards[agent] += self.config.forfeit_reward
                forfeit = True
            else:
                self._pending[agent] = self.fallback_move(agent)
        over = truncated = False
        if forfeit:
            over = True
        elif len(self._pending) == len(self.agents):
            self._add_rewards("_resolve", self._resolve(dict(self._pending)), rewards)
            self._pending = {}
            over, truncated = self._is_over(), self._is_truncated()
        terminations = dict.fromkeys(self.agents, over)
        truncations = dict.fromkeys(self.agents, truncated and not over)
        observations, infos = self._observations(), self._infos()
        if over or truncated:
            self.agents = []
        return observations, rewards, terminations, truncations, infos

    def _observations(self) -> dict[AgentID, dict[str, Any]]:
        return {a: self._observation(a, "", self._legal(a) if a not in self._pending else ()) for a in self.agents}

    def _infos(self) -> dict[AgentID, dict[str, Any]]:
        infos = {}
        for a in self.agents:
            info = self._agent_info(a)
            info["needs_action"] = a not in self._pending
            infos[a] = info
        return infos

    def render(self) -> str:
        return self._render(self.possible_agents[0])

    def close(self) -> None:
        pass


__all__ = [
    "TEXT_CHARSET",
    "TextAECEnv",
    "TextParallelEnv",
    "declared_tools",
    "parse_choice",
    "text_spaces",
]
