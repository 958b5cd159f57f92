"""SFT through the client API: ``train_sft`` runs cross-entropy on JSONL conversations."""

from __future__ import annotations

from polytinker.agents.algorithms.sft import read_conversations, sft_batches
from polytinker.agents.clients import training_client
from polytinker.agents.protocols import ServiceClientLike, TrainingClientLike
from polytinker.agents.render import Renderer
from polytinker.agents.spec import AgentSpec
from polytinker.agents.types import AlgorithmName
from polytinker.errors import ConfigError
from polytinker.types import AdamParams


def train_sft(
    spec: AgentSpec, service: ServiceClientLike, *, epochs: int = 1, batch_size: int = 8
) -> tuple[TrainingClientLike, list[float]]:
    """Train ``spec``'s adapter (or full weights) on ``spec.algorithm.sft_data``; returns the
    training client (to sample from or keep training with RL) and the loss of each step."""
    if spec.algorithm.name is not AlgorithmName.SFT:
        raise ConfigError(f"agent {spec.name}: train_sft needs algorithm.name = 'sft'")

    # The client loads when a run starts, not with polytinker.agents (which env authors import too).
    from polytinker.client import load_tokenizer

    renderer = Renderer(load_tokenizer(spec.base_model), spec.renderer)
    batches = sft_batches(renderer, read_conversations(spec.algorithm.sft_data), batch_size)
    client = training_client(service, spec, epochs * len(batches))
    losses = []
    for _ in range(epochs):
        for batch in batches:
            fb = client.forward_backward(batch, "cross_entropy")
            client.optim_step(AdamParams(learning_rate=spec.algorithm.learning_rate)).result()
            losses.append(fb.result().loss)
    return client, losses


__all__ = ["train_sft"]
