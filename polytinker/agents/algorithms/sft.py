"""SFT from JSONL conversations: cross-entropy on the assistant messages only.

Each line of the file is ``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}]}``.
Conversations are rendered with the base model's chat template (``Renderer.conversation_datum``);
the system and user tokens get weight 0. Weights are ``1 / (assistant tokens in the batch)``, so the
loss is the per-token mean.
"""

from __future__ import annotations

import json
from pathlib import Path

from polytinker.agents.render import Renderer
from polytinker.errors import ConfigError
from polytinker.types import Datum, TensorData


def read_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    conversations = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read SFT data {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f'{path}:{n}: expected {{"messages": [...]}} on each line ({exc})') from exc
        if not any(m.get("role") == "assistant" for m in messages):
            raise ConfigError(f"{path}:{n}: a conversation needs at least one assistant message to learn from")
        conversations.append([{"role": str(m["role"]), "content": str(m["content"])} for m in messages])
    if not conversations:
        raise ConfigError(f"{path} holds no conversations")
    return conversations


def sft_batches(renderer: Renderer, conversations: list[list[dict[str, str]]], batch_size: int) -> list[list[Datum]]:
    """Datums in batches of ``batch_size`` conversations, weights normalised per batch."""
    datums = [renderer.conversation_datum(c) for c in conversations]
    batches = []
    for start in range(0, len(datums), batch_size):
        part = datums[start : start + batch_size]
        total = sum(sum(1 for w in d.loss_fn_inputs["weights"].data if w) for d in part) or 1
        batches.append([_scaled(d, 1 / total) for d in part])
    return batches


def _scaled(d: Datum, factor: float) -> Datum:
    weights = [w * factor for w in d.loss_fn_inputs["weights"].data]
    return Datum(d.model_input, {**d.loss_fn_inputs, "weights": TensorData(weights, "float32")})


__all__ = ["read_conversations", "sft_batches"]
