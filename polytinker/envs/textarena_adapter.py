"""TextArena's two-player games as polytinker text envs (the optional ``textarena`` extra).

    pip install 'polytinker[textarena]'
    env = make("textarena/TicTacToe-v0")

``TextArenaEnv(env_id)`` wraps the game ``textarena.make(env_id)`` builds (its unwrapped
``-raw`` form: the adapter renders observations itself) as a ``TextAECEnv`` with the agents
``player_0`` and ``player_1`` (TextArena's player ids 0 and 1):

- instructions: the prompt TextArena gives the player at reset (its rules and answer format);
- observation text: the messages TextArena sent to the player, as its ``LLMObservationWrapper``
  writes them (``[GAME] ...``, ``[Player 1] ...``), all of them (``observation="full"``) or
  those since the player's last action (``"new"``, for policies that keep their own history),
  followed by a line saying whose turn it is, or how the game ended;
- actions are free-form (``legal_moves`` is empty): TextArena has no legal-move interface, and
  its own rules judge every action, as for its own agents. The moves it quotes in its messages
  (``'[4]'``, ``'[check]'``) are in ``infos[agent]["view"]["suggested_moves"]``;
- an invalid move, as TextArena reports it (``set_invalid_move``), shows in
  ``infos[agent]["invalid_action"]`` with TextArena's reason, costs ``invalid_action_penalty``,
  and leaves the same player to move while TextArena's error allowance lasts (one retry; then
  TextArena ends the game as a loss for that player). ``retries_left`` counts TextArena's;
- rewards: TextArena's, when the game ends (win +1, loss -1, draw 0, in most games);
- seeds: ``reset(seed)`` seeds TextArena's game. TextArena draws from the global ``random``
  module; each env keeps its own copy of that state and swaps it in around TextArena's calls
  (under a lock, for env servers that run envs in threads), so episodes that interleave repeat
  exactly and leave the caller's ``random`` alone.

Ids ``textarena/<Game>-v0`` register on demand (``make`` asks ``register_textarena_id``), or all
at once with ``register_textarena()``; ``OFFLINE_GAMES`` lists the games known to run offline
with no API key under Python 3.11. Other games TextArena registers can be asked for by id too;
some download word lists (nltk), call hosted LLMs (an OpenRouter key) or need Python 3.12.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import random
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Literal

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.registry import env_specs, register
from polytinker.envs.types import AgentID, PolicyInput
from polytinker.errors import ConfigError

NAMESPACE = "textarena"
TESTED_VERSION = "0.7.4"
EXTRA_HINT = "install the textarena extra: pip install 'polytinker[textarena]'"

# Two-player games of textarena 0.7.4 that reset and finish under random play with the network
# blocked and no API keys, under Python 3.11 (others: nltk word lists, OpenRouter judges, or
# f-strings that need Python 3.12).
OFFLINE_GAMES: tuple[str, ...] = (
    "Battleship-v0",
    "Breakthrough-v0",
    "ColonelBlotto-v0",
    "ConnectFour-v0",
    "IndianPoker-v0",
    "IteratedPrisonersDilemma-v0",
    "IteratedRockPaperScissors-v0",
    "KuhnPoker-v0",
    "LiarsDice-v0",
    "MemoryGame-v0",
    "Nim-v0",
    "Othello-v0",
    "PigDice-v0",
    "SimpleNegotiation-v0",
    "SimpleTak-v0",
    "Stratego-v0",
    "TicTacToe-v0",
    "TruthAndDeception-v0",
    "UltimateTicTacToe-v0",
    "WildTicTacToe-v0",
)

_PROMPT, _PLAYER_ACTION = "PROMPT", "PLAYER_ACTION"
_GAME_ID = -1  # textarena.GAME_ID: the sender of the game's own messages
# A move the game quotes, like '[4]' or '[Offer: 3 Wood -> 2 Ore]'; a line that lists the moves
# ("Available Moves: [D0 E0], [D1 E1]"), and the bracketed moves in it.
_QUOTED_MOVE = re.compile(r"'(\[[^\[\]'\n]{1,60}\])'")
_MOVES_LINE = re.compile(r"(?:available|valid|legal) (?:moves|actions)[^:\n]{0,20}:([^\n]*)", re.IGNORECASE)
_MOVE = re.compile(r"\[[^\[\]'\n]{1,60}\]")
# Every call into TextArena swaps the global random state: one env at a time.
_TEXTARENA_LOCK = threading.RLock()


def textarena_available() -> bool:
    return importlib.util.find_spec("textarena") is not None


def _textarena() -> Any:
    if not textarena_available():
        raise ConfigError(f"the TextArena games need the textarena package: {EXTRA_HINT}")
    import textarena

    return textarena


@functools.cache
def _recording(state_class: Any) -> Any:
    """A subclass of a TextArena state class that also keeps the reasons of invalid moves.

    Set as the class of each game's state after reset: the reasons travel with the state
    (deep copies included) and the game's own rules still decide what an invalid move costs."""

    def set_invalid_move(self: Any, reason: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.polytinker_invalid = [*getattr(self, "polytinker_invalid", []), str(reason)]
        return state_class.set_invalid_move(self, reason, *args, **kwargs)

    if getattr(state_class, "polytinker_recording", False):
        return state_class
    body = {"set_invalid_move": set_invalid_move, "polytinker_recording": True}
    return type(f"Recording{state_class.__name__}", (state_class,), body)


class TextArenaRandom(ScriptedPolicy):
    """Plays one of the moves the game quotes (``view["suggested_moves"]``), else a bracketed
    guess; good enough to finish games, not to win them."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        moves = view.get("suggested_moves") or ["[0]", "[1]", "[pass]"]
        return str(self.rng.choice(moves))


class TextArenaEnv(TextAECEnv):
    """A two-player TextArena game as a turn-taking text env."""

    metadata: ClassVar[dict[str, Any]] = {"name": "textarena", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": TextArenaRandom}

    def __init__(
        self,
        env_id: str,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        observation: Literal["full", "new"] = "full",
        **game_kwargs: Any,
    ) -> None:
        if observation not in ("full", "new"):
            raise ConfigError(f"textarena: observation must be 'full' or 'new', got {observation!r}")
        self.env_id, self.observation_mode, self.game_kwargs = env_id, observation, dict(game_kwargs)
        self.inner: Any = _make_game(env_id, game_kwargs)
        self.possible_agents = ["player_0", "player_1"]
        object.__setattr__(self, "metadata", {**type(self).metadata, "name": f"textarena_{env_id}"})
        super().__init__(config, render_mode)
        self._random_state: Any = None
        self._prompts: dict[int, str] = {}
        # Per player: (sender, text) of every non-prompt message, and how many it had seen
        # when it last acted.
        self._messages: dict[int, list[tuple[int, str]]] = {}
        self._seen: dict[int, int] = {}
        self._done = False

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Run TextArena code on this env's own copy of the global ``random`` state."""
        with _TEXTARENA_LOCK:
            outer = random.getstate()
            try:
                if self._random_state is not None:
                    random.setstate(self._random_state)
                yield
            finally:
                self._random_state = random.getstate()
                random.setstate(outer)

    # -- game hooks
    def _new_game(self) -> None:
        seed = int(self._rng.integers(2**31))
        self._random_state = None  # the game seeds random itself from the seed we give it
        # A fresh game each episode: some games' reset keeps parts of the last game (Stratego's
        # board, which then never fills).
        self.inner = _make_game(self.env_id, self.game_kwargs)
        with self._own_random():
            self.inner.reset(num_players=2, seed=seed)
        state = self.inner.state
        state.__class__ = _recording(state.__class__)
        self._prompts, self._messages = {}, {0: [], 1: []}
        self._seen, self._done = {0: 0, 1: 0}, False
        self._collect()

    def _collect(self) -> None:
        """Move the messages TextArena queued for each player into this env's logs."""
        pending = self.inner.state.observations
        for pid in (0, 1):
            for sender, text, kind in pending.get(pid, ()):
                if getattr(kind, "name", "") == _PROMPT:
                    self._prompts[pid] = (self._prompts.get(pid, "") + "\n" + str(text)).strip()
                else:
                    self._messages[pid].append((int(sender), str(text)))
            pending[pid] = []

    def _current_agent(self) -> AgentID:
        return f"player_{int(self.inner.state.current_player_id)}"

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        return ()  # free-form: TextArena's rules judge each action

    def _parse_move(self, agent: AgentID, text: str) -> Any:
        return text  # any non-empty text within max_action_chars goes to the game

    def fallback_move(self, agent: AgentID) -> Any:
        moves = self._suggested(_pid(agent))
        return moves[int(self._rng.integers(len(moves)))] if moves else "[pass]"

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        pid = _pid(agent)
        self._seen[pid] = len(self._messages[pid])
        invalid = self._step_game(str(move))
        self._collect()
        rewards: dict[AgentID, float] = {}
        if invalid:
            self._report_invalid(agent, invalid[-1])
            rewards[agent] = self.config.invalid_action_penalty
        if self._done:
            for p, r in (self.inner.state.rewards or {}).items():
                a = f"player_{int(p)}"
                rewards[a] = rewards.get(a, 0.0) + float(r)
        return rewards

    def _step_game(self, action: str) -> list[str]:
        """One TextArena step; the reasons of the invalid moves it reported."""
        snapshot = copy.deepcopy(self.inner)  # ~0.1 ms: a game that raises is rolled back
        with self._own_random():
            try:
                done, _ = self.inner.step(action)
            except Exception as exc:
                # A game must not crash on any text: refuse it the way TextArena refuses moves.
                self.inner = snapshot
                state = self.inner.state
                state.set_invalid_move(reason=f"the game could not read the action ({type(exc).__name__})")
                done, _ = state.step()
        state = self.inner.state
        self._done = bool(done or state.done)
        invalid = list(getattr(state, "polytinker_invalid", []))
        state.polytinker_invalid = []
        return invalid

    def _report_invalid(self, agent: AgentID, reason: str) -> None:
        state = self.inner.state
        # TextArena allows error_allowance invalid moves in a row; the move after the last of
        # them is the player's last try.
        allowance = int(getattr(state, "error_allowance", 0))
        left = 0 if self._done else max(0, allowance - int(getattr(state, "error_count", allowance)) + 1)
        note = f"TextArena refused the move: {reason.strip().rstrip('.')}"
        self._feedback[agent] = f"Invalid action: {note}." + (f" Try again ({left} tries left)." if left else "")
        self._retries_left[agent] = left

    def _is_over(self) -> bool:
        return self._done

    # -- what the players see
    def instructions(self, agent: AgentID) -> str:
        prompt = self._prompts.get(_pid(agent))
        if prompt:
            return prompt
        return (
            f"You play the TextArena game {self.env_id} as Player {_pid(agent)}. Each observation shows the "
            "game's messages; answer with your move in the format the game asks for, e.g. [4]."
        )

    def _render(self, agent: AgentID) -> str:
        pid = _pid(agent)
        if not self._messages:
            return f"{self.env_id}: the game has not started."
        shown = self._messages[pid][self._seen[pid] :] if self.observation_mode == "new" else self._messages[pid]
        lines = [f"[{self._sender(sender)}] {text}" for sender, text in shown]
        lines.append(self._status(pid))
        return "\n".join(lines)

    def _sender(self, sender: int) -> str:
        if sender == _GAME_ID:
            return "GAME"
        return str(getattr(self.inner.state, "role_mapping", {}).get(sender, f"Player {sender}"))

    def _status(self, pid: int) -> str:
        state = self.inner.state
        if self._done:
            reward = (state.rewards or {}).get(pid)
            reason = getattr(state, "game_info", {}).get(pid, {}).get("reason") or "the game ended"
            return f"Game over: {reason} Your reward: {reward}."
        current = int(state.current_player_id)
        return f"Your turn (you are Player {pid})." if current == pid else f"Waiting for Player {current}."

    def _suggested(self, pid: int) -> list[str]:
        """The moves of the game's newest message that lists or quotes any, else those the prompt
        quotes. Only the game's messages count, never a player's text."""
        for sender, text in reversed(self._messages.get(pid, [])):
            if sender != _GAME_ID:
                continue
            listed = [m for line in _MOVES_LINE.findall(text) for m in _MOVE.findall(line)]
            found = listed or _QUOTED_MOVE.findall(text)
            if found:
                return list(dict.fromkeys(found))
        return list(dict.fromkeys(_QUOTED_MOVE.findall(self._prompts.get(pid, ""))))

    def view(self, agent: AgentID) -> dict[str, Any]:
        if not self._messages:
            return {}
        pid = _pid(agent)
        return {"player": pid, "turn": int(self.inner.state.turn), "suggested_moves": self._suggested(pid)}

    def close(self) -> None:
        pass  # TextArena's close() only hands back the rewards, which step already did


def _pid(agent: AgentID) -> int:
    return int(agent.rsplit("_", 1)[1])


def _make_game(env_id: str, game_kwargs: dict[str, Any]) -> Any:
    ta = _textarena()
    registry = ta.envs.registration.ENV_REGISTRY
    if env_id not in registry:
        raise ConfigError(f"textarena has no game {env_id!r}; two-player games that run offline: {OFFLINE_GAMES}")
    raw = f"{env_id}-raw" if f"{env_id}-raw" in registry else env_id  # unwrapped: we render ourselves
    try:
        return ta.make(raw, **game_kwargs)
    except Exception as exc:
        raise ConfigError(f"textarena cannot make {env_id!r}: {type(exc).__name__}: {exc}") from exc


def textarena_env(env_id: str, **kwargs: Any) -> TextArenaEnv:
    """Entry point of the registered ``textarena/<Game>-v0`` ids."""
    return TextArenaEnv(env_id, **kwargs)


def register_textarena(games: Iterable[str] | None = None) -> list[str]:
    """Register ``textarena/<Game>`` for each game (default: ``OFFLINE_GAMES``); returns the ids,
    those already registered included. Needs the textarena package (the ``textarena`` extra)."""
    ta = _textarena()
    known = ta.envs.registration.ENV_REGISTRY
    ids = []
    for game in OFFLINE_GAMES if games is None else games:
        if game not in known:
            raise ConfigError(f"textarena has no game {game!r}; two-player games that run offline: {OFFLINE_GAMES}")
        env_id = f"{NAMESPACE}/{game}"
        if env_id not in env_specs():
            register(env_id, "polytinker.envs.textarena_adapter:textarena_env", source="textarena", env_id=game)
        ids.append(env_id)
    return ids


def register_textarena_id(env_id: str) -> None:
    """The registry's hook for an unregistered ``textarena/<Game>`` id."""
    register_textarena([env_id.split("/", 1)[1]])


__all__ = [
    "OFFLINE_GAMES",
    "TextArenaEnv",
    "TextArenaRandom",
    "register_textarena",
    "register_textarena_id",
    "textarena_available",
    "textarena_env",
]
