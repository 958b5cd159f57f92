"""polytinker against SkyRL-tx: one Tinker SDK script, the same weights, one server at a time.

    make peer-venv                        # once: SkyRL-tx's Tinker API server in .venv-peer
    python benchmarks/peer.py --quick     # 1 measured round per phase
    python benchmarks/peer.py             # 3 measured rounds per phase

Each server in turn, alone on the machine, both with SmolLM2-135M-Instruct: (a) ``polytinker
serve --http`` with its default model ``smollm2-135m-instruct``, (b) SkyRL-tx's Tinker API server
(``python -m skyrl.tinker.api``, the JAX backend on the CPU, from ``.venv-peer``) pointed at the
directory polytinker built those weights into (``<cache>/models/smollm2-135m-instruct``). Each
client is the official ``tinker`` SDK with a LoRA run of its own (rank ``LORA_RANK``) and does, per
round: ``forward_backward`` of 8 datums of 128 tokens (``cross_entropy``) with ``optim_step``,
``save_weights_and_get_sampling_client``, then one ``sample`` of 8 sequences of 32 tokens from
those weights (``stop=[]``: nothing ends a sequence early, on either server). Two phases: 1 client,
then 4 concurrent clients (threads of one process, each its own ``ServiceClient``; a barrier
starts each half of a round together, the clients 5 ms apart). The first round of each phase warms
up (JAX compiles each new shape; polytinker loads its adapters) and is not counted. The clients of
both servers run in ``.venv-peer`` with its SDK (0.24.1: later releases post ``forward_backward``
as protobuf, which skyrl 0.3.0 cannot read), so both get the same client.

Figures: s per training step (``forward_backward`` + ``optim_step``, median over clients and
rounds), sampling tok/s (a round's tokens over the time from its first sample call to its last
answer, median over rounds) and the server's CPU-seconds per round (its whole process tree).
Prints ``name: value`` lines: ``peer_step_time_ratio`` (polytinker's s per step over SkyRL-tx's,
1 client; target <= 0.8), ``peer_sampling_ratio_1`` and ``peer_sampling_ratio_4`` (polytinker's
tok/s over SkyRL-tx's; targets >= 1.2 and >= 1.5), ``peer_step_time_ratio_4``, and each server's
raw figures (``polytinker_*``, ``skyrl_*``).

SkyRL-tx's API server starts its engine with ``uv run <its own uv flags> -m skyrl.tinker.engine``
and reads those flags from its parent's command line, so it runs under a stand-in ``uv`` (written
into the run's temporary directory) that starts ``-m ...`` with ``.venv-peer``'s python.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PEER_VENV = REPO / ".venv-peer"
MODEL = "smollm2-135m-instruct"
KEY = "tml-peer-benchmark-key-0123456789"
LORA_RANK = 16
N_DATUMS, DATUM_TOKENS = 8, 128
N_SAMPLES, SAMPLE_TOKENS = 8, 32
LEARNING_RATE = 1e-4
STAGGER_S = 0.005
START_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 900.0
# SkyRL-tx's JAX backend holds every adapter slot's LoRA weights at the largest rank: slot 0 is
# the base model's, then the 1 + 4 runs of the two phases. Its forward_backward runs in
# micro-batches of one client's datums, so that one compiled shape serves every mix of clients
# (by default each new batch size compiles anew, 100 s here, and a measured round can meet one).
# Sampling keeps its default: one batch of what is waiting.
SKYRL_BACKEND = {"max_lora_adapters": 8, "max_lora_rank": LORA_RANK, "train_micro_batch_size": N_DATUMS}

# Starts a server in a temporary directory: the process, its URL and the base model name to ask for.
Starter = Callable[[Path], tuple[subprocess.Popen[bytes], str, str]]

UV_SHIM = """#!{python}
# Stands in for `uv run [flags] -m MODULE ARGS...`: runs MODULE with this python and stays its
# parent (SkyRL-tx's API server reads its parent's command line to start its engine the same way).
import signal, subprocess, sys
args = sys.argv[1:]
child = subprocess.Popen([sys.executable, *args[args.index("-m"):]])
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, frame: child.send_signal(signum))
sys.exit(child.wait())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n" + log.read_text()[-3000:])
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"the server did not answer in {START_TIMEOUT_S:.0f} s:\n" + log.read_text()[-3000:])


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_polytinker(root: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """``polytinker serve --http`` with one tenant; returns the process, its URL and the base model."""
    port = _free_port()
    (root / "runtime.toml").write_text(
        f'model = "{MODEL}"\naddress = "tcp://127.0.0.1:{_free_port()}"\n'
        f'[[tenants]]\nname = "bench"\napi_key = "{KEY}"\n'
    )
    cmd = [sys.executable, "-m", "polytinker.cli", "serve", "--config", str(root / "runtime.toml")]
    cmd += ["--state-dir", str(root / "state"), "--http", f"127.0.0.1:{port}"]
    proc, url = _spawn(cmd, root / "serve.log"), f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, root / "serve.log")
    return proc, url, MODEL


