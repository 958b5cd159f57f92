"""Runtime figures of the engine benchmark (``benchmarks/engine.py`` imports :func:`run`): agents'
updates batched at the learner, through the whole runtime.

Two local runtimes on the default model (scheduler, one engine and one learner process each; the
engine idles: a job needs one to be placed),
alike but for ``learner_batch_max``: 8 (agents' ``forward_backward`` calls that meet at the
learner run as one pass over their adapters) and 1 (each call alone, in turn). On each, 4 agents
(LoRA rank 16, one job each) take RL-sized steps at once: every agent sends its own rows'
``forward_backward`` and its ``optim_step`` (which writes the new version's checkpoint and
export), and the round ends when every step is answered. Rounds alternate between the two
runtimes, so load from other processes hits both alike; medians over the rounds after a warm-up.

- ``runtime_batched_vs_in_turn_ratio``: trained tokens/s of the batched runtime over the in-turn
  one (> 1: batching pays; on a CPU the base model's matmuls are compute-bound, so expect about 1;
  on a GPU the shared pass fills the device).
- ``runtime_batched_share``: the share of the batched runtime's ``forward_backward`` calls that ran
  in a batch (its learner's ``batched_forward_backward`` count): that the figure above measures
  batching, not calls that never met.
- ``runtime_batched_round_s`` / ``runtime_in_turn_round_s``: median seconds per round.

Run alone: ``python benchmarks/_engine_runtime.py --quick``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import wait
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

MODEL = "smollm2-135m-instruct"
KEY = "runtime-benchmark-key-0123"
AGENTS = 4


def _data(seed: int, rows: int, length: int) -> list[Any]:
    from polytinker.engine.types import Datum

    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        tokens = [rng.randrange(10, 40000) for _ in range(length + 1)]
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * 8 + [1.0] * (length - 8)))
    return out


class _Side:
    """One runtime and its agents' training clients."""

    def __init__(self, root: Path, batch_max: int) -> None:
        from polytinker.client import ServiceClient
        from polytinker.scheduler.service import LocalRuntime, RuntimeConfig, TenantConfig

        config = RuntimeConfig(
            model=MODEL,
            state_dir=str(root),
            tenants=(TenantConfig("bench", api_key=KEY),),
            learner_batch_max=batch_max,
            start_timeout_s=300.0,
        )
        self.runtime = LocalRuntime(config).start()
        self.service = ServiceClient(self.runtime.address, api_key=KEY)
        self.agents = [
            self.service.create_lora_training_client(MODEL, rank=16, agent=f"agent{i}") for i in range(AGENTS)
        ]
        self.rounds: list[float] = []

    def round(self, batches: list[list[Any]]) -> float:
        from polytinker.engine.learner.config import AdamParams

        adam = AdamParams(learning_rate=1e-4)
        start = time.perf_counter()
        fbs = [t.forward_backward(b, "cross_entropy") for t, b in zip(self.agents, batches, strict=True)]
        steps = [t.optim_step(adam) for t in self.agents]
        wait(fbs + steps, timeout=600)
        for f in fbs + steps:
            f.result()
        return time.perf_counter() - start

    def learner_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.service.runtime_status()["stats"]["learner-0"]
        return stats

    def close(self) -> None:
        self.service.close()
        self.runtime.stop()


def run(quick: bool = False) -> dict[str, float]:
    rows, length, rounds = (2, 64, 3) if quick else (4, 128, 6)
    batches = [_data(seed=i, rows=rows, length=length) for i in range(AGENTS)]
    tokens = AGENTS * rows * length
    with tempfile.TemporaryDirectory(prefix="polytinker-bench-") as tmp:
        sides = {"batched": _Side(Path(tmp) / "batched", 8), "in_turn": _Side(Path(tmp) / "in_turn", 1)}
        try:
            for side in sides.values():
                side.round(batches)  # warm-up: adapters created, optimizer state, first allocations
            before = sides["batched"].learner_stats()
            for _ in range(rounds):
                for side in sides.values():
                    side.rounds.append(side.round(batches))
            after = sides["batched"].learner_stats()
            in_turn_batched = sides["in_turn"].learner_stats()["batched_forward_backward"]
        finally:
            for side in sides.values():
                side.close()
    assert in_turn_batched == 0, "learner_batch_max=1 must send every call alone"
    calls = after["forward_backward"] - before["forward_backward"]
    batched = after["batched_forward_backward"] - before["batched_forward_backward"]
    median = {name: statistics.median(side.rounds) for name, side in sides.items()}
    return {
        "runtime_batched_vs_in_turn_ratio": (tokens / median["batched"]) / (tokens / median["in_turn"]),
        "runtime_batched_share": batched / calls,
        "runtime_batched_round_s": median["batched"],
        "runtime_in_turn_round_s": median["in_turn"],
        "runtime_tokens_per_round": float(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: about 3 minutes on 2 cores")
    args = parser.parse_args()
    for name, value in run(quick=args.quick).items():
        print(f"{name}: {value:.4g}")


if __name__ == "__main__":
    main()
