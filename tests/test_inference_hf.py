"""The hf backend: mixed batches, sampling parameters, logprobs, adapters (tiny model; the
real model in the slow tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from polytinker.engine.adapter_weights import AdapterWeights
from polytinker.engine.inference import random_adapter, render_prompt, write_adapter_dir
from polytinker.engine.inference.config import HFBackendConfig
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.models import DEFAULT_MODEL, TINY_RANDOM, load_model
from polytinker.engine.types import AdapterRef, FinishReason, LoraConfig, SampleRequest, SamplingParams
from polytinker.errors import ConfigError, ModelError

CHAT = ({"role": "user", "content": "What is the capital of France?"},)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
REFS = [AdapterRef("a"), AdapterRef("b"), AdapterRef("c")]


@pytest.fixture(scope="module")
def backend() -> Iterator[HFBackend]:
    torch.set_num_threads(1)  # cores are shared; one thread avoids OpenMP spin contention
    b = HFBackend(HFBackendConfig(model=TINY_RANDOM))
    for i, ref in enumerate(REFS):
        b.load_adapter(random_adapter(b.model, ref, seed=i, scale=0.1))
    yield b
    b.close()


def _greedy(adapter: AdapterRef | None, params: SamplingParams = GREEDY, num_samples: int = 1) -> SampleRequest:
    return SampleRequest(messages=CHAT, adapter=adapter, params=params, num_samples=num_samples)


def test_mixed_batch_equals_one_adapter_at_a_time(backend: HFBackend) -> None:
    requests = [_greedy(ref) for ref in [None, *REFS, REFS[0]]]
    mixed = backend.sample(requests)
    alone = [backend.sample([r])[0] for r in requests]
    assert [m.sequences[0].token_ids for m in mixed] == [a.sequences[0].token_ids for a in alone]
    assert [m.adapter for m in mixed] == [r.adapter for r in requests]
    # The adapters really change the model: otherwise the comparison above proves nothing.
    assert len({m.sequences[0].token_ids for m in mixed[:4]}) == 4


def test_sampled_logprobs_match_compute_logprobs(backend: HFBackend) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    for ref in (None, REFS[1]):
        result = backend.sample([_greedy(ref, params)])[0]
        seq = result.sequences[0]
        scored = backend.compute_logprobs([result.prompt_token_ids + seq.token_ids], ref)[0]
        assert len(scored) == len(result.prompt_token_ids) + len(seq.token_ids) - 1
        assert scored[-len(seq.token_ids) :] == pytest.approx(seq.logprobs, abs=1e-4)


def test_n_samples_share_one_prefill_and_keep_their_logprobs(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=5, ignore_eos=True)
    requests = [_greedy(ref, params, num_samples=3) for ref in (REFS[0], None, REFS[0])]
    widths: list[int] = []
    forward = backend._forward

    def spy(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        widths.append(int(input_ids.shape[0]))
        return forward(input_ids, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "_forward", spy)
    results = backend.sample(requests)
    assert widths[0] == 2  # one prefill row per distinct (adapter, prompt), not 9
    monkeypatch.undo()
    for request, result in zip(requests, results, strict=True):
        assert len({s.token_ids for s in result.sequences}) > 1
        for seq in result.sequences:  # every row decoded on its own copy of the shared cache
            scored = backend.compute_logprobs([result.prompt_token_ids + seq.token_ids], request.adapter)[0]
            assert scored[-len(seq.token_ids) :] == pytest.approx(seq.logprobs, abs=1e-4)


def test_compute_logprobs_batches_like_single(backend: HFBackend) -> None:
    sequences = [[1, 2, 3, 4, 5], [7, 8], [9]]
    together = backend.compute_logprobs(sequences, REFS[2])
    assert [len(x) for x in together] == [4, 1, 0]
    for seq, values in zip(sequences, together, strict=True):
        assert backend.compute_logprobs([seq], REFS[2])[0] == pytest.approx(values, abs=1e-5)
    with pytest.raises(ConfigError):
        backend.compute_logprobs([[]])


def test_seeded_sampling_ignores_batch_mates(backend: HFBackend) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=50, seed=11, ignore_eos=True)
    alone = backend.sample([_greedy(None, params, num_samples=3)])[0]
    crowded = backend.sample([_greedy(REFS[0]), _greedy(None, params, num_samples=3), _greedy(REFS[1])])[1]
    assert [s.token_ids for s in alone.sequences] == [s.token_ids for s in crowded.sequences]
    assert len(alone.sequences) == 3 and len({s.token_ids for s in alone.sequences}) > 1


def test_top_k_one_is_greedy(backend: HFBackend) -> None:
    top1 = SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    assert backend.sample([_greedy(REFS[0], top1)])[0].sequences[0].token_ids == (
        backend.sample([_greedy(REFS[0])])[0].sequences[0].token_ids
    )


def test_stop_token_and_stop_string_and_length(backend: HFBackend) -> None:
    free = backend.sample([_greedy(None)])[0].sequences[0]
    assert free.finish_reason == FinishReason.LENGTH and len(free.token_ids) == GREEDY.max_tokens
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    by_id = backend.sample([_greedy(None, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_id,)))])
    seq = by_id[0].sequences[0]
    assert seq.token_ids == free.token_ids[: first + 1] and seq.finish_reason == FinishReason.STOP
    stop_text = free.text[len(free.text) // 2 :][:3]
    by_text = backend.sample([_greedy(None, SamplingParams(max_tokens=8, temperature=0, stop=(stop_text,)))])
    seq = by_text[0].sequences[0]
    assert seq.finish_reason == FinishReason.STOP and stop_text not in seq.text
    assert free.text.startswith(seq.text) and len(seq.logprobs) == len(seq.token_ids)


def test_chat_messages_render_with_template(backend: HFBackend) -> None:
    ids = render_prompt(backend.tokenizer, _greedy(None))
    text = backend.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "capital of France" in text
    by_ids = SampleRequest(prompt_token_ids=tuple(ids), params=GREEDY)
    assert backend.sample([by_ids])[0].sequences == backend.sample([_greedy(None)])[0].sequences


def test_multilora_matches_peft(backend: HFBackend) -> None:
    """The slot implementation against peft itself, on the same adapter tensors."""
    from peft import PeftModel, set_peft_model_state_dict

    from polytinker.engine.inference.adapter_io import to_peft_config

    weights = random_adapter(backend.model, AdapterRef("p"), seed=9, scale=0.1)
    backend.load_adapter(weights)
    model, _ = load_model(TINY_RANDOM)
    peft_model = PeftModel(model, to_peft_config(weights.config), adapter_name="p")
    set_peft_model_state_dict(peft_model, weights.tensors, adapter_name="p")
    sequence = [1, 520, 9531, 198, 504, 3458, 282]
    with torch.inference_mode():
        logits = peft_model.eval()(input_ids=torch.tensor([sequence])).logits[0, :-1].log_softmax(-1)
    expected = logits.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0].tolist()
    assert backend.compute_logprobs([sequence], AdapterRef("p"))[0] == pytest.approx(expected, abs=1e-4)
    backend.unload_adapter(AdapterRef("p"))


def test_adapter_dir_replace_unload_and_bad_keys(backend: HFBackend, tmp_path: Path) -> None:
    ref = AdapterRef("d", 1)
    weights = random_adapter(backend.model, ref, seed=5, scale=0.1)
    backend.load_adapter_dir(ref, write_adapter_dir(weights, tmp_path / "d"))
    from_dir = backend.compute_logprobs([[1, 2, 3, 4]], ref)
    backend.load_adapter(weights)  # same version again: replaces in place
    assert backend.compute_logprobs([[1, 2, 3, 4]], ref)[0] == pytest.approx(from_dir[0], abs=1e-6)
    backend.load_adapter(random_adapter(backend.model, ref, seed=6, scale=0.1))
    assert backend.compute_logprobs([[1, 2, 3, 4]], ref)[0] != pytest.approx(from_dir[0], abs=1e-4)
    backend.unload_adapter(ref)
    with pytest.raises(ConfigError, match="not loaded"):
        backend.sample([_greedy(ref)])
    tensors = {**random_adapter(backend.model, AdapterRef("x"), seed=1).tensors}
    tensors["base_model.model.model.nothing.lora_A.weight"] = torch.zeros(2, 2)
    broken = AdapterWeights.pack(AdapterRef("x"), LoraConfig(), tensors)
    with pytest.raises(ModelError, match="nothing"):
        backend.load_adapter(broken)
    assert AdapterRef("x") not in backend.loaded_adapters()


@pytest.fixture(scope="module")
def real_backend() -> Iterator[HFBackend]:
    torch.set_num_threads(1)
    b = HFBackend(HFBackendConfig(model=DEFAULT_MODEL))
    yield b
    b.close()


@pytest.mark.slow
def test_real_model_answers_paris(real_backend: HFBackend) -> None:
    result = real_backend.sample([SampleRequest(messages=CHAT, params=SamplingParams(max_tokens=12, temperature=0))])
    seq = result[0].sequences[0]
    assert "Paris" in seq.text and seq.finish_reason == FinishReason.STOP


@pytest.mark.slow
def test_real_model_mixed_batch_equals_unmixed(real_backend: HFBackend) -> None:
    refs = [AdapterRef(f"r{i}") for i in range(3)]
    for i, ref in enumerate(refs):
        real_backend.load_adapter(random_adapter(real_backend.model, ref, seed=i, scale=0.05))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    requests = [SampleRequest(messages=CHAT, adapter=ref, params=params) for ref in refs]
    mixed = [r.sequences[0].token_ids for r in real_backend.sample(requests)]
    assert mixed == [real_backend.sample([r])[0].sequences[0].token_ids for r in requests]
    assert len(set(mixed)) > 1, "the adapters should steer the model apart"


def test_choices_constrain_the_completion_and_keep_the_models_logprobs(backend: HFBackend) -> None:
    # Answers of different lengths sharing a first token; a random model left alone spells none.
    choices = ((11, 12, 13), (11, 14), (20,))
    seen = set()
    for seed in range(12):
        # A high temperature flattens the draw (each choice's chance ~ p(choice) ** (1 / T)).
        params = SamplingParams(max_tokens=3, temperature=50.0, seed=seed, choices=choices)
        for ref in (None, REFS[0]):
            result = backend.sample([_greedy(ref, params)])[0]
            seq = result.sequences[0]
            assert seq.token_ids in choices and seq.finish_reason is FinishReason.STOP
            seen.add(seq.token_ids)
            scored = backend.compute_logprobs([result.prompt_token_ids + seq.token_ids], ref)[0]
            assert scored[-len(seq.token_ids) :] == pytest.approx(seq.logprobs, abs=1e-4)
    assert seen == set(choices)
    unconstrained = backend.sample([_greedy(None, SamplingParams(max_tokens=3, temperature=1.5, seed=0))])[0]
    assert unconstrained.sequences[0].token_ids not in choices


def test_a_greedy_choice_is_the_likeliest_whole_answer(backend: HFBackend) -> None:
    prompt = backend.sample([_greedy(None, SamplingParams(max_tokens=1, temperature=0))])[0].prompt_token_ids
    choices = ((30, 5, 7), (31, 6), (32,))
    totals = [sum(backend.compute_logprobs([(*prompt, *c)])[0][-len(c) :]) for c in choices]
    for n in (1, 3):  # n rows of one request score their choices apart and agree
        params = SamplingParams(max_tokens=3, temperature=0, choices=choices)
        result = backend.sample([SampleRequest(prompt_token_ids=prompt, params=params, num_samples=n)])[0]
        assert {s.token_ids for s in result.sequences} == {choices[totals.index(max(totals))]}


def test_many_choices_are_scored_in_slices(backend: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    import polytinker.engine.inference.hf as hf

    prompt = tuple(range(5, 25))
    choices = tuple((100 + i, 2) for i in range(40))
    params = SamplingParams(max_tokens=2, temperature=0, choices=choices)
    request = SampleRequest(prompt_token_ids=prompt, params=params)
    whole = backend.sample([request])[0].sequences[0]
    monkeypatch.setattr(hf, "_CHOICE_POSITIONS", 50)  # two choices of 22 positions a pass: 20 passes
    sliced = backend.sample([request])[0].sequences[0]
    assert sliced.token_ids == whole.token_ids
    assert sliced.logprobs == pytest.approx(whole.logprobs, abs=1e-4)


def test_choices_are_checked() -> None:
    with pytest.raises(ConfigError, match="prefix"):
        SamplingParams(max_tokens=4, choices=((1, 2), (1, 2, 3)))
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=2, choices=((1, 2, 3),))
    with pytest.raises(ConfigError, match="token ids"):
        SamplingParams(max_tokens=2, choices=((1, -2),))
    with pytest.raises(ConfigError, match="token ids"):
        SamplingParams(max_tokens=2, choices=((),))


def test_a_choice_longer_than_an_answer_is_refused() -> None:
    with pytest.raises(ConfigError, match="256"):
        SamplingParams(max_tokens=1000, choices=(tuple(range(300)),))