def start_skyrl(root: Path, weights: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """SkyRL-tx's Tinker API server (JAX on the CPU) on ``weights``; its base model is that path."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "uv"
    shim.write_text(UV_SHIM.format(python=PEER_VENV / "bin" / "python"))
    shim.chmod(0o755)
    port = _free_port()
    cmd = [str(shim), "run", "-m", "skyrl.tinker.api", "--base-model", str(weights), "--backend", "jax"]
    cmd += ["--backend-config", json.dumps(SKYRL_BACKEND), "--checkpoints-base", str(root / "checkpoints")]
    cmd += ["--database-url", f"sqlite:///{root / 'tinker.db'}", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "JAX_PLATFORMS": "cpu"}
    proc, url = _spawn(cmd, root / "skyrl.log", env), f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, root / "skyrl.log")
    return proc, url, str(weights)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End the server and whatever it started (its own process group)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


class Client:
    """One SDK client with its own LoRA run: a round is a training step, new weights, a sample."""

    def __init__(self, url: str, base_model: str, prompt: list[int], seed: int) -> None:
        import tinker

        self.types = tinker.types
        self.service = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.trainer = self.service.create_lora_training_client(base_model=base_model, rank=LORA_RANK)
        rng = random.Random(seed)
        self.data = []
        for _ in range(N_DATUMS):
            tokens = [rng.randrange(100, 49_000) for _ in range(DATUM_TOKENS + 1)]
            # Lists, which the SDK turns into TensorData (its annotation names only the latter).
            inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * DATUM_TOKENS}
            self.data.append(
                self.types.Datum(model_input=self.types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
            )
        self.prompt = self.types.ModelInput.from_ints(prompt)

    def round(self, barrier: threading.Barrier, index: int, seed: int) -> dict[str, float]:
        barrier.wait()
        time.sleep(index * STAGGER_S)
        t0 = time.perf_counter()
        fb = self.trainer.forward_backward(self.data, "cross_entropy")
        opt = self.trainer.optim_step(self.types.AdamParams(learning_rate=LEARNING_RATE))
        fb.result(CALL_TIMEOUT_S)
        opt.result(CALL_TIMEOUT_S)
        t1 = time.perf_counter()
        sampler = self.trainer.save_weights_and_get_sampling_client()
        t2 = time.perf_counter()
        barrier.wait()
        time.sleep(index * STAGGER_S)
        params = self.types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=seed, stop=[])
        t3 = time.perf_counter()
        out = sampler.sample(self.prompt, N_SAMPLES, params).result(CALL_TIMEOUT_S)
        t4 = time.perf_counter()
        tokens = sum(len(s.tokens) for s in out.sequences)
        return {"step_s": t1 - t0, "save_s": t2 - t1, "sample_t0": t3, "sample_t1": t4, "tokens": tokens}


def server_cpu_s(server: Any) -> float:
    """CPU-seconds (user + system) the server (a ``psutil.Process``) and its children have used so far."""
    import psutil

    total = 0.0
    for p in [server, *server.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def phase(clients: list[Client], rounds: int, cpu_s: Callable[[], float]) -> dict[str, float]:
    """``rounds`` + 1 rounds of every client at once; the first is a warm-up, left out."""
    barrier = threading.Barrier(len(clients))
    results: list[list[dict[str, float]]] = [[] for _ in clients]
    errors: list[BaseException] = []
    cpu_marks: list[float] = []

    def run(i: int) -> None:
        try:
            for r in range(rounds + 1):
                if r == 1:  # the warm-up is over: read the server's CPU time before any call of the rest
                    barrier.wait()
                    if i == 0:
                        cpu_marks.append(cpu_s())
                results[i].append(clients[i].round(barrier, i, seed=1000 * r + i))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    cpu_marks.append(cpu_s())
    measured = [[per[r] for per in results] for r in range(1, rounds + 1)]
    tok_s = [
        sum(c["tokens"] for c in rnd) / (max(c["sample_t1"] for c in rnd) - min(c["sample_t0"] for c in rnd))
        for rnd in measured
    ]
    return {
        "step_s": statistics.median(c["step_s"] for rnd in measured for c in rnd),
        "save_s": statistics.median(c["save_s"] for rnd in measured for c in rnd),
        "sampling_tok_s": statistics.median(tok_s),
        "sample_tokens": statistics.median(c["tokens"] for rnd in measured for c in rnd),
        "server_cpu_s_per_round": (cpu_marks[-1] - cpu_marks[0]) / rounds,
    }


def client_phase(spec: dict[str, Any]) -> dict[str, float]:
    """One phase in this process (``.venv-peer``'s python): ``spec["clients"]`` SDK clients."""
    import psutil

    server = psutil.Process(spec["server_pid"])
    clients = [Client(spec["url"], spec["base_model"], spec["prompt"], seed=i) for i in range(spec["clients"])]
    return phase(clients, spec["rounds"], functools.partial(server_cpu_s, server))


def run_phase(spec: dict[str, Any]) -> dict[str, float]:
    """``client_phase`` in a child process with ``.venv-peer``'s python and SDK, for either server."""
    cmd = [str(PEER_VENV / "bin" / "python"), str(Path(__file__).resolve()), "--client-phase", json.dumps(spec)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the clients failed ({done.returncode}); their output is above")
    return dict(json.loads(done.stdout.splitlines()[-1]))


def measure(start: Starter, prompt: list[int], rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="polytinker-bench-peer-") as tmp:
        t0 = time.perf_counter()
        proc, url, base_model = start(Path(tmp))
        figures = {"start_s": time.perf_counter() - t0}
        spec = {"url": url, "base_model": base_model, "prompt": prompt, "rounds": rounds, "server_pid": proc.pid}
        try:
            for n in (1, 4):
                figures.update({f"{k}_{n}": v for k, v in run_phase({**spec, "clients": n}).items()})
        finally:
            stop(proc)
    return figures


def prompt_tokens() -> list[int]:
    from polytinker.engine.models import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def report(ours: dict[str, float], peer: dict[str, float]) -> dict[str, float]:
    figures = {
        "peer_step_time_ratio": ours["step_s_1"] / peer["step_s_1"],
        "peer_sampling_ratio_1": ours["sampling_tok_s_1"] / peer["sampling_tok_s_1"],
        "peer_sampling_ratio_4": ours["sampling_tok_s_4"] / peer["sampling_tok_s_4"],
        "peer_step_time_ratio_4": ours["step_s_4"] / peer["step_s_4"],
    }
    for side, values in (("polytinker", ours), ("skyrl", peer)):
        figures.update({f"{side}_{k}": v for k, v in values.items()})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 measured round per phase")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per phase (after one warm-up)")
    parser.add_argument(
        "--first", choices=("polytinker", "skyrl"), default="polytinker", help="which server runs first"
    )
    parser.add_argument("--save", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--client-phase", help=argparse.SUPPRESS)  # JSON: one phase's clients, in .venv-peer
    args = parser.parse_args()
    if args.client_phase:
        print(json.dumps(client_phase(json.loads(args.client_phase))))
        return
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rounds = 1 if args.quick else args.rounds
    if not (PEER_VENV / ".installed").is_file():
        print(f"SkyRL-tx's environment {PEER_VENV} is missing: build it with `make peer-venv`", file=sys.stderr)
        raise SystemExit(2)

    from polytinker.engine.models import resolve_model

    weights = resolve_model(MODEL)
    prompt = prompt_tokens()
    sides: dict[str, Starter] = {
        "polytinker": start_polytinker,
        "skyrl": lambda root: start_skyrl(root, weights),
    }
    order = [args.first, *(s for s in sides if s != args.first)]
    results = {}
    for name in order:
        print(f"# {name}: {rounds} measured rounds per phase", file=sys.stderr, flush=True)
        results[name] = measure(sides[name], prompt, rounds)
    figures = report(results["polytinker"], results["skyrl"])
    for name, value in figures.items():
        print(f"{name}: {value:.3f}")
    if args.save:
        args.save.write_text(json.dumps({"prompt_tokens": len(prompt), **figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
