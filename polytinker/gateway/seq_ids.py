"""Tinker's ``seq_id``: each call of a training run carries the next number, and the SDK sends a
call again when it did not get the answer (a connection cut, a 5xx, a timeout). A resent call is
answered with its first answer (the same request id: one forward_backward, one step), not run
twice; a ``seq_id`` the run already used for another body is refused (409), since running it
would put the run's calls out of the order its client made them in.

What is kept: per run, the last ``per_run`` seq_ids (``[http] seq_ids_per_run``, HttpConfig) with a
digest of their body and their answer; at most ``MAX_RUNS`` runs (the least recently used go). A
call that failed is forgotten, so the SDK's retry of it runs. Kept in memory: a restarted gateway
knows none (its predecessor's lost calls are answered by the request journal,
``GatewayStore.lost_request``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from polytinker.gateway.errors import HttpError

MAX_RUNS = 10_000


def body_digest(route: str, body: bytes | dict[str, Any]) -> bytes:
    """A digest of a request to ``route`` (the raw protobuf bytes, or the parsed JSON body)."""
    raw = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True, default=str).encode()
    return hashlib.blake2b(route.encode() + b"\0" + raw, digest_size=16).digest()


class SeqIds:
    """The calls of each run by seq_id (see the module docstring). Used from the event loop only."""

    def __init__(self, per_run: int, max_runs: int = MAX_RUNS) -> None:
        self.per_run, self.max_runs = per_run, max_runs
        self._runs: OrderedDict[tuple[str, str], OrderedDict[int, tuple[bytes, asyncio.Future[Any]]]] = OrderedDict()

    async def once(
        self,
        owner: str,
        model_id: Any,
        seq_id: Any,
        digest: bytes,
        run: Callable[[], Awaitable[dict[str, Any]]],
    ) -> dict[str, Any]:
        """``run()``'s answer, or the first answer of this run's call ``seq_id`` if it came before."""
        if not isinstance(model_id, str) or not isinstance(seq_id, int) or seq_id <= 0:
            return await run()  # a call outside a numbered sequence: nothing to match it with
        calls = self._calls(owner, model_id)
        found = calls.get(seq_id)
        if found is not None:
            if found[0] != digest:
                raise HttpError(
                    409,
                    f"seq_id {seq_id} of {model_id} was already used by another request: each call of a run "
                    "takes the next seq_id (a resent call carries its own, with the same body)",
                    code="seq_id_reused",
                )
            return dict(await asyncio.shield(found[1]))
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by any resend
        calls[seq_id] = (digest, answer)
        while len(calls) > self.per_run:
            calls.popitem(last=False)
        try:
            out = await run()
        except BaseException as exc:
            if calls.get(seq_id, (b"", None))[1] is answer:
                del calls[seq_id]  # failed: the SDK's retry runs it
            if isinstance(exc, asyncio.CancelledError):
                answer.cancel()
            else:
                answer.set_exception(exc)
            raise
        answer.set_result(out)
        return out

    def _calls(self, owner: str, model_id: str) -> OrderedDict[int, tuple[bytes, asyncio.Future[Any]]]:
        key = (owner, model_id)
        calls = self._runs.get(key)
        if calls is None:
            calls = self._runs[key] = OrderedDict()
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(key)
        return calls


__all__ = ["MAX_RUNS", "SeqIds", "body_digest"]
