"""Multi-turn prompts that continue each other, and an episode's turns merged into one datum."""

from __future__ import annotations

import numpy as np
import pytest

from polytinker.agents.algorithms import GRPO
from polytinker.agents.algorithms.base import turn_chains
from polytinker.agents.render import Renderer
from polytinker.agents.spec import AlgorithmConfig, RendererConfig
from polytinker.agents.types import TurnSample
from polytinker.client._convert import to_datum
from polytinker.engine.models import load_tokenizer
from polytinker.envs.types import ModelSample, PolicyInput, TextObservation, Turn


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _inp(text: str, history: tuple[Turn, ...] = ()) -> PolicyInput:
    return PolicyInput("player_0", "ep", "guess_number-v0", "Find the number.", TextObservation(text), history)


def _answer(renderer: Renderer, inp: PolicyInput, text: str, eos: bool = True) -> Turn:
    tok = renderer.tokenizer
    completion = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    sample = ModelSample("a", 0, tuple(renderer.prompt_tokens(inp)), tuple(completion), (-0.5,) * len(completion))
    return Turn(inp.observation, text, sample=sample)


def test_each_prompt_continues_the_previous_prompt_and_completion(tokenizer):
    renderer = Renderer(tokenizer, RendererConfig(answer_prefix="Guess:"))
    first = _inp("Guess 1 of 3:")
    turn = _answer(renderer, first, " 4")
    second = _inp("4: higher\nGuess 2 of 3:", (turn,))
    prompt = renderer.prompt_tokens(second)
    before = [*turn.sample.prompt_tokens, *turn.sample.completion_tokens]
    assert prompt[: len(before)] == before
    text = tokenizer.decode(prompt)
    assert text.endswith("<|im_start|>user\n4: higher\nGuess 2 of 3:<|im_end|>\n<|im_start|>assistant\nGuess:")
    # A completion cut by max_tokens (no stop token) gets the end of its message added.
    cut = _answer(renderer, first, " 4", eos=False)
    text = tokenizer.decode(renderer.prompt_tokens(_inp("next", (cut,))))
    assert "Guess: 4<|im_end|>\n<|im_start|>user\nnext" in text


def test_a_turn_without_a_sample_renders_the_whole_conversation(tokenizer):
    renderer = Renderer(tokenizer, RendererConfig())
    scripted = Turn(TextObservation("Guess 1 of 3:"), "4")  # no sample: a scripted answer
    inp = _inp("4: higher", (scripted,))
    assert renderer.prompt_tokens(inp) == renderer.encode_messages(renderer.messages(inp))
    none = Renderer(tokenizer, RendererConfig(history="none"))
    assert "Guess 1 of 3" not in tokenizer.decode(none.prompt_tokens(inp))


def test_tool_results_are_shown_as_a_tool_message(tokenizer):
    renderer = Renderer(tokenizer, RendererConfig())
    so_far = tokenizer.encode("<calculator>6*7</calculator>", add_special_tokens=False)
    shown = tokenizer.decode(renderer.tool_result_tokens(so_far, "42"))
    assert shown == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    primed = Renderer(tokenizer, RendererConfig(answer_prefix_after_tool="The answer is"))
    assert tokenizer.decode(primed.tool_result_tokens(so_far, "42")) == shown + "The answer is"


def _episode(renderer: Renderer, answers: list[str], episode: str, rewards: list[float]) -> list[TurnSample]:
    history: tuple[Turn, ...] = ()
    out = []
    for index, (answer, reward) in enumerate(zip(answers, rewards, strict=True)):
        inp = PolicyInput("player_0", episode, "g", "Find it.", TextObservation(f"Guess {index + 1}:"), history)
        turn = _answer(renderer, inp, answer)
        history = (*history, turn)
        s = turn.sample
        out.append(
            TurnSample(
                "a", "player_0", 0, "g0", episode, index, s.prompt_tokens, s.completion_tokens, s.logprobs_T, reward, 0
            )
        )
    return out


