"""Soak: two well-behaved tenants' SDK calls next to a hostile tenant, on saturated cores.

    python benchmarks/soak.py --quick        # 2 clients per good tenant, 20 s of soak
    python benchmarks/soak.py                # 4 clients per good tenant, 60 s of soak

One ``polytinker serve --http`` (tiny-random model) serves three tenants: ``good-a``, ``good-b``
and ``hostile``. For the measured phases every core runs a busy Python loop in a child process.

- Latency alone: ``good-a`` samples 4 tokens of a 5-token prompt from the base model, one call
  after another; the median is ``latency_alone_s``. This probe runs in a process of its own, as
  a tenant's client would: sharing an interpreter with the good tenants' SDK loops, a probe
  waited 61-156 ms for their event loop and the ratio measured this script's own process.
- Soak: K threads per good tenant, each with its own LoRA run, loop an RL step's calls through
  the tinker SDK, each bounded by a timeout: sample (4 tokens from the run's newest saved
  weights), forward_backward (2 datums of 8 tokens, cross entropy), optim_step, and
  save_weights_and_get_sampling_client. Meanwhile the hostile tenant, in a process of its own,
  keeps two samples of 1024 sequences of 64 tokens in flight (the hog) and loops bad inputs
  through the SDK and raw HTTP (token ids 10**6 and -5 in prompts and datums, NaN advantages,
  infinite learning rate and max_tokens, NaN temperature, wrong JSON types, truncated and deeply
  nested JSON, a body over the size cap), ignoring every error. The latency probe runs once in
  that soak (``latency_in_soak_without_hog_s``); then the hostile tenant starts the hog and the
  probe runs again once a hog request is in flight (``latency_with_hog_s``: the probes started
  while one was).

Prints ``name: value`` lines: ``failed_calls`` (the good tenants' calls that raised, target 0),
``good_tenant_p99_s``, ``fairness_ratio`` (the good tenants' successful calls per second,
min/max, target >= 0.8), ``hog_delay_ratio`` (``latency_with_hog_s / latency_alone_s``, target
<= 3), ``hog_only_delay_ratio`` (``latency_with_hog_s / latency_in_soak_without_hog_s``: the hog's
own share of that delay, the good tenants' load being the same on both sides),
``hog_samples_per_s`` (the sequences the engine answered during the soak, less the good tenants'
samples, per second: the hog's throughput), the hostile tenant's outcomes and the raw inputs.
What failed, and how, goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "tiny-random"
KEYS = {
    "good-a": "tml-soak-good-a-key-0123456789",
    "good-b": "tml-soak-good-b-key-0123456789",
    "hostile": "tml-soak-hostile-key-012345678",
}
GOOD = ("good-a", "good-b")
PROMPT = [1, 2, 3, 4, 5]
MAX_BODY_BYTES = 1 << 20  # the cap the oversized body crosses; a good batch is a few hundred bytes
HOG_SAMPLES, HOG_TOKENS, HOG_IN_FLIGHT = 1024, 64, 2
START_TIMEOUT_S = 180.0
PROBE_PAUSE_S = 0.2


@dataclass
class Budget:
    clients: int  # threads per good tenant
    soak_s: float
    probes: int
    call_timeout_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _runtime_toml() -> str:
    tenants = "".join(f'[[tenants]]\nname = "{name}"\napi_key = "{key}"\n' for name, key in KEYS.items())
    return (
        f'model = "{MODEL}"\naddress = "tcp://127.0.0.1:{_free_port()}"\n{tenants}'
        # Every good thread and the hostile tenant hold a live run: a slot each, none waiting.
        "[[engines]]\nadapter_slots = 16\n"
        f"[http]\nmax_body_bytes = {MAX_BODY_BYTES}\n"
    )


def start_serve(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    (root / "runtime.toml").write_text(_runtime_toml())
    url = f"http://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "polytinker.cli", "serve", "--config", str(root / "runtime.toml")]
    cmd += ["--state-dir", str(root / "state"), "--http", url.removeprefix("http://")]
    # Engine and learner run at once here: one torch thread each, as docs/scheduler-service.md
    # advises for workers sharing a machine (OpenMP threads on busy cores wait for each other).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(root / "serve.log", "wb") as log:
        # Its own process group, so that a serve that ignores SIGTERM goes with its workers.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("serve exited: " + (root / "serve.log").read_text()[-2000:])
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return proc, url
        time.sleep(0.5)
    stop_serve(proc)
    raise SystemExit(f"serve did not answer within {START_TIMEOUT_S:.0f} s")


def engine_sequences(root: Path) -> tuple[float, int]:
    """(now, the sequences the engines have answered so far, every tenant's), from the
    scheduler's ``runtime_status`` (each engine's ``sequences``)."""
    import tomllib

    from polytinker import ServiceClient

    address = tomllib.loads((root / "runtime.toml").read_text())["address"]
    with ServiceClient(address, api_key=KEYS["good-a"]) as service:
        stats = service.runtime_status()["stats"]
    return time.monotonic(), sum(int(s.get("sequences", 0)) for s in stats.values())


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
            return
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


# A pure Python busy loop that ends once its parent is gone, so that a benchmark killed before
# its cleanup (SIGKILL, a test's timeout) leaves no core spinning.
BUSY_LOOP = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


def start_busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(10)


@dataclass
class Tally:
    """The good tenants' calls: successes per tenant, every latency, and each failure."""

    ok: Counter[str] = field(default_factory=Counter)
    latencies: list[tuple[str, float]] = field(default_factory=list)  # (call, seconds)
    failures: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, tenant: str, call: str, fn: Callable[[], Any]) -> float | None:
        """``fn()``'s latency, None when it raised."""
        t0 = time.monotonic()
        try:
            fn()
        except Exception as exc:
            with self.lock:
                self.failures[f"{tenant} {call} {type(exc).__name__}: {str(exc)[:300]}"] += 1
            return None
        dt = time.monotonic() - t0
        with self.lock:
            self.ok[tenant] += 1
            self.latencies.append((call, dt))
        return dt


