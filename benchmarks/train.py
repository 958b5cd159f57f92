"""Training benchmark: polytinker's GRPO against TRL's ``GRPOTrainer`` on the same task and machine.

    python benchmarks/train.py --quick      # a few steps each (the figures are rough)
    python benchmarks/train.py              # 30 steps each: the figures of docs/benchmarks.md

Model SmolLM2-135M-Instruct in fp32, LoRA r=16 / alpha=32 on q,k,v,o,gate,up,down, 2 torch threads.
Task: the prompt "Pick a number from 1 to 10. Answer with just the number." with the chat template;
reward 1.0 for 7, else max(0, 0.5 - 0.1*|n-7|), 0 when no number. 8 completions per step in one
group, at most 16 new tokens, learning rate 5e-4, no KL term (TRL: ``beta=0``, its other defaults).

Printed (``name: value``):

- ``step_time_ratio``: median seconds per step, ours / TRL (target <= 0.7), with both medians and
  the mean completion tokens per step of each (equal settings: 8 x up to 16 new tokens);
- ``steps_to_reward_0_9_ours`` / ``_trl``: the first step whose mean reward is >= 0.9;
- ``multi_agent_memory_ratio``: 4 agents, each its own adapter on one shared base in one local
  runtime, against 4 separate TRL processes each with its own model doing the same work: sum of
  the per-process RSS peaks (psutil, the whole process tree) (target <= 0.4);
- ``multi_agent_throughput_ratio``: agent steps per second, the same two set-ups (target >= 1.5).
  The separate processes get ``max(1, threads // 4)`` threads each: the same machine either way;
- ``ours_*_s``: where our step's time goes (sample, forward_backward, optim_step, weight sync).

Our side is ``benchmarks/_train_ours.py`` (the client API against a local runtime); TRL's is
``benchmarks/_trl_grpo.py``, run with the interpreter of ``benchmarks/.venv-trl``, which this
script builds on first use (``torch==2.13.0`` first, then ``trl==1.16.0``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _train_task import first_reaching  # noqa: E402  (the benchmark's own directory is not a package)

TRL_VENV = HERE / ".venv-trl"
TRL_PINS = ("trl==1.16.0", "transformers<5.20", "peft")
N_AGENTS = 4


def log(msg: str) -> None:
    print(f"[train.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- TRL's environment -------------------------------------------------------------------------------
def trl_python() -> Path:
    """The interpreter of TRL's own environment, built on first use (its pins may conflict with ours)."""
    python = TRL_VENV / "bin" / "python"
    marker = TRL_VENV / ".installed"
    if python.exists() and marker.exists():
        return python
    log(f"building TRL's environment in {TRL_VENV} (once)")
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    # torch==2.13.0 first: the CPU build; a looser spec lets pip pull a multi-GB CUDA build.
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, *TRL_PINS], check=True)
    marker.touch()
    return python


# --- running processes and watching their memory -------------------------------------------------
@dataclass
class Run:
    """What one or more benchmark processes printed, and the peak RSS of every process in their trees."""

    records: list[dict[str, Any]] = field(default_factory=list)
    peak_rss_by_pid: dict[int, int] = field(default_factory=dict)
    # An actor process's name (the stem of its ``actors/<name>.log``), "main" for a started command.
    label_by_pid: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def peak_mib(self) -> float:
        """Sum of per-process RSS peaks, MiB."""
        return sum(self.peak_rss_by_pid.values()) / 2**20

    def peak_mib_by_label(self) -> dict[str, float]:
        """Per-process RSS peaks summed by label (a process not yet labelled counts as "other")."""
        out: dict[str, float] = {}
        for pid, rss in self.peak_rss_by_pid.items():
            label = self.label_by_pid.get(pid, "other")
            out[label] = out.get(label, 0.0) + rss / 2**20
        return out

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "step" in r]


def _label(proc: Any, roots: list[Any]) -> str | None:
    """The label of a process: "main" for a started command, an actor's name once its log is open."""
    import psutil

    if proc in roots:
        return "main"
    try:
        logs = [Path(f.path).name for f in proc.open_files() if "/actors/" in f.path and f.path.endswith(".log")]
    except psutil.Error:
        return None
    return logs[0].split(".")[0] if logs else None


