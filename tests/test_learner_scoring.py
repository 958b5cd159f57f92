"""The learner's scoring (``scoring.score``) against full-vocabulary logits at every position.

The reference is what the learner computed before: the peft model's own forward, ``B x T x V``
logits, and ``token_logprobs`` (cross-entropy in float32). Checked: values, losses and gradients,
with and without a shared prefix, per-row adapters, the KL reference pass, and small logit chunks
(which also recompute the head in backward).
"""

from __future__ import annotations

import pytest
import torch
from test_learner import LORA, VOCAB, tiny_model

from polytinker.engine.learner import LearnerConfig, MultiAdapterLearner, scoring
from polytinker.engine.learner.losses import collate, token_logprobs
from polytinker.engine.learner.scoring import shared_prefix_len
from polytinker.engine.types import Datum

torch.set_num_threads(1)


def grpo_group(seed: int, prompt_len: int = 12, n: int = 5) -> list[Datum]:
    """``n`` completions of one prompt (lengths 1..n+1), prompt positions weighted 0, as GRPO builds them."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g).tolist()
    out = []
    for k in range(n):
        tokens = prompt + torch.randint(1, VOCAB, (k + 2,), generator=g).tolist()
        T = len(tokens) - 1
        weights = [0.0] * (prompt_len - 1) + [1.0] * (T - prompt_len + 1)
        adv = [float(torch.randn(1, generator=g))] * T
        sampling = (-3.0 - torch.rand(T, generator=g)).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], weights, advantages_T=adv, sampling_logprobs_T=sampling))
    return out


def make_learner(share_prefix: bool, kl_coef: float = 0.0, micro_batch_size: int = 8) -> MultiAdapterLearner:
    lrn = MultiAdapterLearner(
        tiny_model(), LearnerConfig(micro_batch_size=micro_batch_size, kl_coef=kl_coef, share_prefix=share_prefix)
    )
    for seed, name in enumerate(("alice", "bob")):
        lrn.add_adapter(name, LORA, seed=seed)
        with torch.no_grad():  # B != 0: the adapters differ from the base and from each other
            for p in lrn._slot(name).params.values():
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed + 100))
    return lrn


def full_logits_logprobs(lrn: MultiAdapterLearner, data: list[Datum], adapter: str) -> list[list[float]]:
    assert lrn.peft_model is not None
    lrn.peft_model.set_adapter(adapter)
    batch = collate(data)
    with torch.no_grad():
        logits = lrn.peft_model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    rows = token_logprobs(logits, batch.targets_BT).tolist()
    return [row[:n] for row, n in zip(rows, batch.lengths_B, strict=True)]


def grads(lrn: MultiAdapterLearner, name: str) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in lrn._slot(name).params.values() if p.grad is not None])


def flat(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row])


def test_shared_prefix_len() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 3, 9, 9], [1, 2, 3, 4, 5]])
    assert shared_prefix_len(ids, [4, 5, 5]) == 3
    assert shared_prefix_len(ids[[0, 2]], [4, 5]) == 3  # each row keeps at least one token of its own
    assert shared_prefix_len(ids[:1], [4]) == 0
    assert shared_prefix_len(torch.tensor([[1, 2], [3, 2]]), [2, 2]) == 0


@pytest.mark.parametrize("share_prefix", [True, False])
def test_forward_equals_full_vocabulary_logits(share_prefix: bool) -> None:
    lrn = make_learner(share_prefix, micro_batch_size=4)
    data = grpo_group(0, n=4) + grpo_group(1, prompt_len=9, n=4)  # two prompts, one micro-batch each
    data = [data[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]  # interleaved: the learner sorts them back together
    for adapter in ("alice", "bob"):
        ours = lrn.forward(data, adapter)
        ref = [full_logits_logprobs(lrn, [d], adapter)[0] for d in data]
        assert [len(r) for r in ours] == [len(d.input_tokens) for d in data]
        torch.testing.assert_close(flat(ours), flat(ref), rtol=1e-5, atol=1e-5)


def test_shared_prefix_forward_backward_equals_the_full_pass() -> None:
    data = grpo_group(2) + grpo_group(3, n=4)
    out = {}
    for share in (False, True):
        lrn = make_learner(share, kl_coef=0.05, micro_batch_size=5)
        result = lrn.forward_backward(data, "ppo", "alice")
        out[share] = (result, grads(lrn, "alice"))
    assert out[True][0].loss == pytest.approx(out[False][0].loss, rel=1e-5, abs=1e-6)
    assert out[True][0].metrics == pytest.approx(out[False][0].metrics, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(flat(out[True][0].logprobs), flat(out[False][0].logprobs), rtol=1e-5, atol=1e-5)
    assert out[True][1].abs().sum() > 0
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-4, atol=1e-6)


def test_forward_backward_logprobs_and_gradients_equal_full_logits() -> None:
    """Against the reference loss built from full logits (autograd through every position)."""
    data = grpo_group(4)
    lrn = make_learner(True)
    result = lrn.forward_backward(data, "importance_sampling", "bob")
    ours = grads(lrn, "bob")
    for p in lrn._slot("bob").params.values():
        p.grad = None
    assert lrn.peft_model is not None
    lrn.peft_model.set_adapter("bob")
    batch = collate(data)
    logits = lrn.peft_model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    logp_BT = token_logprobs(logits, batch.targets_BT)
    ratio_BT = torch.exp(logp_BT - batch.sampling_logprobs_BT)
    loss = -(batch.weights_BT * ratio_BT * batch.advantages_BT).sum()
    loss.backward()
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-6)
    ref_rows = [row[:n] for row, n in zip(logp_BT.tolist(), batch.lengths_B, strict=True)]
    torch.testing.assert_close(flat(result.logprobs), flat(ref_rows), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, grads(lrn, "bob"), rtol=1e-4, atol=1e-6)


def test_mixed_adapters_with_a_shared_prefix_equal_one_call_per_adapter() -> None:
    data = {"alice": grpo_group(5, n=3), "bob": grpo_group(5, n=3)[:2]}  # one prompt, both adapters
    separate = make_learner(False, kl_coef=0.1)
    expected = {name: separate.forward_backward(d, "ppo", name) for name, d in data.items()}
    mixed = make_learner(True, kl_coef=0.1)
    got = mixed.forward_backward_many(data, "ppo")
    for name in data:
        assert got[name].loss == pytest.approx(expected[name].loss, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(flat(got[name].logprobs), flat(expected[name].logprobs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads(mixed, name), grads(separate, name), rtol=1e-4, atol=1e-6)


def test_micro_batches_keep_each_adapters_prompt_whole_and_mix_adapters_only_where_rows_share_nothing() -> None:
    def tokens(seed: int, n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    short, long = tokens(1, 30), tokens(2, 200)  # two agents' prompts: a solver's and a verifier's
    rows = [("solver", short + tokens(10 + k, 6)) for k in range(6)]
    rows += [("verifier", long + tokens(20 + k, 40)) for k in range(5)]
    plan = scoring.plan_micro_batches(rows, size=32, max_tokens=1 << 20)
    assert sorted(i for batch in plan for i in batch) == list(range(len(rows)))
    assert sorted(sorted(batch) for batch in plan) == [list(range(6)), list(range(6, 11))]
    # the cost the planner avoided: one padded pass over all rows against the two prefix passes
    together = scoring.pass_cost(0, [len(t) for _, t in rows], 2)
    apart = scoring.pass_cost(30, [36] * 6, 1) + scoring.pass_cost(200, [240] * 5, 1)
    assert together > 4 * apart
    # rows that share nothing fill micro-batches whichever adapter they belong to, up to the size
    unrelated = [(("alice", "bob")[k % 2], tokens(100 + k, 20)) for k in range(10)]
    plan = scoring.plan_micro_batches(unrelated, size=4, max_tokens=1 << 20)
    assert [len(b) for b in plan] == [4, 4, 2]
    assert any(len({unrelated[i][0] for i in b}) == 2 for b in plan)
    # one prompt answered by two adapters, two rows each: each adapter's rows together and alone
    # (its prefix once, its suffixes packed), not one micro-batch padding every suffix
    both = [(name, short + tokens(50 + k, 4)) for k, name in enumerate(("alice", "bob", "alice", "bob"))]
    assert sorted(sorted(b) for b in scoring.plan_micro_batches(both, size=8, max_tokens=1 << 20)) == [[0, 2], [1, 3]]
    # a lone row of each adapter shares no prefix with its own adapter's rows: the two mix
    lone = [("alice", short + tokens(60, 4)), ("bob", short + tokens(61, 4))]
    assert scoring.plan_micro_batches(lone, size=8, max_tokens=1 << 20) == [sorted(range(2), key=lambda i: lone[i][1])]


def test_a_pass_holds_at_most_max_tokens_positions_whatever_the_datum_count() -> None:
    """Memory follows tokens: 32 long datums split into passes of at most max_tokens decoder
    positions (a shared prompt counted once); short ones still fill a micro-batch."""

    def tokens(seed: int, n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    unrelated = [tokens(k, 600) for k in range(32)]
    plan = scoring.token_micro_batches(unrelated, 32, 4096)
    assert [len(b) for b in plan] == [6, 6, 6, 6, 6, 2]
    assert sorted(i for b in plan for i in b) == list(range(32))
    prompt = tokens(99, 500)  # a GRPO group: one 500-token prompt, 16 answers of 20 tokens
    group = [prompt + tokens(200 + k, 20) for k in range(16)]
    assert scoring.token_micro_batches(group, 32, 4096) == [list(range(16))]  # 500 + 16 x 20 positions
    assert scoring.token_micro_batches([tokens(7, 5000), *unrelated[:2]], 32, 4096) == [[0], [1, 2]]
    rows = [("a" if k % 2 else "b", t) for k, t in enumerate(unrelated)]
    for batch in scoring.plan_micro_batches(rows, 32, 4096):
        assert scoring.pass_cost(0, [len(rows[i][1]) for i in batch], 2) <= 4096
    assert scoring.token_micro_batches(unrelated[:4], 2, 1 << 20) == [[0, 1], [2, 3]]  # the size still bounds


def test_head_runs_in_chunks_and_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    data = grpo_group(6, prompt_len=10, n=6)
    reference = make_learner(False)
    expected = reference.forward_backward(data, "importance_sampling", "alice")
    monkeypatch.setattr(scoring, "LOGIT_CHUNK", 4)  # several chunks: the head is recomputed in backward
    lrn = make_learner(True)
    assert lrn.peft_model is not None
    rows: list[int] = []
    head = lrn.peft_model.get_base_model().get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    result = lrn.forward_backward(data, "importance_sampling", "alice")
    handle.remove()
    assert max(rows) <= 4
    # Each distinct hidden row is scored once: without gradient the 9 unweighted prompt positions;
    # with gradient the last prompt position (shared by every row) and each row's own tokens, twice
    # (forward, and the recomputation in backward).
    differentiable = 1 + sum(len(d.input_tokens) - 10 for d in data)
    assert sum(rows) == 9 + 2 * differentiable
    assert result.loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(flat(result.logprobs), flat(expected.logprobs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads(lrn, "alice"), grads(reference, "alice"), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("share_prefix", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(share_prefix: bool) -> None:
    data = grpo_group(7, n=4)
    out = {}
    for checkpointing in (False, True):
        lrn = MultiAdapterLearner(
            tiny_model(), LearnerConfig(share_prefix=share_prefix, gradient_checkpointing=checkpointing)
        )
        lrn.add_adapter("alice", LORA, seed=1)
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = lrn.forward_backward(data, "importance_sampling", "alice")
        out[checkpointing] = (result, grads(lrn, "alice"), sum(saved))
        assert lrn.peft_model is not None
        layers = lrn.peft_model.get_base_model().get_decoder().layers
        assert all("forward" not in vars(layer) for layer in layers)  # the layers are restored
    assert out[True][2] < out[False][2]  # fewer activations kept for backward
    assert out[True][0].loss == pytest.approx(out[False][0].loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-5, atol=1e-7)


def test_one_adapter_runs_the_prefix_once_and_the_suffixes_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    data = grpo_group(8, prompt_len=12, n=4)  # own tokens per row: 1, 2, 3, 4 (input = prompt + k + 1)
    lrn = make_learner(True)
    assert lrn.peft_model is not None
    decoder = lrn.peft_model.get_base_model().get_decoder()
    shapes: list[tuple[int, ...]] = []
    handle = decoder.register_forward_pre_hook(
        lambda _m, _args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    lrn.forward_backward(data, "importance_sampling", "alice")
    # four completions of 4 tokens each, two per adapter
    last = data[3]
    same_length = []
    for j in range(4):
        tokens, targets = list(last.input_tokens), list(last.target_tokens_T)
        tokens[-1] = targets[-2] = 1 + j
        same_length.append(Datum(tokens, targets, last.weights_T, last.advantages_T, last.sampling_logprobs_T))
    lrn.forward_backward_many({"alice": same_length[:2], "bob": same_length[2:]}, "importance_sampling")
    handle.remove()
    own = sum(len(d.input_tokens) - 12 for d in data)
    # One adapter: prefix once, then every row's own tokens unpadded in one row. Two adapters in
    # one call: the same for each adapter's rows on their own (MultiAdapterLearner._mixed_chunks).
    # (The four rows differ only in their last token: all the rest is their shared prefix.)
    prefix = len(last.input_tokens) - 1
    assert shapes == [(1, 12), (1, own), (1, prefix), (1, 2), (1, prefix), (1, 2)]
