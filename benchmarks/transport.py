"""Transport benchmark: polytinker RPC against raw pyzmq on the same kind of sockets.

Both servers run in their own subprocess on tcp loopback (ROUTER), the clients here (DEALER):

- round trip of a 100-byte request: ``RpcClient.call("echo", b"x" * 100)`` against a raw
  DEALER send/recv to a raw ROUTER echo loop; rounds alternate between the two so that load from
  other processes hits both alike; medians of per-call times.
- one-way throughput of a 64 MiB float32 tensor: ``call("nbytes", tensor)`` (the server answers
  with a small int) against a raw ``send(copy=False)`` of the tensor's buffer answered with b"ok".
- codec: encode+decode of one sample (512 token ids and 512 logprobs, as Python lists the way
  engines return them) against pickle.dumps+loads of the same object; then the same sample as
  two numpy arrays.

Also printed: the round trip against a server that runs every handler on the thread that reads
its socket (``handler_threads=0``), and the floor of the design itself: a client and a server
with the same threads and hand-offs as polytinker's (the caller takes a socket from a pool under
a lock, sends, receives (blocking, with a receive timeout) and gives the socket back; the
server's I/O thread queues to a handler thread, which queues the answer back through a pipe)
and nothing else: no header, codec, deadline, heartbeat or cancellation.
``rpc_design_floor_ratio`` is what those thread hops cost on this machine; the gap between it
and ``rpc_roundtrip_ratio`` is what the protocol costs: ``rpc_protocol_overhead_ratio`` (target
<= 0.5, that is ``rpc_roundtrip_ratio <= rpc_design_floor_ratio + 0.5`` in the same run).

A blocking call has run on its caller's thread since the caller sockets
(transport/_caller_sockets.py); before them it went through the client's I/O thread, and so did
the floor (the caller queued to an I/O thread through a pipe and waited on a lock):
docs/benchmarks.md has the figures of both.

``--quick`` finishes in well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

from polytinker.transport import RpcClient, TransportConfig, decode, encode

_RAW_SERVER = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(f"READY tcp://127.0.0.1:{port}", flush=True)
while True:
    frames = sock.recv_multipart(copy=False)
    if len(frames[1]) > 1000:  # the throughput test: acknowledge, do not echo 64 MiB back
        sock.send_multipart([frames[0], b"ok"])
    else:
        sock.send_multipart(frames, copy=False)
"""

# The design's floor, server side: one I/O thread owns the socket, a handler thread answers.
_FLOOR_SERVER = """
import collections, os, queue, threading, zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(f"READY tcp://127.0.0.1:{port}", flush=True)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_r, False)
requests, answers = queue.SimpleQueue(), collections.deque()
def handle():
    while True:
        answers.append(requests.get())
        os.write(wake_w, b"\\0")
threading.Thread(target=handle, daemon=True).start()
items = [(sock, zmq.POLLIN), (wake_r, zmq.POLLIN)]
while True:
    zmq.zmq_poll(items, -1)
    try:
        os.read(wake_r, 65536)
    except BlockingIOError:
        pass
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        requests.put(sock.recv_multipart(copy=False))
    while answers:
        sock.send_multipart(answers.popleft(), copy=False)
"""


class _FloorClient:
    """The design's floor, client side: the caller takes a socket from a pool under a lock, sends,
    receives (a blocking receive with a timeout, after which a caller socket looks whether it was failed)
    and gives the socket back: a blocking call on its caller's thread (transport/_caller_sockets.py)."""

    def __init__(self, address: str) -> None:
        self._ids = iter(range(1, 1 << 62))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = 100
        sock.connect(address)
        self._idle = [sock]
        self._lock = threading.Lock()

    def call(self, payload: bytes) -> None:
        rid = next(self._ids).to_bytes(8, "little")
        with self._lock:
            sock = self._idle.pop()
        sock.send_multipart([rid, payload])
        sock.recv_multipart()
        with self._lock:
            self._idle.append(sock)