@dataclass
class Hostile:
    """What the hostile tenant's requests came to: ``refused_4xx`` at the door, ``failed_later``
    as the caller's fault, ``accepted``, or ``other`` (a 5xx, a timeout, a dropped connection);
    and the hog's ``hog_done`` or ``hog_failed``. ``details`` says what, for all but the expected."""

    outcomes: Counter[str] = field(default_factory=Counter)
    details: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, what: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome not in ("refused_4xx", "hog_done"):
                self.details[f"{outcome}: {what}: {detail}"[:300]] += 1


def _types() -> Any:
    from tinker import types

    return types


def sampling_params(max_tokens: int, seed: int | None = None) -> Any:
    # stop=[]: not even EOS stops a sample, so every call of a kind does the same work.
    return _types().SamplingParams(max_tokens=max_tokens, stop=[], seed=seed)


def datum(tokens: list[int], **inputs: list[Any]) -> Any:
    types = _types()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs}
    )


@dataclass
class Client:
    """One good thread's own LoRA run and a sampler of its saved weights."""

    tenant: str
    trainer: Any
    sampler: Any


def make_client(service: Any, tenant: str, timeout_s: float) -> Client:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=8).result(timeout_s)
    return Client(tenant, trainer, trainer.save_weights_and_get_sampling_client().result(timeout_s))


def good_loop(c: Client, tally: Tally, deadline: float, timeout_s: float) -> None:
    """An RL loop's calls, each timed: sample, forward_backward, optim_step, then new weights to
    the sampler (the run keeps only its last few versions, so a loop samples its newest)."""
    types = _types()
    prompt = types.ModelInput.from_ints(PROMPT)
    batch = [datum(list(range(10 + i, 19 + i)), weights=[1.0] * 8) for i in range(2)]

    def new_sampler() -> None:
        c.sampler = c.trainer.save_weights_and_get_sampling_client().result(timeout_s)

    calls: list[tuple[str, Callable[[], Any]]] = [
        ("sample", lambda: c.sampler.sample(prompt, 1, sampling_params(4)).result(timeout_s)),
        ("forward_backward", lambda: c.trainer.forward_backward(batch, "cross_entropy").result(timeout_s)),
        ("optim_step", lambda: c.trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout_s)),
        ("save_weights_for_sampler", new_sampler),
    ]
    while True:
        for name, call in calls:
            if time.monotonic() >= deadline:
                return
            tally.timed(c.tenant, name, call)


def probe(
    sampler: Any,
    tally: Tally,
    n: int,
    timeout_s: float,
    during: Callable[[], bool] = lambda: True,
    until: float = math.inf,
) -> list[float]:
    """Up to ``n`` small samples one after another (none started at ``until`` or later); the
    latencies of those that succeeded and started while ``during()`` held."""
    prompt = _types().ModelInput.from_ints(PROMPT)
    out: list[float] = []
    for i in range(n):
        if time.monotonic() >= until:
            break
        held = during()
        params = sampling_params(4, seed=i)
        dt = tally.timed("good-a", "probe sample", lambda p=params: sampler.sample(prompt, 1, p).result(timeout_s))
        if dt is not None and held:
            out.append(dt)
        time.sleep(PROBE_PAUSE_S)
    return out


