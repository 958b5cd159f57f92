"""A local runtime with ``colocate = true`` (tiny-random): one worker process registered as the
engine and as the learner group, a short RL step of two agents through the project's client, a
full-parameter job refused naming the setting; and the config's checks of what can be colocated."""

from __future__ import annotations

import math

import pytest

from polytinker.client import ServiceClient
from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import Datum, SamplingParams
from polytinker.errors import ConfigError
from polytinker.scheduler.service import (
    EngineWorkerConfig,
    InprocRuntime,
    LearnerWorkerConfig,
    LocalRuntime,
    RuntimeConfig,
)

MODEL = "tiny-random"
PROMPT = [1, 17, 230, 4096, 88, 9]


def _rl_step(service: ServiceClient, agent: str, seed: int) -> tuple[int, list[float], list[float]]:
    """Sample a group from v0, train on it (importance sampling), step, and score a sample of v1."""
    trainer = service.create_lora_training_client(MODEL, rank=4, agent=agent, seed=seed)
    sampler = trainer.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
    group = sampler.sample(PROMPT, num_samples=4, sampling_params=params).result().sequences
    data = []
    for k, seq in enumerate(group):
        tokens = PROMPT + list(seq.tokens)
        n = len(tokens) - 1
        prompt_pad = [0.0] * (len(PROMPT) - 1)
        data.append(
            Datum(
                tokens[:-1], tokens[1:], prompt_pad + [1.0] * len(seq.tokens), [k - 1.5] * n, prompt_pad + seq.logprobs
            )
        )
    trainer.forward_backward(data, "importance_sampling").result()
    version = trainer.optim_step(AdamParams(learning_rate=5e-2)).result().version
    sampler = trainer.save_weights_and_get_sampling_client()
    seq = sampler.sample(PROMPT, num_samples=1, sampling_params=params).result().sequences[0]
    scored = sampler.compute_logprobs(PROMPT + list(seq.tokens)).result()
    return version, list(seq.logprobs), [float(x) for x in scored[len(PROMPT) :] if x is not None]


@pytest.mark.timeout(240)
def test_a_colocated_runtime_runs_an_rl_step_of_two_agents_on_one_process() -> None:
    config = RuntimeConfig(
        model=MODEL,
        colocate=True,
        engines=(EngineWorkerConfig(batch_window_s=0.02),),
        learners=(LearnerWorkerConfig(micro_batch_size=8),),
        start_timeout_s=200.0,
    )
    with LocalRuntime(config) as runtime, ServiceClient(runtime.address, api_key=runtime.api_key) as service:
        # One process serves both worker ids: the engine and the learner group the scheduler sees.
        pids = {a.name: a.pid for a in runtime.actors()}
        assert pids["engine-0"] == pids["learner-0"] > 0
        for i, agent in enumerate(("alice", "bob")):
            version, sampled, scored = _rl_step(service, agent, seed=7 + i)
            assert version == 1
            # The engine samples the version the learner just made: its logprobs are the model's own.
            assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(sampled, scored, strict=True))
        stats = service.runtime_status()["stats"]
        # Every version reached the engine in memory: v0 and v1 of each agent, nothing sent over
        # the transport; training and sampling took turns on the one model.
        assert stats["learner-0"]["handed_over"] == 4
        assert stats["engine-0"]["adapters_received"] == 0
        assert stats["learner-0"]["adapters_sent"] == 0
        assert stats["learner-0"]["phase_switches"] >= 4
        with pytest.raises(ConfigError, match="colocate = true"):
            service.create_training_client(MODEL, agent="everything")


@pytest.mark.timeout(30)
def test_the_config_refuses_what_cannot_be_colocated() -> None:
    with pytest.raises(ConfigError, match="as many of each"):
        RuntimeConfig(colocate=True, engines=(EngineWorkerConfig(), EngineWorkerConfig(engine_id="engine-1")))
    with pytest.raises(ConfigError, match="one rank"):
        RuntimeConfig(colocate=True, learners=(LearnerWorkerConfig(world_size=2),))
    with pytest.raises(ConfigError, match="hf backend"):
        RuntimeConfig(colocate=True, engines=(EngineWorkerConfig(backend="vllm"),))
    with pytest.raises(ConfigError, match="process runtime"):
        InprocRuntime(RuntimeConfig(model=MODEL, colocate=True))
    pairs = RuntimeConfig(colocate=True).colocated_pairs()
    assert [(e.engine_id, g.learner_id) for e, g in pairs] == [("engine-0", "learner-0")]
    assert RuntimeConfig.from_dict({"colocate": True}).colocate
    assert not RuntimeConfig().colocate
