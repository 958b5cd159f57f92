"""The answers of the Tinker API's calls that take time, as the SDK reads them: results rendered
for the wire (``forward_backward``'s and ``sample``'s as protobuf, metrics under Tinker's names)
and failures (``failed``: the message, and whose fault it was). Metric names are the client's
(``polytinker.types.tinker_metrics``): nothing is renamed here."""

from __future__ import annotations

from typing import Any

import numpy as np

from polytinker.gateway import _proto
from polytinker.gateway.errors import classify
from polytinker.types import ForwardBackwardOutput


def fb_render(out: ForwardBackwardOutput) -> bytes:
    """A forward's or forward_backward's result as the SDK reads it: per-datum logprobs and the
    metrics the client already named as Tinker does (``loss:sum``, ``tokens:sum``, ...)."""
    outputs = [{"logprobs": np.asarray(lp, dtype=np.float32)} for lp in out.logprobs]
    return _proto.encode_forward_backward_output(outputs, dict(out.metrics))


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


__all__ = ["failed", "fb_render", "sample_render"]