def _positions(datums):
    """Every weighted position: (the input up to it, its target, weight, advantage, logprob)."""
    out = []
    for d in map(to_datum, datums):  # as the learner reads them
        for j, w in enumerate(d.weights_T):
            if w:
                context = tuple(d.input_tokens[: j + 1])
                out.append((context, d.target_tokens_T[j], w, d.advantages_T[j], d.sampling_logprobs_T[j]))
    return sorted(out)


def test_merged_datums_weigh_the_same_positions_as_one_datum_per_turn(tokenizer):
    renderer = Renderer(tokenizer, RendererConfig())
    samples = _episode(renderer, [" 4", " 6", " 5"], "e1", [0.0, 0.0, 1.0])
    samples += _episode(renderer, [" 2", " 7", " 8"], "e2", [0.0, 0.0, 0.0])
    # Returns 0.5 on every turn: the group's mean, so advantage 0 and nothing to learn.
    samples += _episode(renderer, [" 3", " 1", " 2"], "e3", [0.0, 0.0, 0.5])
    assert turn_chains(samples) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert turn_chains(samples, merge=False) == [[i] for i in range(9)]
    batch = {}
    for merge in (True, False):
        algo = GRPO(AlgorithmConfig(merge_turns=merge, reward_mode="per_turn", normalize_advantages=False))
        advantages = algo.advantages(samples)
        (batch[merge],) = algo.minibatches(samples, advantages, seed=0)
    assert len(batch[True]) == 2 and len(batch[False]) == 6  # the zero-advantage episode drops out
    assert _positions(batch[True]) == _positions(batch[False])
    merged_tokens = sum(len(d.input_tokens) for d in map(to_datum, batch[True]))
    assert merged_tokens < sum(len(d.input_tokens) for d in map(to_datum, batch[False]))
    assert sum(sum(d.weights_T) for d in map(to_datum, batch[True])) == pytest.approx(1.0)


def test_a_chain_is_cut_where_a_prompt_does_not_extend_the_last(tokenizer):
    renderer = Renderer(tokenizer, RendererConfig())
    samples = _episode(renderer, [" 4", " 6", " 5"], "e1", [1.0, 0.0, 1.0])
    broken = samples[2]  # e.g. a template that re-renders earlier turns differently
    samples[2] = TurnSample(**{**broken.__dict__, "prompt_tokens": broken.prompt_tokens[1:]})
    assert turn_chains(samples) == [[0, 1], [2]]


def test_tool_result_tokens_inside_a_completion_carry_no_weight(tokenizer):
    from polytinker.agents.render import turn_datum

    d = to_datum(
        turn_datum([1, 2], [3, 4, 5, 6], [-0.1, 0.0, 0.0, -0.4], 2.0, 0.5, sampled_T=(True, False, False, True))
    )
    assert d.weights_T == [0.0, 0.5, 0.0, 0.0, 0.5]
    assert d.advantages_T == [0.0, 2.0, 0.0, 0.0, 2.0]
    assert np.allclose(d.sampling_logprobs_T, [0.0, -0.1, 0.0, 0.0, -0.4])


