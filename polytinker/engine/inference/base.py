"""The interface every inference backend implements, and the conventions they share.

A backend holds one base model and any number of resident LoRA adapter versions. It is
synchronous and single-threaded from its caller's point of view: :class:`InferenceEngine`
(``engine.py``) owns batching, threads and adapter residency, and calls the backend with one
batch at a time.

Conventions every backend keeps (the tests check them for each one):

- ``vocab_size`` and ``max_model_len`` say what the model can read; the engine refuses a request
  outside them before it shares a batch (``_requests.check_request``).
- ``sample`` serves one mixed batch: each request names its own adapter version (``None`` is the
  base model) and its own sampling parameters; results come back in request order, each with
  the request's ``num_samples`` sequences. A backend that decodes in steps also offers ``open_batch``
  (:class:`SteppingBackend`): the engine then lets requests join a batch in progress.
- A sequence's ``token_ids`` are the generated tokens only. A stop token (EOS or one of
  ``stop_token_ids``) that ended it is included, so a learner sees the model emit it; a stop
  string is included in ``token_ids`` (the tokens that completed it) but cut from ``text``.
  ``text`` is the decoded ``token_ids`` without special tokens, cut before the first stop string.
- ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution the token was
  drawn from *before* temperature, top-k and top-p: the model's own ``log_softmax`` over the
  vocabulary. It therefore equals what ``compute_logprobs`` returns for the same tokens, which is
  what an importance-sampling or PPO loss needs.
- ``compute_logprobs(sequences, adapter)`` returns, for each sequence ``s``, a list of
  ``len(s) - 1`` floats: entry ``j`` is ``log p(s[j + 1] | s[: j + 1])``. The first token has no
  prediction and gets no entry.
- Adapter tensors use peft's key layout (``base_model.model.<module>.lora_A.weight``), as in
  ``adapter_model.safetensors``; :mod:`polytinker.engine.inference.adapter_io` reads and writes
  such directories.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.types import AdapterRef, SampleRequest, SampleResult, ScoredTopK

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@runtime_checkable
class InferenceBackend(Protocol):
    """One base model, many resident adapter versions; one batch at a time."""

    name: str  # "hf" or "vllm"
    vocab_size: int  # token ids the model reads are in [0, vocab_size)
    max_model_len: int  # positions in one sequence: prompt and generated tokens together

    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Serve one mixed batch (adapters and sampling parameters may differ per request)."""
        ...

    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], adapter: AdapterRef | None = None
    ) -> list[list[float]]:
        """Per sequence ``s``: ``len(s) - 1`` log-probabilities, entry ``j`` = log p(s[j+1] | s[:j+1])."""
        ...

    def compute_logprobs_topk(
        self, sequences: Sequence[Sequence[int]], k: int, adapter: AdapterRef | None = None
    ) -> ScoredTopK:
        """``compute_logprobs``'s answer and, in the same pass, per sequence and position ``j``
        the ``k`` likeliest next tokens after ``s[:j+1]`` as ``(token id, logprob)``, best first."""
        ...

    def load_adapter(self, weights: AdapterWeights) -> None:
        """Make ``weights.ref`` resident from in-memory tensors (peft key layout). Loading a ref
        that is already resident replaces its tensors."""
        ...

    def load_adapter_dir(self, ref: AdapterRef, path: Path) -> None:
        """Make ``ref`` resident from a peft adapter directory (adapter_config.json +
        adapter_model.safetensors)."""
        ...

    def unload_adapter(self, ref: AdapterRef) -> None:
        """Drop a resident adapter version; unknown refs raise ``ConfigError``."""
        ...

    def loaded_adapters(self) -> list[AdapterRef]:
        """The adapter versions resident now."""
        ...

    def close(self) -> None:
        """Release the model and any worker processes; idempotent."""
        ...


class StepBatch(Protocol):
    """A batch decoded step by step (``SteppingBackend.open_batch``): requests join it between
    two steps and leave it when they end. Each method returns the requests that have ended, as
    ``(key, result)``; a request's key is the caller's."""

    @property
    def rows(self) -> int:
        """Sequences still being generated."""
        ...

    @property
    def tokens_left(self) -> int:
        """The most tokens they may still draw."""
        ...

    def add(self, requests: Sequence[tuple[Hashable, SampleRequest]]) -> list[tuple[Hashable, SampleResult]]:
        """Prefill ``requests`` and join them; all or none (if it raises, the batch is as it was)."""
        ...

    def step(self) -> list[tuple[Hashable, SampleResult]]:
        """One decode step for every live sequence."""
        ...


@runtime_checkable
class SteppingBackend(InferenceBackend, Protocol):
    """A backend whose batches the engine drives one decode step at a time (``hf``, ``vllm``):
    requests that arrive while a batch runs join it at its next step (continuous batching)."""

    joins: bool  # False where the model's cache cannot take rows mid-batch: a batch runs to its end

    def open_batch(self) -> StepBatch: ...


def sample_to_end(batch: StepBatch, requests: Sequence[SampleRequest]) -> list[SampleResult]:
    """``requests`` as one batch stepped to its end: a stepping backend's ``sample``."""
    done = dict(batch.add(list(enumerate(requests))))
    while batch.rows:
        done.update(batch.step())
    return [done[i] for i in range(len(requests))]


def render_prompt(tokenizer: PreTrainedTokenizerBase, request: SampleRequest) -> list[int]:
    """The prompt's token ids: given ids as they are, or chat messages rendered with the model's
    chat template and a generation prompt (the assistant turn's header)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    assert request.messages is not None  # SampleRequest guarantees exactly one of the two
    rendered = tokenizer.apply_chat_template(
        [dict(m) for m in request.messages], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # transformers returns a plain list of ids here; some versions wrap it in a BatchEncoding.
    ids: Any = rendered["input_ids"] if isinstance(rendered, dict) else rendered
    return [int(t) for t in ids]


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


__all__ = ["InferenceBackend", "StepBatch", "SteppingBackend", "cut_at_stop", "render_prompt", "sample_to_end"]