def classify(exc: BaseException) -> tuple[str, str]:
    """A hostile SDK call's error: refused at the door (a 4xx), failed later as the caller's fault
    (the SDK's ``RequestFailedError`` of category ``user``), or anything else."""
    import tinker

    detail = f"{type(exc).__name__}: {str(exc)[:200]}"
    if isinstance(exc, tinker.APIStatusError) and 400 <= exc.status_code < 500:
        return "refused_4xx", detail
    if isinstance(exc, tinker.RequestFailedError) and str(exc.category) == "user":
        return "failed_later", detail
    return "other", detail


def _chunks(tokens: list[int]) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": tokens}]}


def raw_requests(model_id: str) -> list[tuple[str, str, bytes, str]]:
    """The hostile tenant's malformed bodies: (name, route, body, content type)."""

    def sample(**changes: Any) -> dict[str, Any]:
        body = {"base_model": MODEL, "num_samples": 1, "prompt": _chunks(PROMPT), "sampling_params": {"max_tokens": 4}}
        return {**body, **changes}

    js = "application/json"
    bodies: list[tuple[str, str, Any]] = [
        ("token 10**6 in a prompt", "asample", sample(prompt=_chunks([1, 10**6]))),
        ("token -5 in a prompt", "asample", sample(prompt=_chunks([-5, 2]))),
        ("max_tokens=inf", "asample", sample(sampling_params={"max_tokens": math.inf})),
        ("temperature=nan", "asample", sample(sampling_params={"max_tokens": 4, "temperature": math.nan})),
        ("num_samples as text", "asample", sample(num_samples="1024")),
        ("prompt as text", "asample", sample(prompt="hello")),
        ("learning_rate=inf", "optim_step", {"model_id": model_id, "adam_params": {"learning_rate": math.inf}}),
        ("model_id as a number", "optim_step", {"model_id": 12345, "adam_params": {"learning_rate": 1e-4}}),
        ("rank as text", "create_model", {"base_model": MODEL, "lora_config": {"rank": "big"}}),
        ("forward_backward as JSON", "forward_backward", {"model_id": model_id, "data": [[1, 2]]}),
    ]
    out = [(name, route, json.dumps(body).encode(), js) for name, route, body in bodies]  # NaN/inf as JSON allows
    out.append(("truncated JSON", "asample", b'{"num_samples": ', js))
    out.append(("JSON nested 100000 deep", "asample", b"[" * 100_000 + b"]" * 100_000, js))
    out.append(("body over the cap", "asample", b" " * (MAX_BODY_BYTES + 1) + b"{}", js))
    return out


def raw_loop(url: str, model_id: str, hostile: Hostile, stop: threading.Event, timeout_s: float) -> None:
    import httpx

    requests = raw_requests(model_id)
    with httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEYS["hostile"]}, timeout=timeout_s) as http:
        while not stop.is_set():
            for name, route, body, content_type in requests:
                try:
                    r = http.post(f"/{route}", content=body, headers={"content-type": content_type})
                except httpx.HTTPError as exc:
                    hostile.note(name, "other", f"{type(exc).__name__}: {exc}")
                    continue
                if 400 <= r.status_code < 500:
                    hostile.note(name, "refused_4xx")
                else:
                    hostile.note(
                        name, "accepted" if r.status_code < 300 else "other", f"{r.status_code} {r.text[:200]}"
                    )


def sdk_bad_calls(trainer: Any, sampler: Any) -> list[tuple[str, Callable[[], Any]]]:
    """The hostile tenant's bad inputs that the SDK sends as they are."""
    types = _types()
    ids = list(range(10, 19))
    nan_rl = dict(logprobs=[0.0] * 8, advantages=[math.nan] * 8)

    def fb(tokens: list[int], loss: str = "cross_entropy", **inputs: list[Any]) -> Callable[[], Any]:
        return lambda: trainer.forward_backward([datum(tokens, **inputs)], loss)

    def sample(tokens: list[int]) -> Callable[[], Any]:
        return lambda: sampler.sample(types.ModelInput.from_ints(tokens), 1, sampling_params(4))

    return [
        ("sdk: token 10**6 in a prompt", sample([1, 10**6, 2])),
        ("sdk: token -5 in a prompt", sample([1, -5, 2])),
        ("sdk: token 10**6 in a datum", fb([*ids[:4], 10**6, *ids[5:]])),
        ("sdk: token -5 in a datum", fb([*ids[:4], -5, *ids[5:]])),
        ("sdk: NaN advantages", fb(ids, "importance_sampling", **nan_rl)),
    ]