class _ScriptedSampler:
    """A stand-in sampling client that answers from a script (the real loop runs in
    test_a_model_calls_the_calculator_through_the_runtime); it records what it was asked."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.calls = tokenizer, list(replies), []

    async def sample_async(self, prompt, num_samples=1, sampling_params=None):
        from polytinker.types import SampledSequence, SampleResponse

        self.calls.append((list(prompt), sampling_params))
        text = self.replies.pop(0)
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        return SampleResponse([SampledSequence("stop", tokens, [-0.25] * len(tokens), text)])


def _players(tokenizer, sampler, max_calls: int = 3, renderer: RendererConfig | None = None):
    from polytinker.agents.rollout import Players
    from polytinker.agents.spec import AgentSpec
    from polytinker.agents.types import Slot, SlotKind
    from polytinker.envs.tools import ToolLimits

    config = renderer or RendererConfig()
    spec = AgentSpec("a", renderer=config)
    players = Players({"a": spec}, {"a": Renderer(tokenizer, config)}, {}, tool_limits=ToolLimits(max_calls))
    players.samplers[("a", 0)] = sampler
    return players.policy({7: {"player_0": Slot(SlotKind.LEARNER, "a")}})


def test_a_tool_call_is_run_and_its_result_shown_then_the_answer_sampled(tokenizer):
    import asyncio

    sampler = _ScriptedSampler(tokenizer, ["<calculator>6*7</calculator>", " 42"])
    inp = PolicyInput("player_0", "ep", "math_tool-v0", "Compute.", TextObservation("6*7 = ?"), seed=7)
    inp = PolicyInput(**{**inp.__dict__, "tools": ("calculator",)})
    action = asyncio.run(_players(tokenizer, sampler)("player_0", inp))
    assert action.text == " 42" and action.meta["tool_calls"] == 1 and action.meta["tool_errors"] == 0
    assert action.meta["tools"] == [{"tool": "calculator", "arguments": "6*7", "result": "42"}]
    first_prompt, first_params = sampler.calls[0]
    assert "<calculator>" in tokenizer.decode(first_prompt)  # the tools are described in the system prompt
    assert first_params.stop == ("</calculator>",)
    sample = action.sample
    shown = [t for t, sampled in zip(sample.completion_tokens, sample.sampled_T, strict=True) if not sampled]
    assert tokenizer.decode(shown) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    second_prompt, _ = sampler.calls[1]
    assert second_prompt == [*sample.prompt_tokens, *sample.completion_tokens[: len(second_prompt) - len(first_prompt)]]
    assert sum(sample.sampled_T) == len(tokenizer.encode("<calculator>6*7</calculator> 42", add_special_tokens=False))


def test_the_prefixes_open_the_call_and_the_answer_after_its_result(tokenizer):
    """answer_prefix may open a call (the model completes it); answer_prefix_after_tool is shown
    after the result. Neither is the model's: both carry no weight, and the env gets the answer."""
    import asyncio

    sampler = _ScriptedSampler(tokenizer, ["6*7</calculator>", " 42."])
    config = RendererConfig(answer_prefix="<calculator>", answer_prefix_after_tool="The answer is")
    inp = PolicyInput("player_0", "ep", "m", "Compute.", TextObservation("6*7 = ?"), seed=7, tools=("calculator",))
    action = asyncio.run(_players(tokenizer, sampler, renderer=config)("player_0", inp))
    assert action.text == " 42."
    assert action.meta["tools"] == [{"tool": "calculator", "arguments": "6*7", "result": "42"}]
    sample = action.sample
    assert tokenizer.decode(sample.prompt_tokens).endswith("<|im_start|>assistant\n<calculator>")
    shown = [t for t, sampled in zip(sample.completion_tokens, sample.sampled_T, strict=True) if not sampled]
    assert tokenizer.decode(shown).endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\nThe answer is")
    written = [t for t, sampled in zip(sample.completion_tokens, sample.sampled_T, strict=True) if sampled]
    assert tokenizer.decode(written) == "6*7</calculator> 42."


def test_calls_past_the_limit_are_not_run(tokenizer):
    import asyncio

    sampler = _ScriptedSampler(tokenizer, ["<calculator>1+1</calculator>", "<calculator>2+2</calculator>"])
    inp = PolicyInput("player_0", "ep", "m", "Compute.", TextObservation("?"), seed=7, tools=("calculator",))
    action = asyncio.run(_players(tokenizer, sampler, max_calls=1)("player_0", inp))
    assert action.meta["tool_calls"] == 1
    assert sampler.calls[1][1].stop is None  # no call left: the second sample must answer (EOS alone stops)
    assert action.text == "<calculator>2+2</calculator>"  # what the env is given to parse