def spawn_server(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start a server that prints ``READY <address>`` (also benchmarks/scheduler_rate.py's echo)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split()[1]


def _time_each(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_roundtrips(calls: dict[str, Callable[[], object]], rounds: int, per_round: int) -> dict[str, float]:
    """Median microseconds per call of each, the calls taking turns round by round."""
    for call in calls.values():
        _time_each(call, 200)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name] += _time_each(call, per_round)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def bench_tensor(ours: RpcClient, raw: zmq.Socket, reps: int) -> tuple[float, float]:
    t = torch.randn(16 << 20)  # 64 MiB of float32
    nbytes = t.numel() * t.element_size()
    buf = t.numpy().reshape(-1).view(np.uint8)

    def raw_send() -> None:
        raw.send(buf, copy=False)
        raw.recv()

    def our_send() -> None:
        assert ours.call("nbytes", t, timeout_s=60) == nbytes

    raw_send()
    our_send()
    raw_t: list[float] = []
    our_t: list[float] = []
    for _ in range(reps):
        raw_t += _time_each(raw_send, 1)
        our_t += _time_each(our_send, 1)
    return nbytes / statistics.median(our_t) / 1e9, nbytes / statistics.median(raw_t) / 1e9


def bench_codec(reps: int) -> tuple[float, float, float, float]:
    rng = np.random.default_rng(0)
    sample = {
        "token_ids": rng.integers(0, 49152, 512).tolist(),
        "logprobs": (-rng.random(512) * 5).tolist(),
    }
    arrays = {"token_ids": np.asarray(sample["token_ids"]), "logprobs": np.asarray(sample["logprobs"])}

    def ours(obj: object) -> None:
        decode(encode(obj))

    def pickled(obj: object) -> None:
        pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    for fn in (ours, pickled):
        _time_each(lambda fn=fn: fn(sample), 200)  # type: ignore[misc]
    ours_us = statistics.median(_time_each(lambda: ours(sample), reps)) * 1e6
    pickle_us = statistics.median(_time_each(lambda: pickled(sample), reps)) * 1e6
    arrays_us = statistics.median(_time_each(lambda: ours(arrays), reps)) * 1e6
    arrays_pickle_us = statistics.median(_time_each(lambda: pickled(arrays), reps)) * 1e6
    return ours_us, pickle_us, arrays_us, arrays_pickle_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    args = parser.parse_args(argv)
    rounds, per_round, tensor_reps, codec_reps = (40, 50, 5, 2000) if args.quick else (200, 100, 15, 20000)

    cfg = TransportConfig(request_timeout_s=60.0)
    raw_proc, raw_addr = spawn_server([sys.executable, "-c", _RAW_SERVER])
    our_proc, our_addr = spawn_server([sys.executable, "-m", "polytinker.transport._echo", "tcp://127.0.0.1:0"])
    inline_proc, inline_addr = spawn_server(
        [sys.executable, "-m", "polytinker.transport._echo", "tcp://127.0.0.1:0", "--handler-threads", "0"]
    )
    floor_proc, floor_addr = spawn_server([sys.executable, "-c", _FLOOR_SERVER])
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(raw_addr)
    try:
        with RpcClient(our_addr, config=cfg) as ours, RpcClient(inline_addr, config=cfg) as inline:
            payload = b"x" * 100
            floor = _FloorClient(floor_addr)
            us = bench_roundtrips(
                {
                    "raw": lambda: (raw.send(payload), raw.recv()),
                    "rpc": lambda: ours.call("echo", payload),
                    "inline": lambda: inline.call("echo", payload),
                    "floor": lambda: floor.call(payload),
                },
                rounds,
                per_round,
            )
            print(f"rpc_roundtrip_us: {us['rpc']:.1f}")
            print(f"raw_roundtrip_us: {us['raw']:.1f}")
            print(f"rpc_roundtrip_ratio: {us['rpc'] / us['raw']:.2f}")
            print(f"rpc_roundtrip_inline_us: {us['inline']:.1f}  (handler_threads=0)")
            print(f"rpc_roundtrip_inline_ratio: {us['inline'] / us['raw']:.2f}")
            print(f"rpc_design_floor_us: {us['floor']:.1f}  (the same thread hops, no protocol)")
            print(f"rpc_design_floor_ratio: {us['floor'] / us['raw']:.2f}")
            # The target: the protocol's work on top of the design's thread hops, in the same run.
            overhead = (us["rpc"] - us["floor"]) / us["raw"]
            print(f"rpc_protocol_overhead_ratio: {overhead:.2f}  (target <= 0.5)")
            print(f"rpc_roundtrip_target_met: {overhead <= 0.5}")
            gbps, raw_gbps = bench_tensor(ours, raw, tensor_reps)
            print(f"tensor_throughput_gbps: {gbps:.2f}")
            print(f"raw_tensor_throughput_gbps: {raw_gbps:.2f}")
            print(f"tensor_throughput_ratio: {gbps / raw_gbps:.2f}")
        codec_us, pickle_us, arrays_us, arrays_pickle_us = bench_codec(codec_reps)
        print(f"codec_sample_us: {codec_us:.1f}")
        print(f"pickle_sample_us: {pickle_us:.1f}")
        print(f"codec_vs_pickle_ratio: {codec_us / pickle_us:.2f}")
        print(f"codec_sample_numpy_us: {arrays_us:.1f}  (the same sample as two numpy arrays)")
        print(f"codec_numpy_vs_pickle_ratio: {arrays_us / arrays_pickle_us:.2f}")
    finally:
        raw.close(linger=0)
        for proc in (raw_proc, our_proc, inline_proc, floor_proc):
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