def sdk_bad_loop(trainer: Any, sampler: Any, hostile: Hostile, stop: threading.Event, timeout_s: float) -> None:
    calls = sdk_bad_calls(trainer, sampler)
    while not stop.is_set():
        for name, call in calls:
            try:
                call().result(timeout_s)
            except Exception as exc:
                hostile.note(name, *classify(exc))
            else:
                hostile.note(name, "accepted")


def hog_loop(sampler: Any, hostile: Hostile, stop: threading.Event, busy: Any, hog_go: Any) -> None:
    """From ``hog_go`` on, keep HOG_IN_FLIGHT samples of HOG_SAMPLES x HOG_TOKENS in flight until
    ``stop``; ``busy`` (an event shared with the main process) is set while one is."""
    prompt = _types().ModelInput.from_ints(PROMPT)
    pending: list[Any] = []
    while not hog_go.wait(0.1):
        if stop.is_set():
            return

    def done(f: Any) -> None:
        if f.cancelled():
            return
        exc = f.exception()
        if exc is None:
            hostile.note("hog", "hog_done")
        else:
            hostile.note("hog", "hog_failed", classify(exc)[1])

    while not stop.is_set():
        pending = [f for f in pending if not f.done()]
        while len(pending) < HOG_IN_FLIGHT:
            f = sampler.sample(prompt, HOG_SAMPLES, sampling_params(HOG_TOKENS)).future()
            f.add_done_callback(done)
            pending.append(f)
        busy.set()
        stop.wait(0.1)
    busy.clear()
    for f in pending:
        f.cancel()  # the SDK cancels the call itself too


def hostile_main(
    url: str, soak_s: float, timeout_s: float, ready: Any, go: Any, busy: Any, hog_go: Any, conn: Any
) -> None:
    """The hostile tenant, in a process of its own (as another client would be: its loops do not
    take the good clients' interpreter lock); its counts go back through ``conn``."""
    import logging

    import tinker

    # The SDK logs every refusal; here they are the point, and counted.
    logging.getLogger("tinker").setLevel(logging.CRITICAL)
    service = tinker.ServiceClient(base_url=url, api_key=KEYS["hostile"])
    trainer = service.create_lora_training_client(base_model=MODEL, rank=8).result(timeout_s)
    sampler = service.create_sampling_client(base_model=MODEL).result(timeout_s)
    ready.set()
    hostile, stop = Hostile(), threading.Event()
    if go.wait(START_TIMEOUT_S):
        loops = [
            (hog_loop, (sampler, hostile, stop, busy, hog_go)),
            (sdk_bad_loop, (trainer, sampler, hostile, stop, timeout_s)),
            (raw_loop, (url, str(trainer.model_id), hostile, stop, timeout_s)),
        ]
        threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in loops]
        for t in threads:
            t.start()
        stop.wait(soak_s)
        stop.set()
        for t in threads:
            t.join(timeout_s)
    conn.send({"outcomes": dict(hostile.outcomes), "details": dict(hostile.details)})
    conn.close()
    os._exit(0)  # the SDK's threads may still wait on calls that serve will never answer


def _probe_result(tally: Tally, latencies: list[float]) -> dict[str, Any]:
    return {"latencies": latencies, "ok": [dt for _, dt in tally.latencies], "failures": dict(tally.failures)}


def probe_main(url: str, budget: Budget, busy: Any, conn: Any) -> None:
    """``good-a``'s latency probe in a process of its own. Commands through ``conn``: ``("now",)``
    probes now; ``("with_hog", seconds)`` probes once the hog is in flight, for at most ``seconds``;
    each answers ``_probe_result``. ``None`` ends it."""
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=KEYS["good-a"])
    sampler = service.create_sampling_client(base_model=MODEL).result(budget.call_timeout_s)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        tally, latencies = Tally(), []
        if command[0] == "now":
            latencies = probe(sampler, tally, budget.probes, budget.call_timeout_s)
        elif busy.wait(command[1] / 2):
            deadline = time.monotonic() + command[1]
            time.sleep(1.0)  # the hog's first batches reach the engine
            latencies = probe(sampler, tally, budget.probes, budget.call_timeout_s, busy.is_set, deadline)
        conn.send(_probe_result(tally, latencies))
    conn.close()
    os._exit(0)


