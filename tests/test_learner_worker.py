"""The learner worker the runtime runs, in a real child process (tiny-random model): called over
its Curve RPC server with the scheduler's messages, it gives the same results as an in-process
``MultiAdapterLearner``, and what it exports is what an engine then scores with. It refuses what its
model cannot take before touching it, and one batch-mate's failure stays with that call."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from _worker import worker_process

from polytinker.engine.inference.adapter_io import read_adapter_dir
from polytinker.engine.inference.hf import HFBackend
from polytinker.engine.learner import AdamParams, LearnerConfig, MultiAdapterLearner
from polytinker.engine.models import TINY_RANDOM, load_model
from polytinker.engine.types import AdapterRef, Datum, LoraConfig
from polytinker.engine.worker import messages as wm
from polytinker.errors import RemoteError
from polytinker.scheduler.service import replies as r
from polytinker.scheduler.service.config import LearnerWorkerConfig
from polytinker.scheduler.service.fb_batcher import FbBatcher

LORA = LoraConfig(rank=4, alpha=8)
ADAM = AdamParams(learning_rate=1e-2)
ALICE = "alice/job/agent"  # an adapter key (tenant/job/agent), as the scheduler names adapters


def data() -> list[Datum]:
    g = torch.Generator().manual_seed(5)
    out = []
    for n in (7, 9):
        tokens = torch.randint(1, 4000, (n + 1,), generator=g).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], [0.0] * 3 + [1.0] * (n - 3)))
    return out


def wire(rows: list[Datum]) -> tuple[Datum, ...]:
    return tuple(rows)


def ensure(adapter: str, version: int = 0) -> wm.EnsureAdapter:
    return wm.EnsureAdapter(adapter, version, rank=LORA.rank, alpha=LORA.alpha, seed=7)


def fb(adapter: str = ALICE) -> wm.LearnerForwardBackward:
    return wm.LearnerForwardBackward(adapter, wire(data()), "cross_entropy")


def step(adapter: str = ALICE) -> wm.LearnerStep:
    return wm.LearnerStep(adapter, ADAM)


def forward(adapter: str, rows: list[Datum]) -> wm.LearnerForward:
    return wm.LearnerForward(adapter, wire(rows))


def local_learner() -> MultiAdapterLearner:
    local = MultiAdapterLearner(load_model(TINY_RANDOM)[0], LearnerConfig(micro_batch_size=4))
    local.add_adapter(ALICE, LORA, seed=7)
    return local


@pytest.mark.timeout(300)
def test_worker_matches_in_process_learner(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    local = local_learner()
    root = tmp_path / "state"
    with worker_process(
        LearnerWorkerConfig(micro_batch_size=4), model=TINY_RANDOM, state_dir=root, run_dir=tmp_path
    ) as learner:
        assert learner.call("sched.w.ensure", ensure(ALICE)) == r.WorkerVersion(0)
        remote_fb = learner.call("sched.w.fb", fb())
        local_fb = local.forward_backward(data(), "cross_entropy", ALICE)
        assert remote_fb.loss == pytest.approx(local_fb.loss, rel=1e-5)
        assert remote_fb.metrics["loss/tokens"] == local_fb.metrics["loss/tokens"] == 10.0
        stepped: r.StepResult = learner.call("sched.w.step", step())
        ref = AdapterRef(ALICE, stepped.version)
        assert ref == local.optim_step(ADAM, ALICE)
        # The worker holds alice at v1 and nothing else: ensuring v1 loads nothing.
        assert learner.call("sched.w.ensure", ensure(ALICE, 1)) == r.WorkerVersion(1)
        stats = learner.call("sched.w.stats", wm.WorkerStats())
        assert (stats["adapters"], stats["loads"], stats["adapters_created"]) == (1, 0, 1)

        # The step wrote what engines load (a peft directory under the worker's state root); an
        # export of the resident version names the same one.
        assert learner.call("sched.w.export", wm.LearnerExport(ALICE, 1)) == r.ExportedWeights(stepped.export_dir)
        exported, expected = read_adapter_dir(ref, root / stepped.export_dir), local.export_adapter(ALICE)
        assert exported.ref == ref and set(exported.config.target_modules) == set(LORA.target_modules)
        assert dataclasses.replace(exported.config, target_modules=LORA.target_modules) == LORA  # peft keeps a set
        assert set(exported.tensors) == set(expected.tensors)
        for k, v in expected.tensors.items():
            torch.testing.assert_close(exported.tensors[k], v, rtol=1e-5, atol=1e-6)

        # Weight sync across the process boundary: an engine loads what the worker exported and
        # scores the probe exactly as the learner does.
        model, tokenizer = load_model(TINY_RANDOM)
        engine = HFBackend(model=model, tokenizer=tokenizer)
        engine.load_adapter(exported)
        probe = data()[1]
        sequence = [*probe.input_tokens, probe.target_tokens_T[-1]]
        torch.testing.assert_close(
            torch.tensor(engine.compute_logprobs([sequence], ref)[0]),
            torch.tensor(learner.call("sched.w.forward", forward(ALICE, [probe])).logprobs[0]),
            rtol=1e-4,
            atol=1e-4,
        )

        saved = learner.call("sched.w.save", wm.LearnerSave(ALICE, "ckpt"))
        assert saved == r.SavedCheckpoint(wm.WeightsRef(ALICE, 1, "checkpoint", "ckpt").relative_path, 1)
        learner.call("sched.w.fb", fb())
        assert learner.call("sched.w.step", step()).version == 2
        loaded = learner.call("sched.w.load", wm.LearnerLoad(ALICE, wm.WeightsRef(ALICE, 1, "checkpoint", "ckpt")))
        assert loaded == r.WorkerVersion(1)
        torch.testing.assert_close(
            torch.tensor(learner.call("sched.w.forward", forward(ALICE, data()[:1])).logprobs[0]),
            torch.tensor(local.forward(data()[:1], ALICE)[0]),
        )
        with pytest.raises(RemoteError, match="adapter bob/job/agent is not resident") as err:
            learner.call("sched.w.step", step("bob/job/agent"))
        assert err.value.remote_type == "NotResident"


BOB = "bob/job/agent"


def other_data() -> list[Datum]:
    g = torch.Generator().manual_seed(11)
    rows = []
    for n in (5, 8, 6):
        tokens = torch.randint(1, 4000, (n + 1,), generator=g).tolist()
        rows.append(Datum(tokens[:-1], tokens[1:], [1.0] * n))
    return rows


@pytest.mark.timeout(300)
def test_worker_batches_agents_calls_with_the_results_of_each_alone(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    local = local_learner()
    local.add_adapter(BOB, LORA, seed=8)
    config = LearnerWorkerConfig(micro_batch_size=4)
    with worker_process(config, model=TINY_RANDOM, state_dir=tmp_path / "state", run_dir=tmp_path) as learner:
        learner.call("sched.w.ensure", ensure(ALICE))
        learner.call("sched.w.ensure", dataclasses.replace(ensure(BOB), seed=8))
        alice = dataclasses.replace(fb(ALICE), request_id="a1")
        bob = wm.LearnerForwardBackward(BOB, wire(other_data()), "cross_entropy", request_id="b1")
        batch = wm.LearnerForwardBackwardMany((alice, bob))
        out: r.ForwardBackwardManyReply = learner.call("sched.w.fb_many", batch)
        # Each adapter's result is what its own call gives, alone, in an in-process learner.
        for got, (name, rows) in zip(out.results, ((ALICE, data()), (BOB, other_data())), strict=True):
            alone = local.forward_backward(rows, "cross_entropy", name)
            assert got.loss == pytest.approx(alone.loss, rel=1e-4)
            assert got.metrics["loss/tokens"] == alone.metrics["loss/tokens"]
            for a, b in zip(got.logprobs, alone.logprobs, strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
        # A resend of the batch is answered from the first run: no second gradient.
        assert learner.call("sched.w.fb_many", dataclasses.replace(batch, attempt=1)) == out
        stats = learner.call("sched.w.stats", wm.WorkerStats())
        assert (stats["batched_forward_backward"], stats["duplicates"]) == (2, 2)
        # Each adapter's gradient and AdamW state are its own: the steps match the local ones.
        for name in (ALICE, BOB):
            stepped = learner.call("sched.w.step", dataclasses.replace(step(name), expected_fb=1))
            assert stepped.version == local.optim_step(ADAM, name).version == 1
            exported = read_adapter_dir(AdapterRef(name, 1), tmp_path / "state" / stepped.export_dir)
            for k, v in local.export_adapter(name).tensors.items():
                torch.testing.assert_close(exported.tensors[k], v, rtol=1e-4, atol=1e-5)
        # An adapter the worker does not hold fails the batch before any work, so nothing is counted.
        stranger = wm.LearnerForwardBackward("carol/job/agent", wire(data()), "cross_entropy", request_id="c1")
        with pytest.raises(RemoteError, match="not resident") as err:
            learner.call(
                "sched.w.fb_many",
                wm.LearnerForwardBackwardMany((dataclasses.replace(alice, request_id="a2"), stranger)),
            )
        assert err.value.remote_type == "NotResident"
        assert learner.call("sched.w.stats", wm.WorkerStats())["batched_forward_backward"] == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_worker_leading_a_group_of_two(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    root = tmp_path / "state"
    config = LearnerWorkerConfig(world_size=2, micro_batch_size=4)
    with worker_process(config, model=TINY_RANDOM, state_dir=root, run_dir=tmp_path, timeout_s=360) as learner:
        learner.call("sched.w.ensure", ensure(ALICE))
        remote = learner.call("sched.w.fb", fb())
        stepped = learner.call("sched.w.step", step())
        # A batch over two adapters, each adapter's rows split over the two ranks.
        learner.call("sched.w.ensure", dataclasses.replace(ensure(BOB), seed=8))
        bob = wm.LearnerForwardBackward(BOB, wire(other_data()), "cross_entropy")
        batched = learner.call("sched.w.fb_many", wm.LearnerForwardBackwardMany((fb(), bob))).results
    exported = read_adapter_dir(AdapterRef(ALICE, stepped.version), root / stepped.export_dir)
    local = local_learner()
    assert remote.loss == pytest.approx(local.forward_backward(data(), "cross_entropy", ALICE).loss, rel=1e-5)
    local.optim_step(ADAM, ALICE)
    for k, v in local.export_adapter(ALICE).tensors.items():
        torch.testing.assert_close(exported.tensors[k], v, rtol=1e-4, atol=1e-6)
    local.add_adapter(BOB, LORA, seed=8)
    for got, (name, rows) in zip(batched, ((ALICE, data()), (BOB, other_data())), strict=True):
        alone = local.forward_backward(rows, "cross_entropy", name)
        assert got.loss == pytest.approx(alone.loss, rel=1e-4)
        assert got.metrics["loss/tokens"] == alone.metrics["loss/tokens"]


def spoiled(rows: list[Datum], **fields: object) -> tuple[Datum, ...]:
    """``rows`` with datum 0's ``fields`` replaced (the values a message may carry, unchecked)."""
    return wire([dataclasses.replace(rows[0], **fields), *rows[1:]])  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_worker_refuses_what_its_model_cannot_take_and_a_non_finite_step(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    local = local_learner()
    config = LearnerWorkerConfig(micro_batch_size=4)
    with worker_process(config, model=TINY_RANDOM, state_dir=tmp_path / "state", run_dir=tmp_path) as learner:
        learner.call("sched.w.ensure", ensure(ALICE))
        rows = data()
        n = len(rows[0].input_tokens)
        rl = {"advantages_T": [1.0] * n, "sampling_logprobs_T": [-3.0] * n}
        refused = [
            (
                spoiled(rows, input_tokens=[1] * (n - 1) + [60000]),
                "cross_entropy",
                r"data\[0\]\.input_tokens\[6\] is 60000",
            ),
            (spoiled(rows, target_tokens_T=[-5] * n), "cross_entropy", r"data\[0\]\.target_tokens_T\[0\] is -5"),
            (
                spoiled(rows, **{**rl, "advantages_T": [float("nan")] * n}),
                "ppo",
                r"data\[0\]\.advantages_T holds a non-finite value",
            ),
            (
                spoiled(rows, weights_T=[float("inf")] * n),
                "cross_entropy",
                r"data\[0\]\.weights_T holds a non-finite value",
            ),
            (spoiled(rows, advantages_T=[1.0] * n), "ppo", r"reads data\[0\]\.sampling_logprobs_T, which is missing"),
        ]
        for bad, loss_fn, message in refused:
            with pytest.raises(RemoteError, match=message) as err:
                learner.call("sched.w.fb", wm.LearnerForwardBackward(ALICE, bad, loss_fn))
            assert err.value.code == "config"
        with pytest.raises(RemoteError, match=r"data\[0\]\.input_tokens\[6\] is 60000"):
            learner.call("sched.w.forward", wm.LearnerForward(ALICE, refused[0][0]))
        assert learner.call("sched.w.stats", wm.WorkerStats())["forward_backward"] == 0

        # A finite loss whose gradient norm overflows: the step is refused and the gradient dropped,
        # so the step after the next call is the one the good call alone makes.
        huge = spoiled(rows, weights_T=[0.0] * 3 + [1e25] * (n - 3))
        assert learner.call("sched.w.fb", wm.LearnerForwardBackward(ALICE, huge, "cross_entropy")).loss > 1e25
        with pytest.raises(RemoteError, match=r"norm is not finite \(inf\); the step was not applied") as err:
            learner.call("sched.w.step", dataclasses.replace(step(), expected_fb=1))
        assert err.value.code == "config"
        learner.call("sched.w.fb", fb())
        stepped = learner.call("sched.w.step", dataclasses.replace(step(), expected_fb=1))
        local.forward_backward(data(), "cross_entropy", ALICE)
        assert stepped.version == local.optim_step(ADAM, ALICE).version == 1
        exported = read_adapter_dir(AdapterRef(ALICE, 1), tmp_path / "state" / stepped.export_dir)
        for k, v in local.export_adapter(ALICE).tensors.items():
            torch.testing.assert_close(exported.tensors[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_a_batch_mates_failure_stays_with_it(tmp_path: Path) -> None:
    """bob's loss is infinite in a batch with alice: the worker keeps none of the batch, and the
    batcher sends each call again alone, so alice gets what her call alone gets and bob the error."""
    torch.set_num_threads(1)
    local = local_learner()
    config = LearnerWorkerConfig(micro_batch_size=4)
    with worker_process(config, model=TINY_RANDOM, state_dir=tmp_path / "state", run_dir=tmp_path) as learner:
        learner.call("sched.w.ensure", ensure(ALICE))
        learner.call("sched.w.ensure", dataclasses.replace(ensure(BOB), seed=8))
        alice = dataclasses.replace(fb(ALICE), request_id="a1")
        bad_rows = spoiled(other_data(), weights_T=[3e38] * len(other_data()[0].weights_T))
        bob = wm.LearnerForwardBackward(BOB, bad_rows, "cross_entropy", request_id="b1")
        with pytest.raises(RemoteError, match=r"adapter '.*bob.*': the loss is not finite \(inf\)") as err:
            learner.call("sched.w.fb_many", wm.LearnerForwardBackwardMany((alice, bob)))
        assert "alice" not in str(err.value)
        assert learner.call("sched.w.stats", wm.WorkerStats())["forward_backward"] == 0  # nothing kept

        batcher = FbBatcher(lambda kind, msg, _prepares: learner.call(kind, msg), window_s=2.0, max_calls=2)
        out: dict[str, object] = {}

        def call(req: wm.LearnerForwardBackward) -> None:
            try:
                out[req.adapter] = batcher.call(req, ("ensure", lambda _h: None))
            except Exception as exc:
                out[req.adapter] = exc

        threads = [threading.Thread(target=call, args=(req,)) for req in (alice, bob)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        got, error = out[ALICE], out[BOB]
        assert isinstance(error, RemoteError) and "the loss is not finite" in str(error)
        assert isinstance(got, r.ForwardBackwardReply)
        alone = local.forward_backward(data(), "cross_entropy", ALICE)
        assert got.loss == pytest.approx(alone.loss, rel=1e-5)
        for a, b in zip(got.logprobs, alone.logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
        stats = learner.call("sched.w.stats", wm.WorkerStats())
        assert (stats["forward_backward"], stats["batched_forward_backward"]) == (1, 0)
        # alice's gradient is her call's alone: her step matches the in-process one.
        stepped = learner.call("sched.w.step", dataclasses.replace(step(ALICE), expected_fb=1))
        local.optim_step(ADAM, ALICE)
        exported = read_adapter_dir(AdapterRef(ALICE, 1), tmp_path / "state" / stepped.export_dir)
        for k, v in local.export_adapter(ALICE).tensors.items():
            torch.testing.assert_close(exported.tensors[k], v, rtol=1e-5, atol=1e-6)
