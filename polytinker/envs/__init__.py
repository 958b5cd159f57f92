"""polytinker.envs: text multi-agent environments on PettingZoo.

- ``TextAECEnv`` / ``TextParallelEnv``: bases of turn-taking and simultaneous-move text games
  (observations ``{"text", "legal_moves", "current_player"}``, actions are text).
- ``register`` / ``make`` / ``env_specs``: versioned ids, lazy entry points, plugins from the
  ``polytinker.envs`` entry-point group.
- Built-in games: tictactoe-v0, connect_four-v0, kuhn_poker-v0, prisoners_dilemma-v0 (parallel),
  signal-v0 (cooperative), negotiation-v0, guess_number-v0 and textworld-v0 (single agent);
  pz_tictactoe-v3 and pz_connect_four-v3 through ``PettingZooTextEnv``, the adapter for discrete PettingZoo envs.
- debate-v0: two debaters on a seeded arithmetic claim, a scripted referee or a judge agent.
- ``textarena/<Game>-v0``: TextArena's two-player games (``textarena_adapter``, the optional
  ``textarena`` extra), registered when first asked for.
- ``Coordinator``: drives many episodes against ``policy(agent_id, PolicyInput) -> str``.
- ``EnvServer`` / ``RemoteEnv``: envs in another process or machine over ZeroMQ.
- ``EnvHookError``: a game's hook returned the wrong type (it names the hook and the line of its def).
- ``EnvSource``: an env by id, local or at an env server's address (what train, play and check take).
- ``check_env``: the conformance checks behind ``polytinker env check``.

This package never imports torch: env processes stay light.
"""

from polytinker.envs.adapter import PettingZooTextEnv, pettingzoo_text_env
from polytinker.envs.base import TextAECEnv, TextParallelEnv, parse_choice
from polytinker.envs.checker import Finding, check_env
from polytinker.envs.config import CoordinatorConfig, EnvConfig, EnvServerConfig, RemoteEnvConfig
from polytinker.envs.coordinator import Coordinator, Policy
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy, scripted_policy
from polytinker.envs.registry import EnvSpec, env_specs, make, register
from polytinker.envs.remote import EnvServer, RemoteAECEnv, RemoteEnv, RemoteParallelEnv, RemoteScriptedPolicy
from polytinker.envs.source import EnvSource
from polytinker.envs.types import (
    AgentAction,
    AgentID,
    EpisodeResult,
    InvalidAction,
    ModelSample,
    PolicyInput,
    TextObservation,
    Trajectory,
    Turn,
)
from polytinker.errors import EnvBusy, EnvHookError

__all__ = [
    "AgentAction",
    "AgentID",
    "Coordinator",
    "CoordinatorConfig",
    "EnvBusy",
    "EnvConfig",
    "EnvHookError",
    "EnvServer",
    "EnvServerConfig",
    "EnvSource",
    "EnvSpec",
    "EpisodeResult",
    "Finding",
    "InvalidAction",
    "ModelSample",
    "PettingZooTextEnv",
    "Policy",
    "PolicyInput",
    "RandomPolicy",
    "RemoteAECEnv",
    "RemoteEnv",
    "RemoteEnvConfig",
    "RemoteParallelEnv",
    "RemoteScriptedPolicy",
    "ScriptedPolicy",
    "TextAECEnv",
    "TextObservation",
    "TextParallelEnv",
    "Trajectory",
    "Turn",
    "check_env",
    "env_specs",
    "make",
    "parse_choice",
    "pettingzoo_text_env",
    "register",
    "scripted_policy",
]
