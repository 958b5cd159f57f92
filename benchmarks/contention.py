"""Speed on a busy machine: a local runtime's training step and warm sample with busy processes on
every core, against the same runtime quiet, in one run.

One local runtime on the default model (scheduler, one engine, one learner: processes, started as
``polytinker serve`` starts them). One client (a LoRA rank-16 training client, the calls a Tinker
SDK script makes) takes rounds: a ``forward_backward`` and an ``optim_step`` (the training step),
then samples from the sampler it saved before the warm-up round (a warm sample: the adapter is
resident in the engine). Rounds alternate quiet and busy; a busy round runs with one
``while True: pass`` process per core (this process's CPU affinity) started before it and killed
after it, so load from other processes on the machine hits both kinds alike. With as many busy
processes as cores, a fair share is half the machine: a sample that takes about 2x is what
sharing costs, more is our own waste.

- ``contended_cpu_s_per_step_ratio``: the runtime's CPU-seconds (user + system, every process of
  its tree, the busy ones excluded) per training step, busy over quiet (target <= 1.3: threads
  that spin while they wait burn CPU that a loaded machine needs elsewhere).
- ``contended_sampling_slowdown``: warm sample seconds busy over quiet (target <= 2.5).
- ``contended_step_slowdown``: training step seconds busy over quiet.
- ``quiet_step_s``, ``busy_step_s``, ``quiet_sample_s``, ``busy_sample_s``, ``quiet_cpu_s_per_step``,
  ``busy_cpu_s_per_step``: the medians behind them.

``measure_contention(quick: bool) -> dict[str, float]`` returns these for a runtime as configured
by default (``RuntimeConfig.worker_threads``); quick: 2 rounds of each kind, 2 datums x 64 tokens
and 4 samples x 16 tokens (about 1.5-3 minutes on 2 cores); else 3 rounds, 8 x 128 and 8 x 32 (the
sizes of the issue's Tinker SDK script). ``--compare NAME:VAR=VALUE,...`` (repeatable) runs one
runtime per use instead, all up at once and taking rounds in turn, its workers started with those
environment variables (they inherit this process's), and prints ``NAME.figure: value``: e.g.
``--compare spin:GOMP_SPINCOUNT=300000`` (libgomp's default spin before it sleeps, the runtime's
behaviour before it set a wait policy) ``--compare one_thread:OMP_NUM_THREADS=1 --compare default``.
``--verbose`` prints every round on stderr.

Run: ``python benchmarks/contention.py [--quick] [--compare NAME:VAR=VALUE,... ...] [--verbose]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling _engine_runtime, however it is loaded

from _engine_runtime import _data  # random datums of the runtime section's shape

MODEL = "smollm2-135m-instruct"
KEY = "contention-benchmark-key-0123"
HOGS_PER_CORE = 1
VERBOSE = False  # --verbose: every round on stderr


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _runtime_cpu_s(runtime: Any) -> float:
    """User + system CPU-seconds of ``runtime``'s processes (its scheduler and workers, and their
    own children: a learner group's ranks). Each lives through the whole run, so differences are
    exact; the busy processes and any other runtime of this process are not counted."""
    import psutil

    roots = [ref.pid for ref in (runtime.scheduler, *runtime.workers.values()) if ref.pid is not None]
    total = 0.0
    for root in roots:
        try:
            process = psutil.Process(root)
            tree = [process, *process.children(recursive=True)]
        except psutil.Error:
            continue
        for p in tree:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
    return total


class _Hogs:
    """``count`` processes that spin on a core each until closed."""

    def __init__(self, count: int) -> None:
        self.procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(count)
        ]
        time.sleep(0.5)  # running before the round starts

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


class _Side:
    """One local runtime (its workers started with ``env`` in their environment) and its client."""

    def __init__(self, root: str, env: dict[str, str], batch: list[Any], sizes: tuple[int, int], model: str) -> None:
        from polytinker.client import ServiceClient
        from polytinker.scheduler.service import LocalRuntime, RuntimeConfig, TenantConfig

        config = RuntimeConfig(
            model=model, state_dir=root, tenants=(TenantConfig("bench", api_key=KEY),), start_timeout_s=300.0
        )
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the workers inherit this process's environment at spawn
        try:
            self.runtime = LocalRuntime(config).start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            self.service = ServiceClient(self.runtime.address, api_key=KEY)
            self.trainer = self.service.create_lora_training_client(model, rank=16)
            self.sampler = self.trainer.save_weights_and_get_sampling_client()
        except BaseException:
            self.runtime.stop()
            raise
        self.batch, self.sizes = batch, sizes
        self.rounds: dict[str, list[dict[str, float]]] = {"quiet": [], "busy": []}

    def round(self, hogs: int) -> dict[str, float]:
        """One training step and one sample; ``hogs``: the busy processes running (for --verbose)."""
        from polytinker.engine.learner.config import AdamParams
        from polytinker.engine.types import SamplingParams

        samples, new_tokens = self.sizes
        cpu0, t0 = _runtime_cpu_s(self.runtime), time.perf_counter()
        self.trainer.forward_backward(self.batch, "cross_entropy").result(timeout=900)
        tfb = time.perf_counter()
        self.trainer.optim_step(AdamParams(learning_rate=1e-5)).result(timeout=900)
        t1, cpu1 = time.perf_counter(), _runtime_cpu_s(self.runtime)
        params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True)
        prompt = [504, 3458, 282, 4649, 314, 253]  # six token ids of the model's vocabulary
        self.sampler.sample(prompt, num_samples=samples, sampling_params=params).result(timeout=900)
        t2 = time.perf_counter()
        out = {"step_s": t1 - t0, "cpu_s": cpu1 - cpu0, "sample_s": t2 - t1}
        if VERBOSE:
            print({**out, "fb_s": tfb - t0, "load": os.getloadavg()[0], "hogs": hogs}, file=sys.stderr, flush=True)
        return out

    def close(self) -> None:
        self.service.close()
        self.runtime.stop()

    def figures(self) -> dict[str, float]:
        med = {(kind, key): statistics.median(r[key] for r in rs) for kind, rs in self.rounds.items() for key in rs[0]}
        return {
            "contended_cpu_s_per_step_ratio": med["busy", "cpu_s"] / med["quiet", "cpu_s"],
            "contended_sampling_slowdown": med["busy", "sample_s"] / med["quiet", "sample_s"],
            "contended_step_slowdown": med["busy", "step_s"] / med["quiet", "step_s"],
            "quiet_step_s": med["quiet", "step_s"],
            "busy_step_s": med["busy", "step_s"],
            "quiet_sample_s": med["quiet", "sample_s"],
            "busy_sample_s": med["busy", "sample_s"],
            "quiet_cpu_s_per_step": med["quiet", "cpu_s"],
            "busy_cpu_s_per_step": med["busy", "cpu_s"],
        }


def compare(envs: dict[str, dict[str, str]], quick: bool = False, model: str = MODEL) -> dict[str, dict[str, float]]:
    """The figures of the module docstring for one local runtime per entry of ``envs`` (its
    workers' extra environment), all up at once; rounds alternate between them, quiet and busy, so
    other load on the machine hits each alike. Quick: 2 rounds of each kind at 2 datums x 64
    tokens and 4 samples x 16 tokens; else 3 rounds at 8 x 128 and 8 x 32. ``model``: another base
    model (the tests run this on a tiny one)."""
    rows, length, samples, new_tokens, rounds = (2, 64, 4, 16, 2) if quick else (8, 128, 8, 32, 3)
    batch = _data(0, rows, length)
    hogs = HOGS_PER_CORE * _cores()
    with tempfile.TemporaryDirectory(prefix="polytinker-contention-") as tmp:
        sides: dict[str, _Side] = {}
        try:
            for name, env in envs.items():
                sides[name] = _Side(str(Path(tmp) / name), env, batch, (samples, new_tokens), model)
            for side in sides.values():
                side.round(0)  # warm-up: optimizer state, the sampler's adapter loaded in the engine
            for _ in range(rounds):
                for side in sides.values():
                    side.rounds["quiet"].append(side.round(0))
                    busy = _Hogs(hogs)
                    try:
                        side.rounds["busy"].append(side.round(hogs))
                    finally:
                        busy.close()
        finally:
            for side in sides.values():
                side.close()
    return {name: side.figures() for name, side in sides.items()}


def measure_contention(quick: bool = False) -> dict[str, float]:
    """The figures of the module docstring for a local runtime as configured by default (its
    workers' threads: ``RuntimeConfig.worker_threads``); ``quick``: about 1.5-3 minutes on 2 cores."""
    return compare({"default": {}}, quick)["default"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller rounds: about 1.5-3 minutes on 2 cores")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME[:VAR=VALUE,...]",
        help="one runtime per use, its workers started with these environment variables (a table row each)",
    )
    parser.add_argument("--verbose", action="store_true", help="print every round on stderr")
    args = parser.parse_args(argv)
    global VERBOSE
    VERBOSE = args.verbose
    start = time.perf_counter()
    if not args.compare:
        for name, value in measure_contention(quick=args.quick).items():
            print(f"{name}: {value:.4g}")
    else:
        envs = {}
        for item in args.compare:
            name, _, assignments = item.partition(":")
            pairs = [a.split("=", 1) for a in assignments.split(",") if a]
            if not name or name in envs or any(len(p) != 2 or not p[0] for p in pairs):
                parser.error(f"--compare {item!r}: a new NAME, then :VAR=VALUE pairs separated by commas")
            envs[name] = dict(pairs)
        for name, figures in compare(envs, quick=args.quick).items():
            for key, value in figures.items():
                print(f"{name}.{key}: {value:.4g}")
    print(f"contention_wall_s: {time.perf_counter() - start:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
