"""The answers of the Tinker API's calls that take time, as the SDK reads them: results rendered
for the wire (``forward_backward``'s and ``sample``'s as protobuf, metrics under Tinker's names)
and failures (``failed``: the message, and whose fault it was)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from polytinker.engine.types import Datum
from polytinker.scheduler.http import _proto
from polytinker.scheduler.http.errors import classify


def _metrics(loss: float, metrics: dict[str, float], n_tokens: float) -> dict[str, float]:
    """Tinker's metric names (``loss:sum``; ``name:mean`` style) from polytinker's (``loss/x``)."""
    out = {"loss:sum": float(loss)}
    for k, v in metrics.items():
        if isinstance(v, int | float) and math.isfinite(float(v)):
            out[k.replace("/", ":") if ":" in k or "/" in k else f"{k}:mean"] = float(v)
    out.setdefault("tokens:sum", float(n_tokens))
    return out


def step_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k.replace("/", ":"): float(v) for k, v in metrics.items() if isinstance(v, int | float)}


def fb_render(datums: list[Datum]) -> Callable[[Any], bytes]:
    """How to render the result of a forward or forward_backward of ``datums`` (a
    ``ForwardBackwardOutput``: the learner's loss and metrics either way)."""
    weights = [np.asarray(d.weights_T, dtype=np.float64) for d in datums]

    def render(out: Any) -> bytes:
        n = float(sum((w != 0).sum() for w in weights))
        outputs = [{"logprobs": np.asarray(lp, dtype=np.float32)} for lp in out.logprobs]
        return _proto.encode_forward_backward_output(outputs, _metrics(out.loss, out.metrics, n))

    return render


def sample_render(response: Any) -> bytes:
    seqs = [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason} for s in response.sequences]
    return _proto.encode_sample_response(seqs, response.prompt_logprobs, response.topk_prompt_logprobs)


def failed(exc: BaseException) -> dict[str, Any]:
    """A failed call as the SDK reads it: the message (no server paths in it), and whether the
    caller (``user``) or the runtime (``server``) was at fault; a runtime fault names only an error id."""
    status, body = classify(exc)
    err = body["error"]
    # A 503 (a restarting worker, a stopped runtime) says what happened; any other fault of the
    # runtime only its error id.
    message = err["message"] if status < 500 or status == 503 else f"internal error (error id {err['error_id']})"
    return {"error": message, "category": "user" if status < 500 else "server", "error_id": err["error_id"]}


__all__ = ["failed", "fb_render", "sample_render", "step_metrics"]
