"""Play a text env in the terminal against scripted opponents (``polytinker env play``).

The person is one agent (the first by default); every other agent is a scripted policy. It
reads one action per line from ``stdin`` and writes to ``stdout``, so it can be scripted too
(``printf '5\\n1\\n' | polytinker env play tictactoe-v0``).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from polytinker.envs.coordinator import Coordinator
from polytinker.envs.opponents import scripted_policy
from polytinker.envs.registry import make
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
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> EpisodeResult | None:
    """One episode with a person as ``agent``; None when the input ended first."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    env = make(env_id)
    human = agent or env.possible_agents[0]
    if human not in env.possible_agents:
        raise ConfigError(f"{env_id} has no agent {human!r}; its agents: {', '.join(env.possible_agents)}")
    table = getattr(env, "scripted", {}) or {}
    if opponent not in table:
        print(f"({env_id} has no {opponent!r} opponent; playing against 'random')", file=stdout)
        opponent = "random"
    policies: dict[AgentID, Any] = {}
    for i, a in enumerate(env.possible_agents):
        if a != human:
            policies[a] = _announce(scripted_policy(env, opponent, None if seed is None else seed + i + 1), stdout)
    policies[human] = _HumanPolicy(human, stdin, stdout)
    print(f"== {env_id}: you are {human}; opponents: {opponent}\n{env.instructions(human)}\n", file=stdout)
    try:
        result = Coordinator().run_sync(lambda: env, policies, [seed], env_id=env_id)[0]
    except _InputEnded:
        print("\n(input ended; game abandoned)", file=stdout)
        return None
    if hasattr(env, "render_for"):
        print(f"\n{env.render_for(human)}", file=stdout)
    rewards = ", ".join(f"{a}: {r:g}" for a, r in result.total_rewards.items())
    print(f"== game over. rewards: {rewards}", file=stdout)
    return result


class _HumanPolicy:
    def __init__(self, agent: AgentID, stdin: TextIO, stdout: TextIO) -> None:
        self.agent, self.stdin, self.stdout = agent, stdin, stdout

    def __call__(self, agent: AgentID, inp: PolicyInput) -> str:
        print(f"\n{inp.observation.text}", file=self.stdout)
        legal = inp.observation.legal_moves
        if legal and len(legal) <= 20:
            print(f"(legal: {', '.join(legal)})", file=self.stdout)
        print("> ", end="", file=self.stdout, flush=True)
        line = self.stdin.readline()
        if not line:
            raise _InputEnded()
        return line.rstrip("\n")


def _announce(policy: Any, stdout: TextIO) -> Any:
    def wrapped(agent: AgentID, inp: PolicyInput) -> str:
        action: str = policy(agent, inp)
        print(f"{agent}: {action}", file=stdout)
        return action

    return wrapped


__all__ = ["play"]
