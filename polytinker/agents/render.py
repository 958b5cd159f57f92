"""Prompts from observations, with the base model's chat template, and datums from samples.

A ``Renderer`` turns one ``PolicyInput`` into prompt token ids: the env's instructions as the
system message (plus the role, when the agent plays several, and the tools it may call), the
agent's own earlier turns (its multi-turn history; never another agent's private view), and the
current observation, with the legal moves listed. The completion the model samples follows the
generation prompt.

With ``history = "full"`` a turn's prompt *continues* the previous one at the token level: the
previous prompt, the tokens the model sampled (tool results included), the end of that
assistant message, then the new observation as a user message. So every prompt of an episode
extends the one before it: the model sees its history exactly as it wrote it (not as the chat
template would re-render its decoded text), and the learner can score all the turns of an
episode as one datum (``polytinker.agents.algorithms.base.turn_chains``). The first turn, and a
turn after one that has no sample (a scripted or timed-out answer), is rendered in full.

``DatumBuilder`` builds the training datum of sampled tokens: the model reads prompt +
completion; only the tokens the model sampled carry weight, so the observation, history and
tool-result tokens are masked out of the loss. ``turn_datum`` is the datum of one turn.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from polytinker.agents.spec import RendererConfig
from polytinker.envs.types import PolicyInput
from polytinker.errors import ConfigError
from polytinker.types import Datum, ModelInput, TensorData

_FIRST_NUMBER = re.compile(r"\d{1,4}")
# Stands for an assistant message's content when the template is asked what follows one.
_CONTENT_MARKER = "\u2063polytinker-content\u2063"


class Renderer:
    """Renders prompts for one agent with a tokenizer's chat template."""

    def __init__(self, tokenizer: Any, config: RendererConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or RendererConfig()

    def user_text(self, inp: PolicyInput) -> str:
        text = inp.observation.text
        moves = self.listed_moves(inp)
        if moves and self.config.numbered_moves:
            listing = "\n".join(f"{i}. {move}" for i, move in enumerate(moves, 1))
            text += f"\nMoves:\n{listing}\nAnswer with the number of your move."
        elif moves:
            text += f"\nLegal moves: {', '.join(moves)}."
        return text

    def listed_moves(self, inp: PolicyInput) -> tuple[str, ...]:
        """The legal moves the prompt lists (none when the env has more than ``max_listed_moves``)."""
        moves = inp.observation.legal_moves
        listed = self.config.list_legal_moves and len(moves) <= self.config.max_listed_moves
        return moves if listed else ()

    def chosen_move(self, inp: PolicyInput, answer: str) -> str:
        """With ``numbered_moves``: the listed move the answer's first number names, or the answer
        itself (the env judges it) when it names none. With ``constrain_moves`` alone: the move
        the answer spells."""
        if self.config.constrain_moves and not self.config.numbered_moves:
            move = answer.strip()  # a choice is the move after a space
            return move if move in inp.observation.legal_moves else answer
        moves = self.listed_moves(inp) if self.config.numbered_moves else ()
        found = _FIRST_NUMBER.search(answer)
        if moves and found and 1 <= int(found.group()) <= len(moves):
            return moves[int(found.group()) - 1]
        return answer

    def choices(self, inp: PolicyInput) -> tuple[tuple[int, ...], ...]:
        """With ``constrain_moves``: the token sequences the answer may be, each the answer's text
        (a listed number with ``numbered_moves``, else a legal move, after a space) and the end of
        the turn; () when unconstrained or the env lists no moves."""
        if not self.config.constrain_moves:
            return ()
        if self.config.numbered_moves:
            answers = [f" {i}" for i in range(1, len(self.listed_moves(inp)) + 1)]
        else:
            answers = [f" {move}" for move in inp.observation.legal_moves]
        end = self.tokenizer.eos_token_id
        if end is None:
            raise ConfigError("constrain_moves needs a tokenizer with an end-of-turn (eos) token")
        unique = dict.fromkeys((*self._encode(text), int(end)) for text in answers)
        return tuple(unique)

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

    def prompt_tokens(self, inp: PolicyInput, tools_text: str = "") -> list[int]:
        """The prompt of one decision; ``tools_text`` (the tools and how to call them) joins the
        system message."""
        if self.config.history == "full":
            continued = self._continued_prompt(inp)
            if continued is not None:
                return continued
        messages = self.messages(inp)
        if tools_text:
            messages[0] = {"role": "system", "content": f"{messages[0]['content']} {tools_text}"}
        return self.encode_messages(messages, answer_start=self.config.answer_prefix)

    def _continued_prompt(self, inp: PolicyInput) -> list[int] | None:
        """The previous turn's prompt and sampled tokens, then the new observation; None when
        there is no previous sample to continue (or the template cannot be continued)."""
        last = inp.history[-1].sample if inp.history else None
        if last is None:
            return None
        user = self.message_tokens("user", self.user_text(inp))
        if user is None:
            return None
        tokens = [*last.prompt_tokens, *last.completion_tokens]
        return tokens + self.end_of_message(tokens) + user + self._encode(self.config.answer_prefix)

    def tool_result_tokens(self, so_far: Sequence[int], result: str) -> list[int]:
        """What the model is shown after a tool call that ends ``so_far``: the end of its message,
        the result as a ``tool_role`` message, the generation prompt of its next message and
        ``answer_prefix_after_tool``."""
        shown = self.message_tokens(self.config.tool_role, result)
        if shown is None:  # a template without that role: the result as a user message
            shown = self.message_tokens("user", f"Tool result: {result}") or self._encode(f"\nTool result: {result}\n")
        return self.end_of_message(so_far) + shown + self._encode(self.config.answer_prefix_after_tool)

    def message_tokens(self, role: str, content: str, generation_prompt: bool = True) -> list[int] | None:
        """The tokens of one message after a conversation (and the generation prompt after it),
        as the template renders them; None when the template's rendering of a conversation does
        not extend its rendering of the conversation before (the prompt is then rendered whole)."""
        try:
            before = self._template_text((("system", "x"),), False)
            after = self._template_text((("system", "x"), (role, content)), generation_prompt)
        except Exception:  # a template that rejects the role (jinja's TemplateError among others)
            return None
        return self._encode(after[len(before) :]) if after.startswith(before) else None

    def end_of_message(self, tokens: Sequence[int]) -> list[int]:
        """What still closes an assistant message whose tokens end ``tokens``: the template's
        end-of-message markup, minus the part the model sampled itself (its stop token)."""
        suffix = self._assistant_suffix
        for k in range(len(suffix), 0, -1):
            if len(tokens) >= k and list(tokens[-k:]) == suffix[:k]:
                return suffix[k:]
        return list(suffix)

    @functools.cached_property
    def _assistant_suffix(self) -> list[int]:
        """The template's markup after an assistant message's content (ChatML: ``<|im_end|>\\n``)."""
        text = self._template_text((("user", "x"), ("assistant", _CONTENT_MARKER)), False)
        return self._encode(text[text.rindex(_CONTENT_MARKER) + len(_CONTENT_MARKER) :])

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one renderer per agent, for the run's life
    def _template_text(self, messages: tuple[tuple[str, str], ...], generation_prompt: bool) -> str:
        """The template's text of (role, content) pairs (a tuple, so that it can be cached)."""
        chat = [{"role": role, "content": content} for role, content in messages]
        return str(self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

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
        return Datum(
            ModelInput.from_ints(tokens[:-1]),
            {"target_tokens": TensorData(tokens[1:], "int64"), "weights": TensorData(weights[1:], "float32")},
        )


class DatumBuilder:
    """A training datum, built left to right: a prompt, then pieces that are either shown to the
    model (weight 0) or sampled by it (weighted, with their advantage and sampling logprobs).

    Positions are those of the targets (the input shifted by one): target ``j`` is token ``j + 1``,
    so each token after the first adds one position, with its own weight."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens = list(prompt)
        n = max(0, len(self.tokens) - 1)
        self.weights_T, self.advantages_T, self.logprobs_T = [0.0] * n, [0.0] * n, [0.0] * n

    def shown(self, tokens: Sequence[int]) -> DatumBuilder:
        """Tokens the model reads but did not write (an observation, a tool result)."""
        return self.sampled(tokens, [0.0] * len(tokens), advantage=0.0, weight=0.0)

    def sampled(
        self,
        tokens: Sequence[int],
        logprobs_T: Sequence[float],
        advantage: float,
        weight: float,
        sampled_T: Sequence[bool] = (),
    ) -> DatumBuilder:
        """A completion: ``weight`` and ``advantage`` on the tokens ``sampled_T`` marks (all of
        them when it is empty), 0 on the others (tool results inside the completion)."""
        for i, (token, logprob) in enumerate(zip(tokens, logprobs_T, strict=True)):
            mine = not sampled_T or sampled_T[i]
            self.tokens.append(token)
            self.weights_T.append(weight if mine else 0.0)
            self.advantages_T.append(advantage if mine else 0.0)
            self.logprobs_T.append(float(logprob) if mine else 0.0)
        return self

    def datum(self) -> Datum:
        return Datum(
            ModelInput.from_ints(self.tokens[:-1]),
            {
                "target_tokens": TensorData(self.tokens[1:], "int64"),
                "weights": TensorData(self.weights_T, "float32"),
                "advantages": TensorData(self.advantages_T, "float32"),
                "logprobs": TensorData(self.logprobs_T, "float32"),  # the sampler's, for the importance ratio
            },
        )


def turn_datum(
    prompt: Sequence[int],
    completion: Sequence[int],
    logprobs_T: Sequence[float],
    advantage: float,
    weight: float,
    sampled_T: Sequence[bool] = (),
) -> Datum:
    """The datum of one sampled turn: ``weight`` on each sampled completion token, 0 on the prompt
    (and on tool results inside the completion)."""
    return DatumBuilder(prompt).sampled(completion, logprobs_T, advantage, weight, sampled_T).datum()


__all__ = ["DatumBuilder", "Renderer", "turn_datum"]
