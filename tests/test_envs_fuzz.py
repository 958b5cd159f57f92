"""Arbitrary action text never breaks a built-in env: it is played or refused, and every
observation stays inside the observation space."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pettingzoo import AECEnv

from polytinker.envs import EnvConfig, InvalidAction, env_specs, make, parse_choice

ENV_IDS = sorted(i for i in env_specs() if not i.startswith("pz_"))


def _actions():
    return st.lists(st.text(max_size=80), min_size=1, max_size=30)


@pytest.mark.parametrize("env_id", ENV_IDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=_actions(), seed=st.integers(0, 2**16))
def test_arbitrary_text_is_played_or_refused(env_id, actions, seed):
    env = make(env_id, config=EnvConfig(max_retries=1))
    if isinstance(env, AECEnv):
        env.reset(seed=seed)
        for text in actions:
            if not env.agents:
                break
            agent = env.agent_selection
            obs, *_ = env.last()
            assert env.observation_space(agent).contains(obs), obs
            done = env.terminations[agent] or env.truncations[agent]
            env.step(None if done else text)
    else:
        observations, _ = env.reset(seed=seed)
        for text in actions:
            if not env.agents:
                break
            for agent, obs in observations.items():
                assert env.observation_space(agent).contains(obs), obs
            observations, *_ = env.step(dict.fromkeys(env.agents, text))


@given(legal=st.lists(st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True), min_size=1, max_size=8, unique=True))
def test_every_legal_move_parses_back_to_itself(legal):
    for move in legal:
        assert parse_choice(move, legal) == move
        assert parse_choice(f"  I choose {move.upper()}.", legal) == move
    assert isinstance(parse_choice("#" * 3, legal), InvalidAction)
