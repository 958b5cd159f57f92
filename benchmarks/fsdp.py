"""Full-parameter learner groups: FSDP2-sharded against replicated, K=2 ranks (gloo, CPU), same run.

Each configuration runs in a fresh process (rank 0) that spawns its follower, loads the model,
and takes ``STEPS`` full-parameter steps (AdamW, so the optimizer state exists) on the same data:

- ``fsdp_rank_state_ratio``: the bytes rank 0 holds of parameters, gradients and AdamW state
  (counted from its tensors: local shards when sharded), sharded over replicated (target ~0.5:
  what lets a model larger than one device train);
- ``fsdp_peak_rss_ratio``: rank 0's peak RSS (``ru_maxrss``), sharded over replicated: the same
  saving as the process sees it, with what every process holds anyway (torch, the tokenizer, a
  layer's gathered weights, the root unit's embeddings during a pass);
- ``fsdp_step_time_ratio``: median seconds per step (forward_backward and optim_step), sharded
  over replicated: the gathers' price;
- ``fsdp_state_mb`` / ``replicated_state_mb``, ``fsdp_peak_rss_mb`` / ``replicated_peak_rss_mb``.

Run: ``python benchmarks/fsdp.py [--quick]`` (``--quick``: the tiny random model, seconds; without
it the default model, SmolLM2-135M, a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

STEPS = 3


def _worker(spec: dict[str, Any]) -> dict[str, float]:
    import torch

    from polytinker.engine.learner import AdamParams, LearnerConfig
    from polytinker.engine.learner.group import LearnerGroup
    from polytinker.engine.types import Datum

    torch.set_num_threads(1)
    config = LearnerConfig(mode="full", micro_batch_size=4, full_sharding=spec["sharding"])
    group = LearnerGroup.start(spec["model"], world_size=2, config=config)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(spec["rows"]):
        tokens = torch.randint(1, 4000, (spec["length"] + 1,), generator=g).tolist()
        data.append(Datum(tokens[:-1], tokens[1:], [1.0] * spec["length"]))
    times = []
    try:
        for _ in range(STEPS):
            start = time.perf_counter()
            group.forward_backward(data, "cross_entropy")
            group.optim_step(AdamParams(learning_rate=1e-5))
            times.append(time.perf_counter() - start)
        state = 0
        params = dict(group.learner.base_model.named_parameters())
        optimizer = group.learner._slot(None).optimizer
        for p in params.values():
            local = p.to_local() if hasattr(p, "to_local") else p
            tensors = [local] + [
                s.to_local() if hasattr(s, "to_local") else s
                for s in (optimizer.state[p].values() if optimizer is not None else [])
                if torch.is_tensor(s) and s.dim() > 0
            ]
            state += sum(t.numel() * t.element_size() for t in tensors) + local.numel() * local.element_size()  # +grad
    finally:
        group.close()
    return {
        "state_bytes": float(state),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
        "step_s": statistics.median(times[1:]),  # the first step warms up
    }


def _run(spec: dict[str, Any]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"fsdp benchmark worker failed ({spec['sharding']}):\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(quick: bool = False) -> dict[str, float]:
    from polytinker.engine.models import DEFAULT_MODEL, TINY_RANDOM

    base = {"model": TINY_RANDOM if quick else DEFAULT_MODEL, "rows": 4, "length": 32 if quick else 64}
    sharded = _run({**base, "sharding": "fsdp"})
    replicated = _run({**base, "sharding": "replicate"})
    return {
        "fsdp_rank_state_ratio": sharded["state_bytes"] / replicated["state_bytes"],
        "fsdp_peak_rss_ratio": sharded["peak_rss_bytes"] / replicated["peak_rss_bytes"],
        "fsdp_step_time_ratio": sharded["step_s"] / replicated["step_s"],
        "fsdp_state_mb": sharded["state_bytes"] / 1e6,
        "replicated_state_mb": replicated["state_bytes"] / 1e6,
        "fsdp_peak_rss_mb": sharded["peak_rss_bytes"] / 1e6,
        "replicated_peak_rss_mb": replicated["peak_rss_bytes"] / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny random model: seconds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    for name, value in run(args.quick).items():
        print(f"{name}: {value:.4g}")


if __name__ == "__main__":
    main()
