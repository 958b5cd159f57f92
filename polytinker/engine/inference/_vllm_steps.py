"""vLLM's engine driven one step at a time, so that requests join a batch in progress.

``LLM.generate`` adds a list of requests and steps vLLM's engine until every request it holds has
ended: a request that arrives meanwhile waits for the whole list. Here requests are added to
vLLM's engine (``LLMEngine.add_request``) whenever the inference engine's loop has them, and each
``step`` of a batch is one ``LLMEngine.step``: vLLM's own scheduler then fits new requests into its
running batch (its continuous batching). Every request of the backend goes this way (samples,
scores), because a step runs every request vLLM holds and answers whichever end: ``_Stepper``
hands each finished output to the batch, or the blocking call, that added it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from polytinker.engine.types import SampleRequest, SampleResult
from polytinker.errors import ModelError

# A request's place in vLLM: (the output's receiver, the request's key there, which copy it is).
_Receiver = Callable[[Hashable, int, Any], None]


class _Stepper:
    """One vLLM engine shared by every open batch and blocking call of a backend."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._ids = itertools.count()
        self._owners: dict[str, tuple[_Receiver, Hashable, int]] = {}

    def add(self, receiver: _Receiver, items: Sequence[tuple[Hashable, int, list[int], Any, Any]]) -> list[str]:
        """Add ``(key, copy, prompt, vLLM params, LoRA request)`` items, all or none."""
        from vllm.sampling_params import RequestOutputKind

        added: list[str] = []
        try:
            for key, copy, prompt, params, lora in items:
                params.output_kind = RequestOutputKind.FINAL_ONLY  # only an ended request's output
                request_id = f"pt-{next(self._ids)}"
                self._engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora)
                added.append(request_id)
                self._owners[request_id] = (receiver, key, copy)
        except Exception as exc:
            self.abort(added)
            raise ModelError(f"vLLM refused a request: {exc}") from exc
        return added

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = [i for i in request_ids if self._owners.pop(i, None) is not None]
        if ids:
            self._engine.abort_request(ids)

    def step(self) -> None:
        """One step of vLLM's engine; each request that ended goes to whoever added it."""
        for output in self._engine.step():
            if output.finished and output.request_id in self._owners:
                receiver, key, copy = self._owners.pop(output.request_id)
                receiver(key, copy, output)

    def run(self, items: Sequence[tuple[list[int], Any, Any]]) -> list[Any]:
        """A blocking call: ``(prompt, params, LoRA request)`` items to their ends, in order
        (other batches' requests step along with them)."""
        outputs: dict[Hashable, Any] = {}
        ids = self.add(
            lambda key, _copy, output: outputs.__setitem__(key, output), [(i, 0, *x) for i, x in enumerate(items)]
        )
        try:
            while len(outputs) < len(items):
                self.step()
        except BaseException:
            self.abort(ids)
            raise
        return [outputs[i] for i in range(len(items))]


@dataclass
class _Entry:
    request: SampleRequest
    prompt: list[int]
    copies: int  # vLLM requests it went in as (greedy n > 1 goes in as n requests of n = 1)
    ids: list[str] = field(default_factory=list)
    outputs: dict[int, Any] = field(default_factory=dict)


class VllmBatch:
    """A batch of the ``vllm`` backend (a :class:`~polytinker.engine.inference.base.StepBatch`):
    its requests are in vLLM's engine from ``add`` on, and each ``step`` is one step of that
    engine. ``rows`` counts the sequences not yet answered; ``tokens_left`` the most tokens one
    of them may still draw (vLLM's scheduler decides each step's work, so this is a bound)."""

    def __init__(self, backend: Any, stepper: _Stepper) -> None:
        self._backend = backend
        self._stepper = stepper
        self._entries: dict[Hashable, _Entry] = {}
        self._steps = 0
        self._joined: dict[Hashable, int] = {}  # the step each request joined at

    @property
    def rows(self) -> int:
        return sum(e.request.num_samples for e in self._entries.values() if len(e.outputs) < e.copies)

    @property
    def tokens_left(self) -> int:
        live = [k for k, e in self._entries.items() if len(e.outputs) < e.copies]
        left = [self._entries[k].request.params.max_tokens - (self._steps - self._joined[k]) for k in live]
        return max([1, *left]) if live else 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, requests: Sequence[tuple[Hashable, SampleRequest]]) -> list[tuple[Hashable, SampleResult]]:
        """Put ``requests`` into vLLM's engine (prefilled at its next step); all or none."""
        if any(key in self._entries for key, _ in requests):
            raise ModelError("VllmBatch.add: a key already in the batch")
        b = self._backend
        with b._lock:
            b._check_open()
            entries = {key: b._entry(request) for key, request in requests}
            items = [
                (key, copy, e.prompt, params, lora)
                for key, e in entries.items()
                for copy, (params, lora) in enumerate(b._vllm_requests(e))
            ]
            ids = self._stepper.add(self._receive, items)
        for key, e in entries.items():
            e.ids = [i for i, item in zip(ids, items, strict=True) if item[0] == key]
            self._joined[key] = self._steps
        self._entries.update(entries)
        return []

    def _receive(self, key: Hashable, copy: int, output: Any) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.outputs[copy] = output

    def step(self) -> list[tuple[Hashable, SampleResult]]:
        b = self._backend
        with b._lock:
            b._check_open()
            try:
                self._stepper.step()
            except Exception as exc:
                self._stepper.abort([i for e in self._entries.values() for i in e.ids])
                self._entries.clear()
                raise ModelError(f"vLLM failed on a step of {self.rows} sequences: {exc}") from exc
            self._steps += 1
            return self._ended()

    def _ended(self) -> list[tuple[Hashable, SampleResult]]:
        done = [k for k, e in self._entries.items() if len(e.outputs) == e.copies]
        out = []
        for key in done:
            e = self._entries.pop(key)
            del self._joined[key]
            completions = [
                c for copy in range(e.copies) for c in sorted(e.outputs[copy].outputs, key=lambda c: c.index)
            ]
            out.append((key, self._backend._result(e.request, e.prompt, completions)))
        return out


__all__ = ["VllmBatch"]