def test_a_minibatch_reaches_the_learner_in_calls_of_the_configured_size():
    """Chunked calls add up to the whole minibatch's loss (the runtime's learner accumulates the
    gradients of calls before an optimizer step: test_train_loop trains through real chunks)."""
    import asyncio

    from polytinker.agents.algorithms import make_algorithm
    from polytinker.agents.config import EnvSetup, ExperimentConfig, TrainConfig
    from polytinker.agents.loop import Learners
    from polytinker.agents.render import turn_datum
    from polytinker.agents.spec import AgentSpec

    class Recorder:  # a stand-in training client: what each call got, its loss the summed weights
        def __init__(self):
            self.sizes = []

        async def forward_backward(self, data, loss_fn, loss_fn_config=None):
            from types import SimpleNamespace

            self.sizes.append(len(data))
            weights = sum(sum(d.weights_T) for d in map(to_datum, data))
            return SimpleNamespace(loss=weights, metrics={"loss/tokens": float(len(data)), "kl/base": 0.5})

    config = ExperimentConfig("c", EnvSetup(), (AgentSpec("a"),), train=TrainConfig(max_datums_per_call=4))
    recorder = Recorder()
    learners = Learners({"a": recorder}, {"a": make_algorithm(config.agents[0].algorithm)}, config)
    batch = [turn_datum([1, 2], [3], [-1.0], 1.0, 0.1) for _ in range(10)]
    loss, metrics = asyncio.run(learners._forward_backward("a", batch))
    assert recorder.sizes == [4, 4, 2]
    assert loss == pytest.approx(1.0) and metrics["kl"] == pytest.approx(0.5 * 10)


def test_numbered_moves_are_listed_and_the_number_answered_names_the_move(tokenizer):
    import asyncio

    from polytinker.agents.rollout import Players
    from polytinker.agents.spec import AgentSpec
    from polytinker.agents.types import Slot, SlotKind

    renderer = Renderer(tokenizer, RendererConfig(numbered_moves=True))
    moves = ("go to cabinet 1", "open drawer 1", "look")
    inp = PolicyInput("player_0", "ep", "tw", "Tidy.", TextObservation("You are in a kitchen.", moves), seed=3)
    assert "Moves:\n1. go to cabinet 1\n2. open drawer 1\n3. look\nAnswer with the number" in renderer.user_text(inp)
    assert renderer.chosen_move(inp, " 2") == "open drawer 1"
    assert renderer.chosen_move(inp, " 9") == " 9"  # no such move: the env refuses it as written
    assert renderer.chosen_move(inp, "look") == "look"
    players = Players({"a": AgentSpec("a")}, {"a": renderer}, {})
    players.samplers[("a", 0)] = _ScriptedSampler(tokenizer, [" 3"])
    action = asyncio.run(players.policy({3: {"player_0": Slot(SlotKind.LEARNER, "a")}})("player_0", inp))
    assert action.text == "look" and action.meta == {"answer": " 3"}
    assert tokenizer.decode(action.sample.completion_tokens) == " 3"  # what the model wrote is trained on


def test_constrained_choices_are_the_moves_then_the_end_of_the_turn(tokenizer):
    moves = ("go to cabinet 1", "open drawer 1", "look")
    inp = PolicyInput("player_0", "ep", "tw", "Tidy.", TextObservation("You are in a kitchen.", moves), seed=3)
    end = tokenizer.eos_token_id
    text = Renderer(tokenizer, RendererConfig(constrain_moves=True))
    choices = text.choices(inp)
    assert [tokenizer.decode(c[:-1]) for c in choices] == [f" {m}" for m in moves]
    assert all(c[-1] == end for c in choices)
    assert text.chosen_move(inp, " open drawer 1") == "open drawer 1"
    numbered = Renderer(tokenizer, RendererConfig(constrain_moves=True, numbered_moves=True))
    assert [tokenizer.decode(c) for c in numbered.choices(inp)] == [f" {i}{tokenizer.eos_token}" for i in (1, 2, 3)]
    assert Renderer(tokenizer, RendererConfig()).choices(inp) == ()
