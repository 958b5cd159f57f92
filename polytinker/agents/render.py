"""Prompts from observations, with the base model's chat template, and datums from samples.

A ``Renderer`` turns one ``PolicyInput`` into prompt token ids: the env's instructions as the
system message (plus the role, when the agent plays several), the agent's own earlier turns as
user/assistant pairs (its multi-turn history; never another agent's private view), and the
current observation, with the legal moves listed. The completion the model samples follows the
generation prompt.

``turn_datum`` builds the training datum of one sampled turn: the model reads prompt +
completion; only the completion's tokens carry weight, so the observation and history tokens
are masked out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polytinker.agents.spec import RendererConfig
from polytinker.engine.types import Datum
from polytinker.envs.types import PolicyInput


class Renderer:
    """Renders prompts for one agent with a tokenizer's chat template."""

    def __init__(self, tokenizer: Any, config: RendererConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or RendererConfig()

    def user_text(self, inp: PolicyInput) -> str:
        text = inp.observation.text
        moves = inp.observation.legal_moves
        if self.config.list_legal_moves and moves and len(moves) <= self.config.max_listed_moves:
            text += f"\nLegal moves: {', '.join(moves)}."
        return text

    def messages(self, inp: PolicyInput) -> list[dict[str, str]]:
        system = self.config.system_prompt or inp.instructions
        if self.config.name_role:
            system += f" You are {inp.agent}."
        if self.config.system_suffix:
            system += " " + self.config.system_suffix
        messages = [{"role": "system", "content": system}]
        if self.config.history == "full":
            for turn in inp.history:
                messages.append({"role": "user", "content": turn.observation.text})
                messages.append({"role": "assistant", "content": self.config.answer_prefix + turn.action})
        messages.append({"role": "user", "content": self.user_text(inp)})
        return messages

    def encode_messages(
        self, messages: Sequence[dict[str, str]], *, generation_prompt: bool = True, answer_start: str = ""
    ) -> list[int]:
        """The rendered conversation's tokens; ``answer_start`` is text the assistant's answer begins with."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        return list(self.tokenizer.encode(text + answer_start, add_special_tokens=False))

    def prompt_tokens(self, inp: PolicyInput) -> list[int]:
        return self.encode_messages(self.messages(inp), answer_start=self.config.answer_prefix)

    def conversation_datum(self, messages: Sequence[dict[str, str]]) -> Datum:
        """SFT: the whole conversation, with weight only on the assistant messages' tokens.

        Each assistant message is located by rendering the conversation up to it with and
        without it: the tokens between are the message (and its end-of-turn marker)."""
        tokens: list[int] = []
        weights: list[float] = []
        for i, msg in enumerate(messages):
            upto = self.encode_messages(messages[: i + 1], generation_prompt=False)
            if msg["role"] == "assistant":
                before = self.encode_messages(messages[:i], generation_prompt=True)
                start = len(before) if upto[: len(before)] == before else len(tokens)
                weights += [0.0] * (start - len(tokens)) + [1.0] * (len(upto) - start)
            else:
                weights += [0.0] * (len(upto) - len(tokens))
            tokens = upto
        return Datum(input_tokens=tokens[:-1], target_tokens_T=tokens[1:], weights_T=weights[1:])


def turn_datum(
    prompt: Sequence[int],
    completion: Sequence[int],
    logprobs_T: Sequence[float],
    advantage: float,
    weight: float,
) -> Datum:
    """The datum of one sampled turn: ``weight`` on each completion token, 0 on the prompt.

    Positions are those of the targets (the input shifted by one): target ``j`` is token ``j + 1``,
    so the completion's targets start at position ``len(prompt) - 1``."""
    tokens = [*prompt, *completion]
    n_prompt, n_completion = len(prompt) - 1, len(completion)
    return Datum(
        input_tokens=tokens[:-1],
        target_tokens_T=tokens[1:],
        weights_T=[0.0] * n_prompt + [weight] * n_completion,
        advantages_T=[0.0] * n_prompt + [advantage] * n_completion,
        sampling_logprobs_T=[0.0] * n_prompt + [float(x) for x in logprobs_T],
    )


__all__ = ["Renderer", "turn_datum"]
