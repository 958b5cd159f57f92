"""The reference task of ``benchmarks/train.py``, shared by both halves of the benchmark.

Dependency-free on purpose: ``_trl_grpo.py`` imports it from TRL's own environment, where
polytinker is not installed.

- ``PROMPT``: the one user message, rendered with the model's chat template by each side.
- ``reward(text)``: 1.0 for 7; else ``max(0, 0.5 - 0.1 * |n - 7|)`` for the first integer ``n`` in the
  completion; 0.0 when there is none.
- ``group_advantages(rewards_G)``: GRPO's advantages of one group, ``(r - mean) / (std + 1e-4)``
  with the sample standard deviation, as TRL computes them (``scale_rewards="group"``).
- ``first_reaching(means, threshold)``: the first 1-based step whose mean reward is at least the threshold.
- ``linear_lr(lr, step, total)``: the learning rate of 0-based ``step`` under a linear decay to 0
  over ``total`` steps (the Hugging Face Trainer's default schedule, which TRL's GRPOTrainer uses).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

PROMPT = "Pick a number from 1 to 10. Answer with just the number."
TARGET = 7
GROUP_SIZE = 8
MAX_NEW_TOKENS = 16
LEARNING_RATE = 5e-4
LORA_RANK = 16
LORA_ALPHA = 32
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEED = 0

_INT = re.compile(r"-?\d+")


def reward(text: str) -> float:
    """Reward of one completion (see the module docstring)."""
    match = _INT.search(text)
    if match is None:
        return 0.0
    n = int(match.group())
    if n == TARGET:
        return 1.0
    return max(0.0, 0.5 - 0.1 * abs(n - TARGET))


def group_advantages(rewards_G: Sequence[float]) -> list[float]:
    """GRPO advantages of one group: centred on the group mean, scaled by its sample std (+1e-4)."""
    n = len(rewards_G)
    if n == 0:
        return []
    mean = sum(rewards_G) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / (n - 1)) if n > 1 else 0.0
    return [(r - mean) / (std + 1e-4) for r in rewards_G]


def first_reaching(means: Sequence[float], threshold: float = 0.9) -> int | None:
    """1-based index of the first step whose mean reward is >= ``threshold``; None if none is."""
    for i, m in enumerate(means, start=1):
        if m >= threshold:
            return i
    return None


def linear_lr(lr: float, step: int, total: int) -> float:
    """Learning rate of 0-based ``step`` under a linear decay from ``lr`` to 0 over ``total`` steps."""
    if total <= 0:
        return lr
    return lr * max(0.0, 1.0 - step / total)
