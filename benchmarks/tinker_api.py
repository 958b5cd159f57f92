"""The cost of the Tinker HTTP API: one RL step through the official SDK vs through polytinker's client.

One ``polytinker serve --http`` (default model, one engine, one learner) serves both sides. Each
side trains its own LoRA adapter on ``benchmarks/train.py``'s task (``_train_task``: a group of 8
completions of 16 tokens to one prompt, GRPO advantages, an ``importance_sampling`` step, new
weights to the sampler), one side with ``tinker.ServiceClient`` over HTTP, the other with
``polytinker.ServiceClient`` over ZeroMQ. Steps alternate between the sides, so load from other
processes hits both alike; every completion runs to its 16 tokens (EOS ignored) so both sides
do the same work. Medians over the steps after the first.

Prints ``name: value`` lines: ``http_step_overhead_ratio`` (SDK step time / polytinker client
step time; target <= 1.10), and each side's median seconds per call.

``--quick``: 4 measured steps per side (about 3 minutes on 2 cores, start included).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _train_task import GROUP_SIZE, LORA_RANK, MAX_NEW_TOKENS, PROMPT, group_advantages, reward  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = "tml-benchmark-key-0123456789"
LEARNING_RATE = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(root: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    import httpx

    zmq_address, http_port = f"tcp://127.0.0.1:{_free_port()}", _free_port()
    (root / "runtime.toml").write_text(
        f'model = "{MODEL}"\naddress = "{zmq_address}"\n[[tenants]]\nname = "bench"\napi_key = "{KEY}"\n'
    )
    cmd = [sys.executable, "-m", "polytinker.cli", "serve", "--config", str(root / "runtime.toml")]
    cmd += ["--state-dir", str(root / "state"), "--http", f"127.0.0.1:{http_port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(root / "serve.log", "wb"))  # noqa: SIM115
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("serve exited: " + (root / "serve.log").read_text()[-2000:])
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return proc, zmq_address, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("serve did not start")


def rows(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> dict[str, list[Any]]:
    """One completion as next-token rows: the prompt's positions carry no weight or advantage, and
    a completion whose advantage is 0 none either (the rule the gateway applies to Tinker's RL
    datums, which carry no weights: both sides train the same rows)."""
    full = prompt + tokens
    n_prompt = len(prompt) - 1
    return {
        "input": full[:-1],
        "target": full[1:],
        "weights": [0.0] * n_prompt + [1.0 if advantage != 0.0 else 0.0] * len(tokens),
        "advantages": [0.0] * n_prompt + [advantage] * len(tokens),
        "logprobs": [0.0] * n_prompt + list(logprobs),
    }


class Ours:
    """The step through polytinker's own client (ZeroMQ to the scheduler)."""

    def __init__(self, address: str, prompt: list[int]) -> None:
        from polytinker import ServiceClient

        self.service = ServiceClient(address, api_key=KEY)
        self.trainer = self.service.create_lora_training_client(MODEL, rank=LORA_RANK, agent="ours")
        self.sampler = self.trainer.save_weights_and_get_sampling_client()
        self.prompt = prompt

    def step(self, seed: int) -> dict[str, float]:
        from polytinker.engine.learner.config import AdamParams
        from polytinker.engine.types import Datum, SamplingParams

        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)
        seqs = self.sampler.sample(self.prompt, GROUP_SIZE, params).result().sequences
        t1 = time.perf_counter()
        adv = group_advantages([reward(s.text) for s in seqs])
        data = []
        for s, a in zip(seqs, adv, strict=True):
            r = rows(self.prompt, s.tokens, s.logprobs, a)
            data.append(Datum(r["input"], r["target"], r["weights"], r["advantages"], r["logprobs"]))
        fb = self.trainer.forward_backward(data, "importance_sampling")
        st = self.trainer.optim_step(AdamParams(learning_rate=LEARNING_RATE))
        fb.result()
        t2 = time.perf_counter()
        st.result()
        t3 = time.perf_counter()
        self.sampler = self.trainer.save_weights_and_get_sampling_client()
        t4 = time.perf_counter()
        return {"sample": t1 - t0, "forward_backward": t2 - t1, "optim_step": t3 - t2, "save_weights": t4 - t3}

    def close(self) -> None:
        self.service.close()


class Sdk:
    """The same step through the official tinker SDK (HTTP to the gateway in serve)."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        import tinker

        self.tinker = tinker
        self.service = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.trainer = self.service.create_lora_training_client(base_model=MODEL, rank=LORA_RANK).result()
        self.sampler = self.trainer.save_weights_and_get_sampling_client().result()
        self.prompt = prompt

    def step(self, seed: int) -> dict[str, float]:
        types = self.tinker.types
        t0 = time.perf_counter()
        # stop=[]: no stop token at all, EOS included (Tinker's meaning), as ignore_eos on the other side.
        params = types.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=seed, stop=[])
        out = self.sampler.sample(types.ModelInput.from_ints(self.prompt), GROUP_SIZE, params).result()
        t1 = time.perf_counter()
        texts = [self.tokenizer.decode(s.tokens) for s in out.sequences]
        adv = group_advantages([reward(t) for t in texts])
        data = []
        for s, a in zip(out.sequences, adv, strict=True):
            r = rows(self.prompt, s.tokens, s.logprobs or [], a)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(r["input"]),
                    loss_fn_inputs={
                        "target_tokens": r["target"],
                        "logprobs": r["logprobs"],
                        "advantages": r["advantages"],
                    },
                )
            )
        fb = self.trainer.forward_backward(data, "importance_sampling")
        st = self.trainer.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        fb.result()
        t2 = time.perf_counter()
        st.result()
        t3 = time.perf_counter()
        self.sampler = self.trainer.save_weights_and_get_sampling_client().result()
        t4 = time.perf_counter()
        return {"sample": t1 - t0, "forward_backward": t2 - t1, "optim_step": t3 - t2, "save_weights": t4 - t3}

    @property
    def tokenizer(self) -> Any:
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = self.trainer.get_tokenizer()
        return self._tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 measured steps per side")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per side (after one warm-up)")
    args = parser.parse_args()
    steps = 4 if args.quick else args.steps

    from polytinker.engine.models import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)]

    with tempfile.TemporaryDirectory(prefix="polytinker-bench-tinker-") as tmp:
        proc, address, url = start_serve(Path(tmp))
        try:
            ours, sdk = Ours(address, prompt), Sdk(url, prompt)
            times: dict[str, list[dict[str, float]]] = {"ours": [], "sdk": []}
            for i in range(steps + 1):  # the first step of each side warms up
                for name, side in (("ours", ours), ("sdk", sdk)) if i % 2 == 0 else (("sdk", sdk), ("ours", ours)):
                    result = side.step(seed=1000 + i)
                    if i > 0:
                        times[name].append(result)
            ours.close()
        finally:
            proc.terminate()
            proc.wait(60)

    def median(name: str, key: str | None = None) -> float:
        return statistics.median(sum(r.values()) if key is None else r[key] for r in times[name])

    print(f"http_step_overhead_ratio: {median('sdk') / median('ours'):.3f}")
    print(f"sdk_step_s: {median('sdk'):.3f}")
    print(f"polytinker_step_s: {median('ours'):.3f}")
    for key in ("sample", "forward_backward", "optim_step", "save_weights"):
        print(f"sdk_{key}_s: {median('sdk', key):.3f}")
        print(f"polytinker_{key}_s: {median('ours', key):.3f}")


if __name__ == "__main__":
    main()
