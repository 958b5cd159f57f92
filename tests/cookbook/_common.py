"""What the cookbook scripts share: the served model's name, its tokenizer registered with the
cookbook, and the metrics and checkpoint records a cookbook run leaves in its log directory.

The scripts run in the cookbook's own environment (``make cookbook-venv``), not polytinker's: they
reach polytinker only through the tinker SDK, configured by ``TINKER_BASE_URL`` and
``TINKER_API_KEY`` as against Tinker itself.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

MODEL = os.environ.get("TINKER_MODEL", "smollm2-135m-instruct")
RENDERER = "role_colon"  # the cookbook's renderer that fits any model


def register_tokenizer() -> None:
    """Make the cookbook's ``get_tokenizer(MODEL)`` load the served model's tokenizer.

    The cookbook would look the name up on the Hugging Face hub. ``TOKENIZER_DIR`` names a
    directory to load it from; without it, the server is asked (``get_info`` names the tokenizer,
    which the SDK's ``get_tokenizer`` loads), at the cost of one training run."""
    from tinker_cookbook import tokenizer_utils

    def load() -> Any:
        where = os.environ.get("TOKENIZER_DIR")
        if where:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(where)
        import tinker

        probe = tinker.ServiceClient().create_lora_training_client(base_model=MODEL, rank=1)
        return probe.get_tokenizer()

    cached: list[Any] = []

    def factory() -> Any:
        if not cached:
            cached.append(load())
        return cached[0]

    tokenizer_utils.register_tokenizer(MODEL, factory)


def quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "tinker", "tinker_cookbook"):
        logging.getLogger(name).setLevel(logging.WARNING)


def metrics(log_path: str | Path) -> list[dict[str, Any]]:
    """The rows the run's JsonLogger wrote (``metrics.jsonl``), in order."""
    path = Path(log_path) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoints(log_path: str | Path) -> list[dict[str, Any]]:
    """The cookbook's checkpoint records (``checkpoints.jsonl``), in order."""
    from tinker_cookbook import checkpoint_utils

    return [r.to_dict() for r in checkpoint_utils.load_checkpoints_file(str(log_path))]


def sampler_version(tinker_path: str) -> int:
    """The version a sampler path samples. A version's path says it
    (``tinker://RUN/sampler_weights/AGENT@VERSION``); a named save's (``.../sampler_weights/NAME``,
    as the cookbook's checkpoints are) is asked of the server: a sampling session on it, whose
    ``GET /samplers/ID`` answers the version's path."""
    if "@" in tinker_path.rsplit("/", 1)[1]:
        return int(tinker_path.rsplit("@", 1)[1])
    import httpx

    url = os.environ["TINKER_BASE_URL"].rstrip("/") + "/api/v1"
    headers = {"X-API-Key": os.environ["TINKER_API_KEY"]}
    session = httpx.post(f"{url}/create_session", json={}, headers=headers, timeout=60).json()["session_id"]
    try:
        body = {"session_id": session, "sampling_session_seq_id": 0, "model_path": tinker_path}
        made = httpx.post(f"{url}/create_sampling_session", json=body, headers=headers, timeout=60).json()
        sampler = httpx.get(f"{url}/samplers/{made['sampling_session_id']}", headers=headers, timeout=60).json()
    finally:
        httpx.post(f"{url}/sessions/{session}/finish", json={}, headers=headers, timeout=60)
    return int(sampler["model_path"].rsplit("@", 1)[1])


def fail(message: str) -> NoReturn:
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def run_script(main: Callable[[Path], None]) -> None:
    """A script's entry: quiet logs, the tokenizer registered, then ``main(log_dir)`` with the
    directory the test passes (or a temporary one)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # the cookbook calls the SDK's older *_async forms
    quiet_logs()
    register_tokenizer()
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
