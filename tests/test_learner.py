"""Learner primitives on a tiny random Llama: losses, many adapters, accumulation, state, full mode, KL."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from polytinker.engine.learner import (
    AdamParams,
    FullParamLearner,
    LearnerConfig,
    LossConfig,
    MultiAdapterLearner,
    make_learner,
)
from polytinker.engine.learner.losses import collate, policy_loss
from polytinker.engine.types import Datum, LoraConfig
from polytinker.errors import ConfigError

torch.set_num_threads(1)
VOCAB = 96
LORA = LoraConfig(rank=4, alpha=8)
ADAM = AdamParams(learning_rate=1e-2)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def make_datum(seed: int, n: int = 10, prompt: int = 4, rl: bool = False) -> Datum:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (n + 1,), generator=g).tolist()
    weights = [0.0] * prompt + [1.0] * (n - prompt)
    if not rl:
        return Datum(tokens[:-1], tokens[1:], weights)
    adv = (torch.randn(n, generator=g)).tolist()
    sampling = (-3.0 - torch.rand(n, generator=g)).tolist()
    return Datum(tokens[:-1], tokens[1:], weights, advantages_T=adv, sampling_logprobs_T=sampling)


def weighted_sum(data: list[Datum], logprobs: list[list[float]]) -> float:
    return sum(lp * w for d, lps in zip(data, logprobs, strict=True) for lp, w in zip(lps, d.weights_T, strict=True))


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture
def learner() -> MultiAdapterLearner:
    lrn = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=3))
    lrn.add_adapter("alice", LORA, seed=1)
    lrn.add_adapter("bob", LORA, seed=2)
    return lrn


def test_forward_matches_manual_logprobs(learner: MultiAdapterLearner) -> None:
    data = [make_datum(i, n=6 + i) for i in range(4)]  # unequal lengths exercise the padding
    got = learner.forward(data, "alice")
    assert [len(x) for x in got] == [len(d.input_tokens) for d in data]
    for d, row in zip(data, got, strict=True):
        with torch.no_grad():
            logits = learner.base_model(torch.tensor([d.input_tokens])).logits[0]  # adapter "alice" active
        expected = torch.log_softmax(logits, -1)[torch.arange(len(d.target_tokens_T)), d.target_tokens_T]
        torch.testing.assert_close(torch.tensor(row), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_forward_loss_is_forward_backwards_loss_without_a_gradient(learner: MultiAdapterLearner, loss_fn: str) -> None:
    data = [make_datum(5, rl=True), make_datum(6, n=7, rl=True)]
    config = {"kl_coef": 0.1}  # the KL term against the base counts in both
    before = snapshot(learner.base_model)
    scored = learner.forward_loss(data, loss_fn, "alice", config)  # type: ignore[arg-type]
    assert all(p.grad is None for p in learner.base_model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in learner.base_model.state_dict().items())
    trained = learner.forward_backward(data, loss_fn, "alice", config)  # type: ignore[arg-type]
    assert math.isclose(scored.loss, trained.loss, rel_tol=1e-5, abs_tol=1e-6)
    assert scored.metrics.keys() == trained.metrics.keys() and scored.metrics["kl/coef"] == 0.1
    for key, value in scored.metrics.items():
        assert math.isclose(value, trained.metrics[key], rel_tol=1e-5, abs_tol=1e-6), key
    torch.testing.assert_close(torch.tensor(scored.logprobs[1]), torch.tensor(trained.logprobs[1]))
    with pytest.raises(ConfigError, match="advantages"):
        learner.forward_loss([make_datum(7)], "ppo", "alice")


def test_cross_entropy_is_weighted_sum_and_masks_prompt(learner: MultiAdapterLearner) -> None:
    data = [make_datum(0), make_datum(1)]
    result = learner.forward_backward(data, "cross_entropy", "alice")
    expected = -sum(
        lp * w for d, lps in zip(data, result.logprobs, strict=True) for lp, w in zip(lps, d.weights_T, strict=True)
    )
    assert math.isclose(result.loss, expected, rel_tol=1e-5)
    assert result.metrics["loss/tokens"] == 12.0


def test_losses_against_formulas() -> None:
    data = [make_datum(3, rl=True), make_datum(4, rl=True)]
    batch = collate(data)
    logp_BT = (-3.5 + 0.3 * torch.randn(batch.weights_BT.shape)).requires_grad_()
    w, a, s = batch.weights_BT, batch.advantages_BT, batch.sampling_logprobs_BT
    ratio = torch.exp(logp_BT - s)
    is_loss, _ = policy_loss("importance_sampling", logp_BT, batch, LossConfig())
    torch.testing.assert_close(is_loss, -(w * ratio * a).sum())
    cfg = LossConfig.from_mapping({"clip_epsilon": 0.1})
    ppo_loss, extra = policy_loss("ppo", logp_BT, batch, cfg)
    clipped = torch.clamp(ratio, 0.9, 1.1)
    torch.testing.assert_close(ppo_loss, -(w * torch.minimum(ratio * a, clipped * a)).sum())
    assert 0 < extra["clipped_tokens"] <= float((w != 0).sum())
    # cispo: the clipped ratio is a constant weight on the log-likelihood gradient.
    cispo_loss, extra = policy_loss("cispo", logp_BT, batch, cfg)
    torch.testing.assert_close(cispo_loss, -(w * clipped.detach() * a * logp_BT).sum())
    (grad,) = torch.autograd.grad(cispo_loss, logp_BT)
    torch.testing.assert_close(grad, -(w * clipped.detach() * a))  # no gradient through the ratio
    assert 0 < extra["clipped_tokens"] <= float((w != 0).sum())
    dro_loss, _ = policy_loss("dro", logp_BT, batch, LossConfig.from_mapping({"beta": 0.3}))
    torch.testing.assert_close(dro_loss, -(w * (logp_BT * a - 0.15 * (logp_BT - s) ** 2)).sum())
    # With zero advantages the policy-gradient losses have no gradient at all.
    zero = collate(
        [Datum(d.input_tokens, d.target_tokens_T, d.weights_T, [0.0] * 10, d.sampling_logprobs_T) for d in data]
    )
    policy_loss("ppo", logp_BT, zero, cfg)[0].backward()
    assert logp_BT.grad is not None and torch.count_nonzero(logp_BT.grad) == 0


def test_the_sampler_logprob_gap_is_reported() -> None:
    batch = collate([make_datum(3, rl=True), make_datum(4, rl=True)])
    mask = (batch.weights_BT != 0).float()
    gap = 0.2 * torch.sign(torch.randn(batch.weights_BT.shape))  # the learner +-0.2 nats off the sampler
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        _, sums = policy_loss(loss_fn, batch.sampling_logprobs_BT + gap, batch, LossConfig())
        tokens = float(mask.sum())
        assert sums["gap_abs_sum"] / tokens == pytest.approx(0.2)
        k3 = ((torch.exp(gap) - 1 - gap) * mask).sum() / tokens  # KL(sampler || learner), estimated
        assert sums["sampler_kl_sum"] / tokens == pytest.approx(float(k3), rel=1e-4) and float(k3) > 0
    _, same = policy_loss("ppo", batch.sampling_logprobs_BT.clone(), batch, LossConfig())
    assert same["gap_abs_sum"] == 0 and same["sampler_kl_sum"] == pytest.approx(0, abs=1e-6)


def test_masked_tokens_get_no_gradient(learner: MultiAdapterLearner) -> None:
    d = make_datum(5)
    fully_masked = Datum(d.input_tokens, d.target_tokens_T, [0.0] * len(d.weights_T))
    learner.forward_backward([fully_masked], "cross_entropy", "alice")
    grads = [p.grad for p in learner._slot("alice").params.values()]
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)


def test_stepping_one_adapter_leaves_other_and_base_bit_identical(learner: MultiAdapterLearner) -> None:
    assert learner.peft_model is not None
    before = snapshot(learner.peft_model)
    learner.forward_backward([make_datum(0), make_datum(1)], "cross_entropy", "bob")  # pending grads on b
    learner.forward_backward([make_datum(2)], "cross_entropy", "alice")
    ref = learner.optim_step(AdamParams(learning_rate=1e-2, weight_decay=0.1), "alice")
    assert (ref.name, ref.version) == ("alice", 1)
    after = snapshot(learner.peft_model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the step changed nothing"
    assert all(".alice." in k and "lora_" in k for k in changed), sorted(changed)[:3]
    # b's gradient survived a's step, and b then steps on its own.
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in learner._slot("bob").params.values())
    assert learner.optim_step(ADAM, "bob").version == 1
    final = snapshot(learner.peft_model)
    base_keys = [k for k in before if "lora_" not in k]
    assert all(torch.equal(before[k], final[k]) for k in base_keys)


def test_gradients_accumulate_until_step() -> None:
    data = [make_datum(i) for i in range(4)]
    one = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=4))
    one.add_adapter("alice", LORA, seed=1)
    one.forward_backward(data, "cross_entropy", "alice")
    one.optim_step(ADAM, "alice")
    split = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=1))
    split.add_adapter("alice", LORA, seed=1)
    split.forward_backward(data[:1], "cross_entropy", "alice")
    split.forward_backward(data[1:], "cross_entropy", "alice")
    split.optim_step(ADAM, "alice")
    w1, w2 = one.export_adapter("alice").tensors, split.export_adapter("alice").tensors
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-5, atol=1e-6)


def test_a_token_budget_splits_a_call_into_passes_with_the_same_result() -> None:
    """max_tokens_per_pass bounds a pass by positions, not datums: 6 datums of 40 tokens under a
    budget of 80 run as three passes, with the loss and the step of one pass."""
    data = [make_datum(i, n=40) for i in range(6)]
    whole = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=8))
    small = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=8, max_tokens_per_pass=80))
    assert len(small.micro_batch_plan([list(d.input_tokens) for d in data])) == 3
    assert len(whole.micro_batch_plan([list(d.input_tokens) for d in data])) == 1
    for lrn in (whole, small):
        lrn.add_adapter("alice", LORA, seed=1)
    losses = [lrn.forward_backward(data, "cross_entropy", "alice").loss for lrn in (whole, small)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for lrn in (whole, small):
        lrn.optim_step(ADAM, "alice")
    w1, w2 = whole.export_adapter("alice").tensors, small.export_adapter("alice").tensors
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-5, atol=1e-6)


def test_training_lowers_the_loss(learner: MultiAdapterLearner) -> None:
    data = [make_datum(i) for i in range(3)]
    first = learner.forward_backward(data, "cross_entropy", "alice").loss
    for _ in range(5):
        learner.optim_step(ADAM, "alice")
        last = learner.forward_backward(data, "cross_entropy", "alice").loss
    assert last < first - 1.0
    # The base model (adapter=None) is untouched by all that.
    base = learner.forward(data, None)
    fresh = learner.forward(data, "bob")  # B = 0 at version 0: equal to the base
    torch.testing.assert_close(torch.tensor(base), torch.tensor(fresh))


def test_kl_term_uses_disabled_adapter_and_is_logged(learner: MultiAdapterLearner) -> None:
    data = [make_datum(i) for i in range(2)]
    at_init = learner.forward_backward(data, "cross_entropy", "alice", {"kl_coef": 0.5})
    assert at_init.metrics["kl/base"] == pytest.approx(0.0, abs=1e-6)  # B = 0: policy == base
    for _ in range(3):
        learner.optim_step(ADAM, "alice")
        moved = learner.forward_backward(data, "cross_entropy", "alice", {"kl_coef": 0.5})
    assert moved.metrics["kl/base"] > 1e-4 and moved.metrics["kl/coef"] == 0.5
    plain = learner.forward(data, "alice")
    ce = -weighted_sum(data, plain)
    assert moved.loss == pytest.approx(ce + 0.5 * moved.metrics["kl/base"] * moved.metrics["loss/tokens"], rel=1e-4)


def test_save_and_load_state_round_trip(learner: MultiAdapterLearner, tmp_path) -> None:
    data = [make_datum(i) for i in range(2)]
    learner.forward_backward(data, "cross_entropy", "alice")
    learner.optim_step(ADAM, "alice")
    path = learner.save_state(tmp_path / "ckpt", "alice")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"
    learner.forward_backward(data, "cross_entropy", "alice")
    expected_ref = learner.optim_step(ADAM, "alice")
    expected = learner.export_adapter("alice").tensors
    # A fresh learner restores weights, AdamW moments and version, and takes the identical next step.
    other = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=3))
    assert other.load_state(path, "alice").version == 1
    other.forward_backward(data, "cross_entropy", "alice")
    assert other.optim_step(ADAM, "alice") == expected_ref
    got = other.export_adapter("alice").tensors
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # Weights only (Tinker's load_state): the optimizer starts afresh, so the next step differs.
    fresh = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=3))
    fresh.load_state(path, "alice", optimizer=False)
    assert fresh._slot("alice").optimizer is None
    fresh.forward_backward(data, "cross_entropy", "alice")
    fresh.optim_step(ADAM, "alice")
    moved = fresh.export_adapter("alice").tensors
    assert any(not torch.equal(expected[k], moved[k]) for k in expected)
    learner.save_state(path, "bob")  # overwriting an existing checkpoint is atomic too
    assert learner.load_state(path, "alice").version == 0


def test_export_adapter_dir_loads_in_peft(learner: MultiAdapterLearner, tmp_path) -> None:
    from peft import PeftModel

    learner.forward_backward([make_datum(0)], "cross_entropy", "alice")
    learner.optim_step(ADAM, "alice")
    weights = learner.export_adapter("alice")
    assert weights.ref.version == 1 and all(t.device.type == "cpu" for t in weights.tensors.values())
    assert all(k.startswith("base_model.model.") and ".alice." not in k for k in weights.tensors)
    from peft import get_peft_model_state_dict

    reference = get_peft_model_state_dict(learner.peft_model, adapter_name="alice")
    assert set(reference) == set(weights.tensors)
    assert all(torch.equal(reference[k], weights.tensors[k]) for k in reference)
    out = learner.export_adapter_dir("alice", tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(tiny_model(), str(out))
    data = [make_datum(7)]
    with torch.no_grad():
        logits = loaded(torch.tensor([data[0].input_tokens])).logits[0]
    got = torch.log_softmax(logits, -1)[torch.arange(10), data[0].target_tokens_T]
    torch.testing.assert_close(got, torch.tensor(learner.forward(data, "alice")[0]), rtol=1e-5, atol=1e-5)


def test_add_remove_and_errors(learner: MultiAdapterLearner) -> None:
    with pytest.raises(ConfigError, match="already exists"):
        learner.add_adapter("alice", LORA)
    learner.remove_adapter("alice")
    assert [r.name for r in learner.adapters()] == ["bob"]
    with pytest.raises(ConfigError, match="unknown adapter"):
        learner.forward_backward([make_datum(0)], "cross_entropy", "alice")
    with pytest.raises(ConfigError, match="pass adapter"):
        learner.optim_step(ADAM, None)
    with pytest.raises(ConfigError, match="advantages_T"):
        learner.forward_backward([make_datum(0)], "ppo", "bob")
    with pytest.raises(ConfigError, match="unknown loss_fn_config"):
        learner.forward_backward([make_datum(0)], "cross_entropy", "bob", {"clip": 0.2})
    with pytest.raises(ConfigError):
        AdamParams(beta1=1.0)


def test_full_param_mode_trains_every_weight(tmp_path) -> None:
    lrn = make_learner(tiny_model(), LearnerConfig(mode="full"))
    assert isinstance(lrn, FullParamLearner)
    before = snapshot(lrn.base_model)
    data = [make_datum(i, rl=True) for i in range(2)]
    result = lrn.forward_backward(data, "importance_sampling")
    assert math.isfinite(result.loss)
    assert lrn.optim_step(ADAM).version == 1
    after = snapshot(lrn.base_model)
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    path = lrn.save_state(tmp_path / "full")
    other = FullParamLearner(tiny_model())
    assert other.load_state(path).version == 1
    assert all(torch.equal(after[k], v) for k, v in snapshot(other.base_model).items())
    with pytest.raises(ConfigError, match="mode='lora'"):
        lrn.forward_backward(data, "ppo", None, {"kl_coef": 0.1})


def test_per_token_normalisation_divides_by_weighted_tokens() -> None:
    data = [make_datum(i) for i in range(3)]  # 6 weighted tokens each
    norms = {}
    for mode in ("sum", "per_token"):
        lrn = MultiAdapterLearner(tiny_model(), LearnerConfig(grad_normalization=mode))  # type: ignore[arg-type]
        lrn.add_adapter("alice", LORA, seed=1)
        lrn.forward_backward(data[:1], "cross_entropy", "alice")
        lrn.forward_backward(data[1:], "cross_entropy", "alice")
        lrn.optim_step(ADAM, "alice")
        assert lrn.last_step_metrics["optim/tokens"] == 18.0
        norms[mode] = lrn.last_step_metrics["optim/grad_norm"]
    assert norms["per_token"] == pytest.approx(norms["sum"] / 18.0, rel=1e-5)


def test_a_failed_checkpoint_write_leaves_the_old_one_whole(learner: MultiAdapterLearner, tmp_path) -> None:
    from polytinker.engine.learner.state import load_checkpoint, write_atomic_dir

    path = learner.save_state(tmp_path / "ckpt", "alice")
    before = load_checkpoint(path).tensors

    def crash(tmp: Path) -> None:
        (tmp / "weights.safetensors").write_bytes(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic_dir(path, crash)
    after = load_checkpoint(path).tensors
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_mixed_adapter_pass_matches_one_call_per_adapter() -> None:
    data = {"alice": [make_datum(i, rl=True) for i in range(3)], "bob": [make_datum(10 + i, rl=True) for i in range(2)]}
    results, weights = [], []
    for mixed in (False, True):
        lrn = MultiAdapterLearner(tiny_model(), LearnerConfig(micro_batch_size=2, kl_coef=0.1))
        for seed, name in enumerate(data):
            lrn.add_adapter(name, LORA, seed=seed)
        for _ in range(2):  # the second round runs with B != 0, so adapters differ from the base
            if mixed:
                out = lrn.forward_backward_many(data, "ppo")  # micro-batches mix alice and bob rows
            else:
                out = {name: lrn.forward_backward(d, "ppo", name) for name, d in data.items()}
            for name in data:
                lrn.optim_step(ADAM, name)
        results.append(out)
        weights.append({name: lrn.export_adapter(name).tensors for name in data})
    for name in data:
        assert results[1][name].loss == pytest.approx(results[0][name].loss, rel=1e-4, abs=1e-5)
        assert results[1][name].metrics.keys() == results[0][name].metrics.keys()
        torch.testing.assert_close(
            torch.tensor([x for row in results[1][name].logprobs for x in row]),
            torch.tensor([x for row in results[0][name].logprobs for x in row]),
        )
        for k, v in weights[0][name].items():
            torch.testing.assert_close(weights[1][name][k], v, rtol=1e-4, atol=1e-6)


def test_the_package_and_its_config_import_without_torch() -> None:
    """A client that builds AdamParams / LearnerConfig must not pay for torch, transformers and peft."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from polytinker.engine.learner import AdamParams, LearnerConfig\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from polytinker.engine.learner import MultiAdapterLearner, make_learner\n"
        "assert 'peft' in sys.modules and MultiAdapterLearner.__name__ == 'MultiAdapterLearner'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_slots_adamw_is_fused_and_steps_as_the_per_tensor_loop() -> None:
    from polytinker.engine.learner._base import new_adamw

    torch.manual_seed(0)
    shapes = [(16, 64), (64, 16), (3,)]
    fused_params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    loop_params = [torch.nn.Parameter(p.detach().clone()) for p in fused_params]
    start = [p.detach().clone() for p in fused_params]
    fused = new_adamw(fused_params, lr=1e-2)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, foreach=False)
    assert fused.defaults["fused"] is True
    for _ in range(3):
        for a, b in zip(fused_params, loop_params, strict=True):
            grad = torch.randn_like(a)
            a.grad, b.grad = grad, grad.clone()
        fused.step()
        loop.step()
    for a, b, a0 in zip(fused_params, loop_params, start, strict=True):
        assert not torch.equal(a, a0)  # the steps moved it
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A per-tensor AdamW's saved state (a checkpoint written before this change) loads into it.
    restored = new_adamw([torch.nn.Parameter(p.detach().clone()) for p in loop_params])
    restored.load_state_dict(loop.state_dict())
    assert restored.state_dict()["state"][0]["exp_avg"].shape == (16, 64)
