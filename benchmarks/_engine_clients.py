"""Concurrent clients' sampling, through the whole runtime (``benchmarks/engine.py`` imports
:func:`run`): does sampling grow with the clients that share an engine?

One local runtime on the default model (scheduler, one engine and one learner process). Four
agents, each with its own LoRA job, get a sampling client on their adapter the way a Tinker-style
script does (``save_weights_and_get_sampling_client``). In a round, each client sends its sample
calls one after another (``SAMPLES`` completions of ``TOKENS`` tokens each), after a pause of a
few milliseconds before every call, as clients that each do a little work of their own between
calls do: their requests reach the engine a moment apart, not together. Rounds of one client
alone and of all four alternate, so load from other processes hits both alike; the best round of
each counts.

- ``concurrent_clients_sampling_ratio``: total generated tokens/s of four concurrent clients over
  one client's (target >= 2.0: requests that arrive while a batch runs join it).
- ``one_client_tok_per_s`` / ``four_clients_tok_per_s``: the two rates.
- with ``--backend vllm`` (the engine on vLLM's CPU build), the same figures prefixed ``vllm_``;
  ``benchmarks/engine.py`` runs the ``hf`` engine only (vLLM's start takes minutes here).

Run alone: ``python benchmarks/_engine_clients.py --quick [--backend hf|vllm]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

MODEL = "smollm2-135m-instruct"
KEY = "clients-benchmark-key-0123"
CLIENTS = 4
SAMPLES = 8
PAUSE_S = (0.002, 0.010)  # each client's own work before a call: its arrival a moment apart


def _client_calls(sampler: Any, prompt: list[int], calls: int, tokens: int, seed: int) -> int:
    """``calls`` sample calls one after another; the tokens they generated."""
    rng = random.Random(seed)
    params = {"max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    got = 0
    for _ in range(calls):
        time.sleep(rng.uniform(*PAUSE_S))
        response = sampler.sample(prompt, SAMPLES, params).result(timeout=600)
        got += sum(len(s.tokens) for s in response.sequences)
    return got


def _round(samplers: list[Any], prompts: list[list[int]], calls: int, tokens: int, seed: int) -> float:
    """Generated tokens per second of ``samplers`` sampling at once."""
    counts = [0] * len(samplers)

    def client(i: int) -> None:
        counts[i] = _client_calls(samplers[i], prompts[i], calls, tokens, seed + i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(samplers))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def run(quick: bool = False, backend: str = "hf") -> dict[str, float]:
    from polytinker.client import ServiceClient
    from polytinker.engine.worker.config import EngineWorkerConfig
    from polytinker.scheduler.service import LocalRuntime, RuntimeConfig, TenantConfig

    calls, tokens, rounds = (2, 32, 2) if quick else (4, 64, 3)
    with tempfile.TemporaryDirectory(prefix="polytinker-bench-") as tmp:
        config = RuntimeConfig(
            model=MODEL,
            state_dir=tmp,
            tenants=(TenantConfig("bench", api_key=KEY),),
            engines=(EngineWorkerConfig(backend=backend),),  # type: ignore[arg-type]
            start_timeout_s=600.0,
        )
        runtime = LocalRuntime(config).start()
        try:
            with ServiceClient(runtime.address, api_key=KEY) as service:
                # vLLM serves no LoRA on lm_head (Tinker's train_unembed): its adapters leave it out.
                lora: dict[str, Any] = {"train_unembed": False} if backend == "vllm" else {}
                trainers = [
                    service.create_lora_training_client(MODEL, rank=16, agent=f"a{i}", **lora) for i in range(CLIENTS)
                ]
                samplers = [t.save_weights_and_get_sampling_client() for t in trainers]
                tokenizer = trainers[0].get_tokenizer()
                prompts = [tokenizer.encode(f"Agent {i} begins the story: once upon a time") for i in range(CLIENTS)]
                _round(samplers, prompts, 1, 4, seed=0)  # warm-up: every adapter resident, first allocations
                best = {"one": 0.0, "four": 0.0}
                for r in range(rounds):
                    best["one"] = max(best["one"], _round(samplers[:1], prompts[:1], calls, tokens, seed=100 * r))
                    best["four"] = max(best["four"], _round(samplers, prompts, calls, tokens, seed=100 * r + 50))
        finally:
            runtime.stop()
    prefix = "" if backend == "hf" else f"{backend}_"
    return {
        f"{prefix}concurrent_clients_sampling_ratio": best["four"] / best["one"],
        f"{prefix}one_client_tok_per_s": best["one"],
        f"{prefix}four_clients_tok_per_s": best["four"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: about 2 minutes on 2 cores")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="the engine's backend")
    args = parser.parse_args()
    for name, value in run(quick=args.quick, backend=args.backend).items():
        print(f"{name}: {value:.4g}")


if __name__ == "__main__":
    main()
