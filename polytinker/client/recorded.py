"""An agent's recorded ``/v1`` calls as training datums, one per episode where the calls continue
each other (docs/openai.md, "Multi-turn agents, token for token").

Every answer of polytinker's OpenAI-compatible routes carries the ids it sampled:
``prompt_token_ids``, ``token_ids``, ``token_logprobs``, and, when the prompt extends an earlier
answer token for token, ``prompt_continues`` (that call's id). ``merge_calls`` turns an episode's
calls into datums as polytinker's own multi-turn rollouts do: calls whose prompt extends the last
call's prompt + sampled ids become one datum (the last call's tokens), with each call's advantage
and weight on its own sampled tokens and weight 0 on everything else (the first prompt, the tool
results and user turns in between). A call that does not extend the last one starts a new datum.

- ``RecordedCall``: one sampled answer's ids (``RecordedCall.of(choice)`` reads an ``openai``
  response, choice, or their dicts).
- ``merge_calls``: the datums of an episode's calls.
- ``call_datum``: one call alone as a datum (what each call is when nothing continues).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polytinker.errors import ConfigError
from polytinker.types import Datum, ModelInput, TensorData


def _field(obj: Any, name: str) -> Any:
    """A field of a dict, or of an ``openai`` object (its own or an extension field)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(name)
    return value


@dataclass(frozen=True)
class RecordedCall:
    """One answer of ``/v1``: its prompt ids, its sampled ids and their logprobs, and the id of
    the call its prompt continues (None: none)."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    token_logprobs: tuple[float, ...]
    prompt_continues: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ConfigError("RecordedCall: prompt_token_ids is empty")
        if len(self.token_logprobs) != len(self.token_ids):
            raise ConfigError(
                f"RecordedCall: {len(self.token_ids)} token_ids but {len(self.token_logprobs)} token_logprobs"
            )
        if not all(math.isfinite(x) for x in self.token_logprobs):
            raise ConfigError("RecordedCall: token_logprobs must be finite")

    @classmethod
    def of(cls, answer: Any) -> RecordedCall:
        """The ids of ``answer``: a choice of a chat or completion response (an ``openai`` object or
        its dict), a response with one choice, or a ``RecordedCall``. A response of ``n > 1``
        choices is refused: pass the choice the agent went on with."""
        if isinstance(answer, RecordedCall):
            return answer
        choices = _field(answer, "choices")
        if choices is not None:
            if len(choices) != 1:
                raise ConfigError(f"a response with {len(choices)} choices: pass the choice the agent went on with")
            answer = choices[0]
        prompt, tokens, logprobs = (_field(answer, k) for k in ("prompt_token_ids", "token_ids", "token_logprobs"))
        if prompt is None or tokens is None or logprobs is None:
            raise ConfigError(
                "not an answer of polytinker's /v1 routes: it has no prompt_token_ids, token_ids and token_logprobs"
            )
        continues = _field(answer, "prompt_continues")
        return cls(
            tuple(int(t) for t in prompt),
            tuple(int(t) for t in tokens),
            tuple(float(x) for x in logprobs),
            str(continues) if continues else None,
        )

    def extended_by(self, later: RecordedCall) -> bool:
        """Whether ``later``'s prompt is this call's prompt + sampled ids and then more."""
        n, m = len(self.prompt_token_ids), len(self.token_ids)
        prompt = later.prompt_token_ids
        return len(prompt) >= n + m and prompt[:n] == self.prompt_token_ids and prompt[n : n + m] == self.token_ids


class _Builder:
    """A datum left to right: target position ``j`` is token ``j + 1`` of the sequence."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens = list(prompt)
        n = len(self.tokens) - 1
        self.weights, self.advantages, self.logprobs = [0.0] * n, [0.0] * n, [0.0] * n

    def add(self, tokens: Sequence[int], logprobs: Sequence[float], advantage: float, weight: float) -> None:
        self.tokens.extend(tokens)
        self.weights.extend([weight] * len(tokens))
        self.advantages.extend([advantage] * len(tokens))
        self.logprobs.extend(logprobs)

    def datum(self) -> Datum:
        return Datum(
            model_input=ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData(self.tokens[1:], "int64"),
                "weights": TensorData(self.weights, "float32"),
                "advantages": TensorData(self.advantages, "float32"),
                "logprobs": TensorData(self.logprobs, "float32"),
            },
        )


def _advantages(advantages: float | Sequence[float], n: int) -> list[float]:
    values = [float(advantages)] * n if isinstance(advantages, int | float) else [float(a) for a in advantages]
    if len(values) != n:
        raise ConfigError(f"merge_calls: {n} calls but {len(values)} advantages")
    if not all(math.isfinite(a) for a in values):
        raise ConfigError("merge_calls: advantages must be finite")
    return values


def merge_calls(calls: Sequence[Any], advantages: float | Sequence[float], *, weight: float = 1.0) -> list[Datum]:
    """The datums of one episode's calls, in the order the agent made them: one datum for each
    run of calls in which every call's prompt extends the one before's prompt + sampled ids.

    ``calls``: what ``RecordedCall.of`` reads (``openai`` responses or choices, or dicts).
    ``advantages``: one for every call, or one per call. ``weight``: each sampled token's weight
    (for example ``1 / sampled tokens in the batch``, to average the loss per token). Each
    datum's ``loss_fn_inputs`` are ``target_tokens``, ``weights``, ``advantages`` and
    ``logprobs`` (the sampler's, for ``importance_sampling`` and ``ppo``): weight and advantage
    are 0 on the first prompt and on the tokens shown between calls."""
    recorded = [RecordedCall.of(c) for c in calls]
    values = _advantages(advantages, len(recorded))
    if not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"merge_calls: weight must be finite and >= 0, got {weight}")
    out: list[Datum] = []
    builder: _Builder | None = None
    last: RecordedCall | None = None
    for call, advantage in zip(recorded, values, strict=True):
        if builder is None or last is None or not last.extended_by(call):
            if builder is not None:
                out.append(builder.datum())
            builder = _Builder(call.prompt_token_ids)
        else:
            shown = call.prompt_token_ids[len(builder.tokens) :]
            builder.add(shown, [0.0] * len(shown), 0.0, 0.0)
        builder.add(call.token_ids, call.token_logprobs, advantage, weight)
        last = call
    if builder is not None:
        out.append(builder.datum())
    return out


def call_datum(call: Any, advantage: float, *, weight: float = 1.0) -> Datum:
    """One call alone as a datum: its prompt (weight 0) and its sampled tokens."""
    return merge_calls([call], [advantage], weight=weight)[0]


__all__ = ["RecordedCall", "call_datum", "merge_calls"]