class Prober:
    """The probe process, from this side."""

    def __init__(self, ctx: Any, url: str, budget: Budget, busy: Any) -> None:
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=probe_main, args=(url, budget, busy, theirs), daemon=True)
        self.proc.start()
        self._timeout_s = budget.call_timeout_s

    def ready(self) -> bool:
        return bool(self._conn.poll(START_TIMEOUT_S) and self._conn.recv() == "ready")

    def run(self, *command: Any) -> tuple[list[float], Tally]:
        """The latencies the probe counts, and a tally of every probe call."""
        self._conn.send(command)
        wait_s = (command[1] * 2 if len(command) > 1 else 0) + 20 * self._timeout_s
        out = self._conn.recv() if self._conn.poll(wait_s) else {"latencies": [], "ok": [], "failures": {}}
        tally = Tally(latencies=[("probe sample", dt) for dt in out["ok"]], failures=Counter(out["failures"]))
        return list(out["latencies"]), tally

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def setup_good(url: str, budget: Budget) -> list[Client]:
    """Each good thread's run, made concurrently."""
    import tinker

    services = {t: tinker.ServiceClient(base_url=url, api_key=KEYS[t]) for t in GOOD}
    with ThreadPoolExecutor(2 * budget.clients) as pool:
        futures = [
            pool.submit(make_client, services[t], t, budget.call_timeout_s) for t in GOOD for _ in range(budget.clients)
        ]
        return [f.result() for f in futures]


@dataclass
class Soak:
    tally: Tally
    probes: Tally
    without_hog: list[float]  # probes in the soak before the hog starts
    with_hog: list[float]
    duration_s: float


def soak(clients: list[Client], prober: Prober, hog_go: Any, budget: Budget) -> Soak:
    """The good threads (and the hostile tenant's bad inputs) for ``budget.soak_s``; the probe
    in that soak, then ``hog_go`` and the probe again once the hog is in flight."""
    start = time.monotonic()
    deadline = start + budget.soak_s
    tally, probes, without_hog, with_hog = Tally(), Tally(), [], []

    def probe_under_hog() -> None:
        time.sleep(1.0)  # the good threads' calls are under way
        for phase, out in ((("now",), without_hog), (("with_hog", deadline - time.monotonic()), with_hog)):
            if phase[0] == "with_hog":
                hog_go.set()
            latencies, probed = prober.run(*phase)
            out.extend(latencies)
            probes.latencies.extend(probed.latencies)
            probes.failures.update(probed.failures)

    threads = [threading.Thread(target=good_loop, args=(c, tally, deadline, budget.call_timeout_s)) for c in clients]
    threads.append(threading.Thread(target=probe_under_hog))
    for t in threads:
        t.daemon = True
        t.start()
    for t in threads:  # a call started before the deadline may take its whole timeout
        t.join(max(0.0, deadline - time.monotonic()) + budget.call_timeout_s + 5)
    return Soak(tally, probes, without_hog, with_hog, time.monotonic() - start)


