"""Play a text env in the terminal against scripted opponents (``polytinker env play``).

The person is one agent (the first by default); every other agent is a scripted policy. It
reads one action per line from ``stdin`` and writes to ``stdout``, so it can be scripted too
(``printf '5\\n1\\n' | polytinker env play tictactoe-v0``). ``address=`` plays an env served by an
env server (its scripted opponents are played there).

In a simultaneous-move (parallel) env the opponents decide at the same time as the person: their
moves are shown once the person's move is in, never before. An env that raises ends the game
with the error and where in the env's code it was raised (``EpisodeResult.aborted``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, TextIO

from pettingzoo import AECEnv

from polytinker.envs.coordinator import Coordinator
from polytinker.envs.opponents import scripted_policy
from polytinker.envs.source import EnvSource
from polytinker.envs.types import AgentID, EpisodeResult, PolicyInput
from polytinker.errors import ConfigError


class _InputEnded(Exception):
    pass


def play(
    env_id: str,
    *,
    agent: AgentID | None = None,
    opponent: str = "heuristic",
    seed: int | None = None,
    address: str = "",
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> EpisodeResult | None:
    """One episode with a person as ``agent``; None when the input ended first. A result whose
    ``aborted`` is set is a game the env broke (the reason is printed)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    source = EnvSource(env_id, address=address)
    env = source.make()
    try:
        return _play(env, source, agent, opponent, seed, stdin, stdout)
    finally:
        env.close()


def _play(
    env: Any, source: EnvSource, agent: AgentID | None, opponent: str, seed: int | None, stdin: TextIO, stdout: TextIO
) -> EpisodeResult | None:
    env_id = source.env_id
    human = agent or env.possible_agents[0]
    if human not in env.possible_agents:
        raise ConfigError(f"{env_id} has no agent {human!r}; its agents: {', '.join(env.possible_agents)}")
    table = getattr(env, "scripted", {}) or {}
    if opponent not in table:
        print(f"({source.describe()} has no {opponent!r} opponent; playing against 'random')", file=stdout)
        opponent = "random"
    board = _Board(stdout, simultaneous=not isinstance(env, AECEnv))
    policies: dict[AgentID, Any] = {}
    for i, a in enumerate(env.possible_agents):
        if a != human:
            policies[a] = board.announcing(scripted_policy(env, opponent, None if seed is None else seed + i + 1))
    policies[human] = _HumanPolicy(stdin, board)
    print(f"== {source.describe()}: you are {human}; opponents: {opponent}\n{env.instructions(human)}\n", file=stdout)
    played = _RoundShown(env, board, human) if board.simultaneous else env
    try:
        result = Coordinator().run_sync(lambda: played, policies, [seed], env_id=env_id)[0]
    except _InputEnded:
        print("\n(input ended; game abandoned)", file=stdout)
        return None
    board.flush()
    if result.aborted:
        print(f"\n== the game stopped: the env failed: {result.aborted}", file=stdout)
        return result
    if hasattr(env, "render_for"):
        print(f"\n{env.render_for(human)}", file=stdout)
    rewards = ", ".join(f"{a}: {r:g}" for a, r in result.total_rewards.items())
    print(f"== game over. rewards: {rewards}", file=stdout)
    return result


class _Board:
    """What the person is shown of the opponents' moves: at once in turn-taking envs; in
    simultaneous-move envs once the round's moves are in, the person's too (seeing them first
    would be seeing the future)."""

    def __init__(self, stdout: TextIO, *, simultaneous: bool) -> None:
        self.stdout, self.simultaneous = stdout, simultaneous
        self._held: list[str] = []

    def show(self, line: str) -> None:
        if self.simultaneous:
            self._held.append(line)
        else:
            print(line, file=self.stdout)

    def flush(self) -> None:
        for line in self._held:
            print(line, file=self.stdout)
        self._held.clear()

    def announcing(self, policy: Any) -> Any:
        async def announced(agent: AgentID, inp: PolicyInput) -> str:
            action = policy(agent, inp)
            if inspect.isawaitable(action):  # a remote env's opponent: its server plays it
                action = await action
            self.show(f"{agent}: {action}")
            return str(action)

        return announced


class _HumanPolicy:
    def __init__(self, stdin: TextIO, board: _Board) -> None:
        self.stdin, self.board = stdin, board

    def __call__(self, agent: AgentID, inp: PolicyInput) -> str:
        stdout = self.board.stdout
        print(f"\n{inp.observation.text}", file=stdout)
        legal = inp.observation.legal_moves
        if legal and len(legal) <= 20:
            print(f"(legal: {', '.join(legal)})", file=stdout)
        print("> ", end="", file=stdout, flush=True)
        line = self.stdin.readline()
        if not line:
            raise _InputEnded()
        return line.rstrip("\n")


class _RoundShown:
    """A parallel env seen through ``play``: each step (every move of the round is in by then,
    also a remote opponent's that came after the person's) shows the opponents' moves, unless the
    person's move was refused and it is asked again."""

    def __init__(self, env: Any, board: _Board, human: AgentID) -> None:
        self._env, self._board, self._human = env, board, human

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def astep(self, actions: dict[AgentID, Any]) -> Any:
        plain = getattr(self._env, "astep", None)
        result = await plain(actions) if plain is not None else self._env.step(actions)
        info = result[4].get(self._human, {})
        if not (info.get("invalid_action") and info.get("retries_left", 0) > 0 and info.get("needs_action", True)):
            self._board.flush()
        return result


__all__ = ["play"]
