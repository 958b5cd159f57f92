"""A non-finite loss or gradient is never applied, and a bad datum never reaches the model, on
both learners (tiny-random): a refused ``forward_backward`` leaves the gradient it found bit for
bit, a refused ``optim_step`` leaves weights and AdamW state bit for bit, a batched call keeps
none of its gradients when one member fails, and a data-parallel group drops a call on every rank
when one rank's shard goes non-finite."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from polytinker.engine.learner import AdamParams, FullParamLearner, LearnerConfig, LossConfig, MultiAdapterLearner
from polytinker.engine.learner._base import Learner
from polytinker.engine.learner.group import LearnerGroup
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import Datum, LoraConfig
from polytinker.errors import ConfigError

torch.set_num_threads(1)
LORA = LoraConfig(rank=4, alpha=8)
ADAM = AdamParams(learning_rate=1e-2)
NAN = float("nan")
HUGE = 3e38  # a finite weight whose weighted loss overflows float32: the loss is inf
OVERFLOW = 1e25  # a finite loss and gradient whose squared norm overflows: the grad norm is inf


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return load_model(TINY_RANDOM)[0]


def datum(seed: int, weight: float = 1.0, first: int = 1, n: int = 8, rl: bool = False) -> Datum:
    """``first``: the first input token (a call sorts its datums by their tokens into micro-batches)."""
    g = torch.Generator().manual_seed(seed)
    tokens = [first, *torch.randint(1, 4000, (n,), generator=g).tolist()]
    weights = [0.0] * 2 + [weight] * (n - 2)
    if not rl:
        return Datum(tokens[:-1], tokens[1:], weights)
    return Datum(tokens[:-1], tokens[1:], weights, torch.randn(n, generator=g).tolist(), [-4.0] * n)


def good(seed: int = 0) -> list[Datum]:
    return [datum(seed + i, first=1) for i in range(2)]


def make(base: torch.nn.Module, mode: str, **config: Any) -> tuple[Learner, str | None]:
    """A learner of ``mode`` on a copy of ``base``, and the slot its calls name."""
    config = {"micro_batch_size": 2, **config}
    if mode == "full":
        return FullParamLearner(copy.deepcopy(base), LearnerConfig(mode="full", **config)), None
    lrn = MultiAdapterLearner(copy.deepcopy(base), LearnerConfig(**config))
    for seed, name in enumerate(("alice", "bob", "carol")):
        lrn.add_adapter(name, LORA, seed=seed)
    return lrn, "alice"


def grads(lrn: Learner, slot: str | None) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in lrn._slot(slot).params.values()]


def weights(lrn: Learner, slot: str | None) -> list[torch.Tensor]:
    return [p.detach().clone() for p in lrn._slot(slot).params.values()]


def same(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> bool:
    """Bit for bit, and None where None."""
    return len(a) == len(b) and all(
        x is y or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b, strict=True)
    )


def adam_state(lrn: Learner, slot: str | None) -> list[torch.Tensor]:
    opt = lrn._slot(slot).optimizer
    assert opt is not None
    return [t.clone() for state in opt.state.values() for t in state.values()]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_non_finite_loss_leaves_the_gradient_as_it_was(base: torch.nn.Module, mode: str) -> None:
    lrn, slot = make(base, mode)
    twin, _ = make(base, mode)
    lrn.forward_backward(good(), "cross_entropy", slot)
    twin.forward_backward(good(), "cross_entropy", slot)
    held, tokens = grads(lrn, slot), lrn._slot(slot).pending_tokens
    # Three datums over two micro-batches: the good ones (first token 1) pass first, so their
    # gradient was already in .grad when the bad one's infinite loss came.
    bad = [*good(10), datum(20, weight=HUGE, first=3999)]
    with pytest.raises(ConfigError, match=r"the loss is not finite \(inf\).*this call's gradient was not accumulated"):
        lrn.forward_backward(bad, "cross_entropy", slot)
    assert same(grads(lrn, slot), held) and lrn._slot(slot).pending_tokens == tokens
    # The step is the one the learner would have taken without the refused call, bit for bit.
    lrn.optim_step(ADAM, slot)
    twin.optim_step(ADAM, slot)
    assert same(weights(lrn, slot), weights(twin, slot))
    assert all(torch.isfinite(w).all() for w in weights(lrn, slot))


def test_a_first_call_refused_leaves_no_gradient(base: torch.nn.Module) -> None:
    lrn, slot = make(base, "lora")
    with pytest.raises(ConfigError, match="loss is not finite"):
        lrn.forward_backward([datum(1, weight=HUGE)], "cross_entropy", slot)
    assert all(g is None for g in grads(lrn, slot)) and lrn._slot(slot).pending_tokens == 0.0


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_corrupt_slot_state_is_refused_at_forward_backward(base: torch.nn.Module, mode: str) -> None:
    lrn, slot = make(base, mode)
    with torch.no_grad():
        for p in lrn._slot(slot).params.values():
            p.fill_(NAN)
    with pytest.raises(ConfigError, match=r"the loss is not finite \(nan\)"):
        lrn.forward_backward(good(), "cross_entropy", slot)
    assert all(g is None for g in grads(lrn, slot))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_non_finite_gradient_under_a_finite_loss_is_refused_too(base: torch.nn.Module, mode: str) -> None:
    lrn, slot = make(base, mode)
    lrn.forward_backward(good(), "cross_entropy", slot)
    held = grads(lrn, slot)
    # A backward that overflows somewhere, as a hook on one trained tensor makes it.
    param = next(iter(lrn._slot(slot).params.values()))
    hook = param.register_hook(lambda g: g * NAN)
    with pytest.raises(ConfigError, match=r"the gradient is not finite \(the loss is -?\d.*not accumulated"):
        lrn.forward_backward(good(3), "cross_entropy", slot)
    hook.remove()
    assert same(grads(lrn, slot), held)
    assert lrn.optim_step(ADAM, slot).version == 1 and all(torch.isfinite(w).all() for w in weights(lrn, slot))


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("clip", ["none", "learner", "step"])
@pytest.mark.parametrize("how", ["nan", "overflow"])
def test_a_step_on_a_non_finite_gradient_is_refused(base: torch.nn.Module, mode: str, clip: str, how: str) -> None:
    lrn, slot = make(base, mode, max_grad_norm=1.0 if clip == "learner" else None)
    adam = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0 if clip == "step" else 0.0)
    lrn.forward_backward(good(), "cross_entropy", slot)
    lrn.optim_step(adam, slot)  # the optimizer has state to keep
    metrics = dict(lrn.last_step_metrics)
    if how == "nan":  # a gradient gone bad by a path no check saw
        lrn.forward_backward(good(5), "cross_entropy", slot)
        grad = next(p.grad for p in lrn._slot(slot).params.values() if p.grad is not None)
        grad.view(-1)[0] = NAN
    else:  # finite loss and gradient, but a norm past float32's range
        lrn.forward_backward([datum(5, weight=OVERFLOW)], "cross_entropy", slot)
    before, state, version = weights(lrn, slot), adam_state(lrn, slot), lrn._slot(slot).version
    expected = "nan" if how == "nan" else "inf"
    with pytest.raises(ConfigError, match=rf"norm is not finite \({expected}\); the step was not applied"):
        lrn.optim_step(adam, slot)
    assert same(weights(lrn, slot), before) and same(adam_state(lrn, slot), state)
    assert lrn._slot(slot).version == version and lrn.last_step_metrics == metrics
    assert all(g is None for g in grads(lrn, slot)) and lrn._slot(slot).pending_tokens == 0.0  # dropped
    lrn.forward_backward(good(7), "cross_entropy", slot)  # and the slot trains on
    assert lrn.optim_step(adam, slot).version == version + 1
    assert all(torch.isfinite(w).all() for w in weights(lrn, slot))


def last_token(d: Datum, token: int) -> Datum:
    return Datum([*d.input_tokens[:-1], token], d.target_tokens_T, d.weights_T)


def first_target(d: Datum, token: int) -> Datum:
    return Datum(d.input_tokens, [token, *d.target_tokens_T[1:]], d.weights_T)


def last_weight(d: Datum, weight: float) -> Datum:
    return Datum(d.input_tokens, d.target_tokens_T, [*d.weights_T[:-1], weight])


BAD_DATA: list[tuple[Callable[[Datum], Datum], str]] = [
    (
        lambda d: last_token(d, 49152),
        r"data\[1\]\.input_tokens\[7\] is 49152, outside the model's vocabulary \[0, 49152\)",
    ),
    (lambda d: first_target(d, -1), r"data\[1\]\.target_tokens_T\[0\] is -1, outside"),
    (lambda d: last_weight(d, NAN), r"data\[1\]\.weights_T holds a non-finite value \(nan at position 7\)"),
    (lambda d: last_weight(d, float("-inf")), r"data\[1\]\.weights_T holds a non-finite value \(-inf"),
]


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize(("spoil", "message"), BAD_DATA)
def test_data_the_model_cannot_take_is_refused_before_any_compute(
    base: torch.nn.Module, mode: str, spoil: Callable[[Datum], Datum], message: str
) -> None:
    lrn, slot = make(base, mode)
    with pytest.raises(ConfigError, match=message):
        lrn.forward_backward([datum(1), spoil(datum(2))], "cross_entropy", slot)
    assert all(g is None for g in grads(lrn, slot))


@pytest.mark.parametrize(("spoil", "message"), BAD_DATA)
def test_a_forward_refuses_them_too(base: torch.nn.Module, spoil: Callable[[Datum], Datum], message: str) -> None:
    lrn, slot = make(base, "lora")
    with pytest.raises(ConfigError, match=message):
        lrn.forward([datum(1), spoil(datum(2))], slot)


def test_loss_inputs_are_checked_for_the_loss_that_reads_them(base: torch.nn.Module) -> None:
    lrn, slot = make(base, "lora")
    d = datum(1, rl=True)
    assert d.advantages_T is not None and d.sampling_logprobs_T is not None
    with pytest.raises(ConfigError, match=r"data\[1\]\.advantages_T holds a non-finite value \(inf at position 3\)"):
        adv = [*d.advantages_T[:3], float("inf"), *d.advantages_T[4:]]
        lrn.forward_backward(
            [d, Datum(d.input_tokens, d.target_tokens_T, d.weights_T, adv, d.sampling_logprobs_T)], "ppo", slot
        )
    with pytest.raises(ConfigError, match=r"data\[0\]\.sampling_logprobs_T holds a non-finite value \(nan"):
        lrn.forward_backward(
            [Datum(d.input_tokens, d.target_tokens_T, d.weights_T, d.advantages_T, [NAN] * 8)], "ppo", slot
        )
    with pytest.raises(
        ConfigError, match=r"loss_fn 'importance_sampling' reads data\[0\]\.sampling_logprobs_T, which is missing"
    ):
        lrn.forward_backward(
            [Datum(d.input_tokens, d.target_tokens_T, d.weights_T, d.advantages_T)], "importance_sampling", slot
        )
    assert all(g is None for g in grads(lrn, slot))


@pytest.mark.parametrize("share_prefix", [True, False])
def test_a_batched_call_keeps_none_of_its_gradients_when_one_member_fails(
    base: torch.nn.Module, share_prefix: bool
) -> None:
    lrn, _ = make(base, "lora", share_prefix=share_prefix)
    assert isinstance(lrn, MultiAdapterLearner)
    lrn.forward_backward(good(), "cross_entropy", "alice")  # alice holds a gradient already
    held = {name: grads(lrn, name) for name in ("alice", "bob", "carol")}
    batch = {"alice": good(10), "bob": [datum(30, weight=HUGE)], "carol": good(20)}
    with pytest.raises(ConfigError, match="adapter 'bob': the loss is not finite") as err:
        lrn.forward_backward_many(batch, "cross_entropy")
    assert "'alice'" not in str(err.value) and "'carol'" not in str(err.value)
    assert all(same(grads(lrn, name), g) for name, g in held.items())
    # A member's bad datum fails the batch before any compute, named with its adapter.
    spoiled = {"alice": good(10), "carol": [Datum([1, 60000], [2, 3], [1.0, 1.0])]}
    with pytest.raises(ConfigError, match=r"adapter 'carol': data\[0\]\.input_tokens\[1\] is 60000"):
        lrn.forward_backward_many(spoiled, "cross_entropy")
    assert all(same(grads(lrn, name), g) for name, g in held.items())


def grpo_row(completion: int) -> Datum:
    """One prompt for every row (a prefix the pass may share across adapters), its own completion."""
    prompt = list(range(100, 112))
    tokens = [*prompt, 200 + completion, 7]
    return Datum(tokens[:-1], tokens[1:], [0.0] * 11 + [1.0, 1.0], [0.5] * 13, [-4.0] * 13)


@pytest.mark.parametrize("share_prefix", [True, False])
def test_nan_in_one_adapters_rows_stays_in_them(base: torch.nn.Module, share_prefix: bool) -> None:
    """bob's weights are NaN, so every activation of his rows is; the micro-batch (8 rows, one
    pass) holds alice's and carol's rows too. The check that names each member whose loss or
    gradient is not finite names bob alone: NaN did not cross rows. And the batch-mates, run
    again without him, get what each gets alone."""
    lrn, _ = make(base, "lora", micro_batch_size=8, share_prefix=share_prefix, kl_coef=0.1)
    twin, _ = make(base, "lora", micro_batch_size=8, share_prefix=share_prefix, kl_coef=0.1)
    assert isinstance(lrn, MultiAdapterLearner)
    with torch.no_grad():
        for p in lrn._slot("bob").params.values():
            p.fill_(NAN)
    rows = {name: [grpo_row(100 * i + j) for j in range(2)] for i, name in enumerate(("alice", "bob", "carol"))}
    with pytest.raises(ConfigError, match=r"adapter 'bob': the loss is not finite \(nan\)") as err:
        lrn.forward_backward_many(rows, "ppo")
    assert "'alice'" not in str(err.value) and "'carol'" not in str(err.value)
    mates = {name: rows[name] for name in ("alice", "carol")}
    together = lrn.forward_backward_many(mates, "ppo")
    for name, data in mates.items():
        alone = twin.forward_backward(data, "ppo", name)
        assert together[name].loss == pytest.approx(alone.loss, rel=1e-5)
        torch.testing.assert_close(torch.tensor(together[name].logprobs), torch.tensor(alone.logprobs))
        for a, b in zip(grads(lrn, name), grads(twin, name), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(240)
def test_a_group_drops_a_call_on_every_rank_when_one_ranks_loss_is_not_finite(base: torch.nn.Module) -> None:
    # What one process makes of the good calls alone, first: once this process leads a group, a
    # learner's collectives in it are the group's.
    local, _ = make(base, "lora")
    assert isinstance(local, MultiAdapterLearner)
    local.forward_backward(good(), "cross_entropy", "alice")
    local.forward_backward([datum(40)], "cross_entropy", "bob")
    for name in ("alice", "bob"):
        local.optim_step(ADAM, name)
    expected = {name: local.export_adapter(name).tensors for name in ("alice", "bob")}
    group = LearnerGroup.start(TINY_RANDOM, world_size=2, config=LearnerConfig(micro_batch_size=2))
    try:
        in_group(group)
        for name, tensors in expected.items():
            for k, v in tensors.items():
                torch.testing.assert_close(group.export_adapter(name).tensors[k], v, rtol=1e-5, atol=1e-7)
    finally:
        group.close()


def in_group(group: LearnerGroup) -> None:
    for seed, name in enumerate(("alice", "bob")):
        group.add_adapter(name, LORA, seed=seed)
    group.forward_backward(good(), "cross_entropy", "alice")
    # Rank 0 takes the first two datums (finite), rank 1 the last (infinite loss): rank 0 drops
    # its part too, so the ranks' gradients stay the same.
    with pytest.raises(ConfigError, match=r"the loss is not finite \(inf\).*\(rank 1\)"):
        group.forward_backward([*good(10), datum(30, weight=HUGE)], "cross_entropy", "alice")
    # bob's one datum is on rank 0; rank 1 drops its half of alice's.
    with pytest.raises(ConfigError, match="adapter 'bob': the loss is not finite"):
        group.forward_backward_many({"alice": good(20), "bob": [datum(40, weight=HUGE)]}, "cross_entropy")
    assert group.optim_step(ADAM, "alice").version == 1
    # Stepping on a non-finite norm is refused on every rank alike (a rank without the datum
    # votes too), and the group trains on.
    group.forward_backward([datum(5, weight=OVERFLOW)], "cross_entropy", "alice")
    with pytest.raises(ConfigError, match="norm is not finite"):
        group.optim_step(ADAM, "alice")
    assert group.forward_backward_many({"bob": [datum(40)]}, "cross_entropy")["bob"].metrics["loss/tokens"] == 6.0
    assert group.optim_step(ADAM, "bob").version == 1


@pytest.mark.timeout(240)
def test_a_sharded_full_parameter_group_drops_a_non_finite_call_on_every_rank(base: torch.nn.Module) -> None:
    """FSDP2 sums every pass's gradient over the ranks in backward, so one rank's infinite loss
    reaches every rank's shard: each puts its own shard back."""
    local, _ = make(base, "full", max_grad_norm=1.0)
    local.forward_backward(good(), "cross_entropy")
    local.optim_step(ADAM)
    expected = local.forward(good(50))
    config = LearnerConfig(mode="full", micro_batch_size=1, max_grad_norm=1.0)
    group = LearnerGroup.start(TINY_RANDOM, world_size=2, config=config)
    try:
        assert isinstance(group.learner, FullParamLearner) and group.learner.sharded
        group.forward_backward(good()[:1], "cross_entropy")
        # Rank 0's own loss is finite, but the reduce-scatter brought rank 1's infinite gradient
        # into its shard: it refuses that, and rank 1 its loss.
        with pytest.raises(ConfigError, match=r"the gradient is not finite \(the loss is \d"):
            group.forward_backward([*good(10), datum(30, weight=HUGE)], "cross_entropy")
        group.forward_backward(good()[1:], "cross_entropy")
        group.optim_step(ADAM)
        got = group.forward(good(50))
        group.forward_backward([datum(5, weight=OVERFLOW)], "cross_entropy")
        with pytest.raises(ConfigError, match="norm is not finite"):  # and the clip never ran on it
            group.optim_step(ADAM)
        assert group.forward(good(50)) == got
    finally:
        group.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("make_config", "field"),
    [
        (lambda v: AdamParams(learning_rate=v), "learning_rate"),
        (lambda v: AdamParams(eps=v), "eps"),
        (lambda v: AdamParams(weight_decay=v), "weight_decay"),
        (lambda v: LossConfig(kl_coef=v), "kl_coef"),
        (lambda v: LossConfig(beta=v), "beta"),
        (lambda v: LearnerConfig(kl_coef=v), "kl_coef"),
        (lambda v: LearnerConfig(max_grad_norm=v), "max_grad_norm"),
    ],
)
@pytest.mark.parametrize("value", [NAN, float("inf")])
def test_hyperparameters_that_would_step_to_nan_are_refused(
    make_config: Callable[[float], object], field: str, value: float
) -> None:
    if field == "max_grad_norm" and value == float("inf"):
        assert make_config(value) is not None  # an infinite clip is no clip: allowed
        return
    with pytest.raises(ConfigError, match=field):
        make_config(value)