def _watch(
    roots: list[Any], peaks: dict[int, int], stop: threading.Event, labels: dict[int, str], period_s: float = 0.1
) -> None:
    import psutil

    while not stop.is_set():
        for root in roots:
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                if rss > peaks.get(p.pid, 0):
                    peaks[p.pid] = rss
                if p.pid not in labels and (label := _label(p, roots)) is not None:
                    labels[p.pid] = label
        stop.wait(period_s)


def run_processes(commands: list[list[str]], env: dict[str, str], timeout_s: float) -> Run:
    """Start every command at once, collect their JSON lines, and track the RSS peak of each process."""
    import psutil

    run = Run()
    t0 = time.monotonic()
    popens = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE.parent)
        for cmd in commands
    ]
    roots = [psutil.Process(p.pid) for p in popens]
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(roots, run.peak_rss_by_pid, stop, run.label_by_pid), daemon=True)
    watcher.start()
    stderr: list[str] = ["" for _ in popens]

    def drain(i: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None and p.stderr is not None
        for line in p.stdout:
            if line.startswith("{"):
                try:
                    run.records.append(json.loads(line))
                except ValueError:  # a library's own printout (TRL prints its log dicts)
                    continue
        stderr[i] = p.stderr.read()

    readers = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(popens)]
    for r in readers:
        r.start()
    try:
        for p in popens:
            p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"benchmark processes ran past {timeout_s:.0f} s: {commands}") from None
    finally:
        for p in popens:
            if p.poll() is None:  # SIGINT: our side's ServiceClient then stops its local runtime
                p.send_signal(signal.SIGINT)
        for p in popens:
            try:
                p.wait(timeout=20.0)
            except subprocess.TimeoutExpired:
                p.terminate()
        stop.set()
        watcher.join()
        for r in readers:
            r.join(10.0)
    run.wall_s = time.monotonic() - t0
    for cmd, p, err in zip(commands, popens, stderr, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited with {p.returncode}:\n{err[-4000:]}")
    return run


# --- figures --------------------------------------------------------------------------------------
def median_of(steps: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in steps) if steps else float("nan")


def reward_curve(steps: list[dict[str, Any]]) -> list[float]:
    """Mean reward per step, averaged over agents when several ran."""
    by_step: dict[int, list[float]] = {}
    for s in steps:
        by_step.setdefault(int(s["step"]), []).append(float(s["reward_mean"]))
    return [statistics.fmean(by_step[k]) for k in sorted(by_step)]


def agent_steps_per_s(steps: list[dict[str, Any]]) -> float:
    """Agent steps finished per second of wall time, from the first step's start to the last step's end."""
    if not steps:
        return float("nan")
    span = max(s["t_end"] for s in steps) - min(s["t_start"] for s in steps)
    return len(steps) / span if span > 0 else float("nan")


def tokens_per_s(steps: list[dict[str, Any]]) -> float:
    if not steps:
        return float("nan")
    span = max(s["t_end"] for s in steps) - min(s["t_start"] for s in steps)
    return sum(s["completion_tokens"] for s in steps) / span if span > 0 else float("nan")


def reached(curve: list[float]) -> str:
    step = first_reaching(curve, 0.9)
    return str(step) if step is not None else f"not reached in {len(curve)} steps"


def fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def figures(single_ours: Run, single_trl: Run, multi_ours: Run, multi_trl: Run) -> list[tuple[str, str]]:
    ours, trl = single_ours.steps(), single_trl.steps()
    ours_s, trl_s = median_of(ours, "step_s"), median_of(trl, "step_s")
    m_ours, m_trl = multi_ours.steps(), multi_trl.steps()
    thr_ours, thr_trl = agent_steps_per_s(m_ours), agent_steps_per_s(m_trl)
    out = [
        ("step_time_ratio", fmt(ours_s / trl_s)),
        ("steps_to_reward_0_9_ours", reached(reward_curve(ours))),
        ("steps_to_reward_0_9_trl", reached(reward_curve(trl))),
        ("multi_agent_memory_ratio", fmt(multi_ours.peak_mib / multi_trl.peak_mib)),
        ("multi_agent_throughput_ratio", fmt(thr_ours / thr_trl)),
        ("ours_s_per_step", fmt(ours_s, 2)),
        ("trl_s_per_step", fmt(trl_s, 2)),
        ("ours_tokens_per_step", fmt(statistics.fmean(s["completion_tokens"] for s in ours), 1)),
        ("trl_tokens_per_step", fmt(statistics.fmean(s["completion_tokens"] for s in trl), 1)),
        ("ours_steps", str(len(ours))),
        ("trl_steps", str(len(trl))),
        ("ours_final_reward", fmt(reward_curve(ours)[-1])),
        ("trl_final_reward", fmt(reward_curve(trl)[-1])),
    ]
    for phase in ("sample", "forward_backward", "optim_step", "weight_sync"):
        out.append((f"ours_{phase}_s", fmt(median_of(ours, f"{phase}_s"), 2)))
    out += [
        ("multi_agent_ours_peak_mib", fmt(multi_ours.peak_mib, 0)),
        ("multi_agent_ours_processes", str(len(multi_ours.peak_rss_by_pid))),
        ("multi_agent_separate_peak_mib", fmt(multi_trl.peak_mib, 0)),
        ("multi_agent_separate_processes", str(len(multi_trl.peak_rss_by_pid))),
        ("multi_agent_ours_agent_steps_per_s", fmt(thr_ours, 4)),
        ("multi_agent_separate_agent_steps_per_s", fmt(thr_trl, 4)),
        ("multi_agent_ours_tokens_per_s", fmt(tokens_per_s(m_ours), 1)),
        ("multi_agent_separate_tokens_per_s", fmt(tokens_per_s(m_trl), 1)),
        ("multi_agent_ours_s_per_agent_step", fmt(median_of(m_ours, "step_s"), 2)),
        ("multi_agent_separate_s_per_agent_step", fmt(median_of(m_trl, "step_s"), 2)),
    ]
    return out


# --- the benchmark --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps single-agent, 1 per agent multi-agent")
    parser.add_argument("--steps", type=int, default=None, help="single-agent steps of each side (default 30)")
    parser.add_argument("--multi-steps", type=int, default=None, help="steps per agent, multi-agent (default 8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--timeout-s", type=float, default=7200.0, help="per phase")
    parser.add_argument("--save", default="", help="write every record of the four runs to this JSON file")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up of the child processes
    steps = args.steps or (3 if args.quick else 30)
    multi_steps = args.multi_steps or (1 if args.quick else 8)

    from polytinker.engine.models import resolve_model

    model_dir = str(resolve_model(args.model))
    trl = str(trl_python())
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    py, ours_script, trl_script = sys.executable, str(HERE / "_train_ours.py"), str(HERE / "_trl_grpo.py")
    common = ["--threads", str(args.threads)]
    t0 = time.monotonic()
    log(f"ours, 1 agent, {steps} steps")
    single_ours = run_processes(
        [[py, ours_script, "--model", model_dir, "--steps", str(steps), *common]], env, args.timeout_s
    )
    log(f"TRL, {steps} steps")
    single_trl = run_processes([[trl, trl_script, model_dir, "--steps", str(steps), *common]], env, args.timeout_s)
    log(f"ours, {N_AGENTS} agents on one runtime, {multi_steps} steps each")
    multi_cmd = [py, ours_script, "--model", model_dir, "--steps", str(multi_steps), "--agents", str(N_AGENTS), *common]
    multi_ours = run_processes([multi_cmd], env, args.timeout_s)
    separate_threads = max(1, args.threads // N_AGENTS)
    log(f"TRL, {N_AGENTS} separate processes ({separate_threads} thread each), {multi_steps} steps each")
    sep_env = {**env, "OMP_NUM_THREADS": str(separate_threads)}
    sep_cmds = [
        [
            trl,
            trl_script,
            model_dir,
            "--steps",
            str(multi_steps),
            "--threads",
            str(separate_threads),
            "--tag",
            f"trl{i}",
        ]
        for i in range(N_AGENTS)
    ]
    multi_trl = run_processes(sep_cmds, sep_env, args.timeout_s)

    for name, value in figures(single_ours, single_trl, multi_ours, multi_trl):
        print(f"{name}: {value}")
    print(f"bench_wall_s: {time.monotonic() - t0:.0f}")
    print(f"load_average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.save:
        runs = {"single_ours": single_ours, "single_trl": single_trl, "multi_ours": multi_ours, "multi_trl": multi_trl}
        dump = {
            k: {"records": r.records, "peak_mib": r.peak_mib, "peak_mib_by_pid": r.peak_rss_by_pid, "wall_s": r.wall_s}
            for k, r in runs.items()
        }
        Path(args.save).write_text(json.dumps(dump, indent=1, default=str))


if __name__ == "__main__":
    main()