def cores() -> int:
    """The cores this process may run on (a container's share, where it has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else (xs[0] if xs else math.nan)


def hog_rate(before: tuple[float, int], after: tuple[float, int], s: Soak) -> float:
    """The hog's sequences per second: the engine's answered in the soak, less the good tenants'
    (a sequence per good sample and probe that succeeded)."""
    good = sum(1 for call, _ in s.tally.latencies if call == "sample") + len(s.probes.latencies)
    return (after[1] - before[1] - good) / (after[0] - before[0])


def report(
    alone: list[float], alone_tally: Tally, s: Soak, hostile: dict[str, Any], busy_procs: int, hog_per_s: float
) -> None:
    rates = {t: s.tally.ok[t] / s.duration_s for t in GOOD}
    failures = alone_tally.failures + s.tally.failures + s.probes.failures
    outcomes: Counter[str] = Counter(hostile.get("outcomes", {}))
    print(f"failed_calls: {sum(failures.values())}")
    print(f"good_tenant_p99_s: {_p99([dt for _, dt in s.tally.latencies]):.3f}")
    print(f"fairness_ratio: {min(rates.values()) / max(rates.values()) if max(rates.values()) else math.nan:.3f}")
    print(f"hog_delay_ratio: {_median(s.with_hog) / _median(alone):.3f}")
    # The same soak without the hog over with it: what the hog itself adds (the ratio above adds
    # the good tenants' own load to it).
    print(f"hog_only_delay_ratio: {_median(s.with_hog) / _median(s.without_hog):.3f}")
    print(f"latency_alone_s: {_median(alone):.3f}")
    print(f"latency_in_soak_without_hog_s: {_median(s.without_hog):.3f}")
    print(f"latency_with_hog_s: {_median(s.with_hog):.3f}")
    print(f"hog_samples_per_s: {hog_per_s:.1f}")
    print(f"probes_alone: {len(alone)}")
    print(f"probes_with_hog: {len(s.with_hog)}")
    for t in GOOD:
        print(f"calls_{t.replace('-', '_')}: {s.tally.ok[t]}")
        print(f"calls_per_s_{t.replace('-', '_')}: {rates[t]:.3f}")
    for call in ("sample", "forward_backward", "optim_step", "save_weights_for_sampler"):
        times = [dt for c, dt in s.tally.latencies if c == call]
        print(f"good_{call}_median_s: {_median(times):.3f}")
        print(f"good_{call}_max_s: {max(times, default=math.nan):.3f}")
    print(f"duration_s: {s.duration_s:.1f}")
    print(f"busy_processes: {busy_procs}")
    print(f"hostile_refused_4xx: {outcomes['refused_4xx']}")
    other = sum(outcomes.values()) - sum(outcomes[k] for k in ("refused_4xx", "hog_done", "hog_failed"))
    print(f"hostile_other: {other}")
    for part in ("failed_later", "accepted", "hog_done", "hog_failed"):
        print(f"hostile_{part}: {outcomes[part]}")
    for what, n in sorted(failures.items()):
        print(f"failed x{n}: {what}", file=sys.stderr)
    for what, n in sorted(hostile.get("details", {}).items()):
        print(f"hostile x{n}: {what}", file=sys.stderr)


def _budget(args: argparse.Namespace) -> Budget:
    b = Budget(clients=2, soak_s=20.0, probes=5, call_timeout_s=30.0) if args.quick else Budget(4, 60.0, 10, 60.0)
    if args.seconds is not None:
        b.soak_s = args.seconds
    if args.probes is not None:
        b.probes = args.probes
    return b


def _stop_hostile(proc: Any) -> None:
    if proc is not None and proc.is_alive():
        proc.kill()
    if proc is not None:
        proc.join(10)


def main() -> None:
    import multiprocessing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 clients per good tenant, 20 s of soak")
    parser.add_argument("--seconds", type=float, help="seconds of soak (instead of 20 quick, 60 full)")
    parser.add_argument("--probes", type=int, help="small samples per probe (instead of 5 quick, 10 full)")
    budget = _budget(parser.parse_args())
    # SIGTERM (a timeout's) raises SystemExit, so the cleanup below still runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ctx = multiprocessing.get_context("spawn")  # the main process holds the SDK's threads: no fork
    ready, go, busy, hog_go = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    receiver, sender = ctx.Pipe(duplex=False)
    with tempfile.TemporaryDirectory(prefix="polytinker-bench-soak-") as tmp:
        serve, url = start_serve(Path(tmp))
        busy_procs: list[subprocess.Popen[bytes]] = []
        hostile_proc = None
        prober: Prober | None = None
        try:
            args = (url, budget.soak_s, budget.call_timeout_s, ready, go, busy, hog_go, sender)
            hostile_proc = ctx.Process(target=hostile_main, args=args, daemon=True)
            hostile_proc.start()
            prober = Prober(ctx, url, budget, busy)
            clients = setup_good(url, budget)
            if not ready.wait(START_TIMEOUT_S) or not prober.ready():
                raise SystemExit("the hostile client or the probe did not start")
            busy_procs = start_busy(cores())
            alone, alone_tally = prober.run("now")
            before = engine_sequences(Path(tmp))
            go.set()
            result = soak(clients, prober, hog_go, budget)
            hog_per_s = hog_rate(before, engine_sequences(Path(tmp)), result)
            hostile = receiver.recv() if receiver.poll(budget.call_timeout_s + 10) else {}
        finally:
            stop_busy(busy_procs)
            _stop_hostile(hostile_proc)
            if prober is not None:
                prober.stop()
            stop_serve(serve)
    report(alone, alone_tally, result, hostile, len(busy_procs), hog_per_s)


if __name__ == "__main__":
    main()
