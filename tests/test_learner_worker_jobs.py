"""A learner worker (``LearnerWorker``) in this process, on the jobs the scheduler sends it: a
replacement learner answering a resent step its predecessor took, a step refused when a restart
lost its forward_backward calls, a data-parallel worker running a full-parameter job then LoRA
again, one full-parameter model held at a time, and a checkpoint missing from its disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytinker.engine.learner.config import AdamParams
from polytinker.engine.types import Datum
from polytinker.engine.worker import messages as wm
from polytinker.scheduler.service import LearnerWorkerConfig


def test_a_replacement_learner_answers_a_resent_step_its_predecessor_took(tmp_path: Path) -> None:
    """Keyed training calls on real learner workers: a duplicate is answered from the first result;
    a step finished by a process that died before answering is found by its replacement (from the
    key next to the checkpoint), which loads it instead of stepping again; a resent step whose
    gradient died with the old process is refused."""
    import dataclasses

    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import GradientLost

    cfg = LearnerWorkerConfig(micro_batch_size=8)
    adapter = "alice/job/agent"
    batch = tuple(Datum((5, 6, 7, 8), (6, 7, 8, 9), (0.0, 1.0, 1.0, 1.0)) for _ in range(2))
    fb = wm.LearnerForwardBackward(adapter, batch, "cross_entropy", request_id="fb-1", from_version=0)
    step = wm.LearnerStep(adapter, AdamParams(1e-2, 0.9, 0.95, 1e-12, 0.0), request_id="st-1", from_version=0)
    first = LearnerWorker("tiny-random", cfg, tmp_path)
    try:
        first.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        once = first.forward_backward(fb)
        assert first.forward_backward(dataclasses.replace(fb, attempt=1)) == once
        stepped = first.step(step)
        assert first.step(dataclasses.replace(step, attempt=1)) == stepped
        assert (first.stats["forward_backward"], first.stats["optim_steps"], first.stats["duplicates"]) == (1, 1, 2)
        assert stepped.version == 1 and stepped.metrics["optim/tokens"] == 6.0  # one gradient, not two
        weights = first.forward(wm.LearnerForward(adapter, batch)).logprobs
    finally:
        first.close()
    # The answer never reached the scheduler: it still records version 0, and a new process starts there.
    second = LearnerWorker("tiny-random", cfg, tmp_path)
    try:
        second.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        assert second.step(dataclasses.replace(step, attempt=1)) == stepped
        assert second.stats["optim_steps"] == 0 and second._versions()[adapter] == 1
        assert second.forward(wm.LearnerForward(adapter, batch)).logprobs == weights
        with pytest.raises(GradientLost, match="redo this step"):
            second.step(dataclasses.replace(step, request_id="st-2", from_version=1, attempt=1))
        assert second.stats["optim_steps"] == 0 and second._versions()[adapter] == 1
    finally:
        second.close()


def test_a_step_whose_forward_backward_calls_a_restarted_learner_lost_is_refused(tmp_path: Path) -> None:
    """optim_step carries how many forward_backward calls the scheduler saw answered since the last
    step: a learner holding fewer (it restarted between them) refuses the step, even on its first
    send, and drops the part it holds, so the redone calls make the same step as an unbroken run."""
    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import GradientLost

    cfg = LearnerWorkerConfig(micro_batch_size=8)
    adapter = "alice/job/agent"
    batch = tuple(Datum((5, 6, 7, 8), (6, 7, 8, 9), (0.0, 1.0, 1.0, 1.0)) for _ in range(2))

    def fb(request_id: str) -> wm.LearnerForwardBackward:
        return wm.LearnerForwardBackward(adapter, batch, "cross_entropy", request_id=request_id, from_version=0)

    def step(request_id: str, expected_fb: int) -> wm.LearnerStep:
        return wm.LearnerStep(
            adapter, AdamParams(1e-2, 0.9, 0.95, 1e-12, 0.0), request_id=request_id, expected_fb=expected_fb
        )

    worker = LearnerWorker("tiny-random", cfg, tmp_path / "first")
    try:
        worker.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        worker.forward_backward(fb("a"))
        worker.forward_backward(fb("b"))
        unbroken = worker.forward(wm.LearnerForward(adapter, batch)).logprobs
        worker.step(step("s-unbroken", 2))
        stepped = worker.forward(wm.LearnerForward(adapter, batch)).logprobs
    finally:
        worker.close()

    # The first forward_backward died with the old process.
    replacement = LearnerWorker("tiny-random", cfg, tmp_path / "replacement")
    try:
        replacement.ensure(wm.EnsureAdapter(adapter, 0, rank=4))
        replacement.forward_backward(fb("b"))
        with pytest.raises(GradientLost, match="holds 1 of the step's 2 forward_backward calls"):
            replacement.step(step("s-1", 2))
        assert replacement.stats["optim_steps"] == 0 and replacement._versions()[adapter] == 0
        assert replacement.forward(wm.LearnerForward(adapter, batch)).logprobs == unbroken
        with pytest.raises(GradientLost, match="holds 0 of the step's 1"):
            replacement.step(step("s-2", 1))
        replacement.forward_backward(fb("a2"))  # the client redoes the step's calls
        replacement.forward_backward(fb("b2"))
        assert replacement.step(step("s-3", 2)).version == 1
        redone = replacement.forward(wm.LearnerForward(adapter, batch)).logprobs
        flat = [x for row in redone for x in row]
        assert flat == pytest.approx([x for row in stepped for x in row], abs=1e-6)  # the dropped half counted once
        assert replacement.step(step("s-4", -1)).version == 2  # an unknown count is not checked
    finally:
        replacement.close()


def test_a_data_parallel_learner_worker_runs_a_full_parameter_job_then_lora_again(tmp_path: Path) -> None:
    """K=2 replicas hold either the LoRA adapters or one full-parameter model: a full job's step
    equals one process's (same data, same update), and the LoRA adapter comes back from its
    checkpoint afterwards. A call for a slot the switch dropped is refused (NotResident), never
    served from fresh weights."""
    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import NotResident

    lora, full = "alice/lora/agent", "alice/full/agent"
    rows = [(5, 6, 7, 8, 9), (10, 11, 12), (13, 14, 15, 16), (17, 18, 19, 20, 21, 22), (23, 24, 25)]
    batch = tuple(Datum(r, (*r[1:], 3), (0.0,) + (1.0,) * (len(r) - 1)) for r in rows)

    def step(adapter: str, is_full: bool) -> wm.LearnerStep:
        # Adam's eps at 1e-3: a weight whose gradient is float noise (summed in another order
        # across replicas) then moves by noise, not by a whole learning rate of either sign.
        return wm.LearnerStep(adapter, AdamParams(1e-2, 0.9, 0.95, 1e-3, 0.0), full=is_full)

    def run(worker: LearnerWorker) -> dict[str, object]:
        worker.ensure(wm.EnsureAdapter(lora, 0, rank=4))
        worker.forward_backward(wm.LearnerForwardBackward(lora, batch, "cross_entropy"))
        lora_step = worker.step(step(lora, False))
        lora_after = worker.forward(wm.LearnerForward(lora, batch)).logprobs
        worker.ensure(wm.EnsureAdapter(full, 0, full=True))
        worker.forward_backward(wm.LearnerForwardBackward(full, batch, "cross_entropy", full=True))
        full_step = worker.step(step(full, True))
        full_after = worker.forward(wm.LearnerForward(full, batch, full=True)).logprobs
        if worker.cfg.world_size > 1:
            with pytest.raises(NotResident, match="adapter alice/lora/agent is not resident"):
                worker.forward(wm.LearnerForward(lora, batch))
        assert lora_step.checkpoint == "checkpoints/alice/lora/agent/v1"  # under the worker's own root
        worker.ensure(wm.EnsureAdapter(lora, 1, wm.WeightsRef(lora, 1), rank=4))
        lora_again = worker.forward(wm.LearnerForward(lora, batch)).logprobs
        if worker.cfg.world_size > 1:
            with pytest.raises(NotResident, match="full-parameter model alice/full/agent"):
                worker.forward(wm.LearnerForward(full, batch, full=True))
        return {"lora": lora_after, "full": full_after, "lora_again": lora_again, "full_version": full_step.version}

    one = LearnerWorker("tiny-random", LearnerWorkerConfig(micro_batch_size=8), tmp_path / "k1")
    try:
        single = run(one)
    finally:
        one.close()
    two = LearnerWorker("tiny-random", LearnerWorkerConfig(world_size=2, micro_batch_size=8), tmp_path / "k2")
    try:
        group = run(two)
        assert two.stats["loads"] == 1  # the LoRA adapter, from its checkpoint after the switch back
    finally:
        two.close()

    def flat(rows: object) -> list[float]:
        assert isinstance(rows, list)
        return [x for row in rows for x in row]

    assert group["full_version"] == single["full_version"] == 1
    for key in ("lora", "full", "lora_again"):
        assert flat(group[key]) == pytest.approx(flat(single[key]), abs=1e-4), key
    assert flat(group["lora_again"]) == pytest.approx(flat(group["lora"]), abs=1e-6)
    assert flat(single["full"]) != pytest.approx(flat(single["lora"]), abs=1e-3)  # the two really differ


def test_a_learner_worker_holds_one_full_parameter_model_at_a_time(tmp_path: Path) -> None:
    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import NotResident

    batch = (Datum((5, 6, 7, 8), (6, 7, 8, 9), (0.0, 1.0, 1.0, 1.0)),)
    worker = LearnerWorker("tiny-random", LearnerWorkerConfig(micro_batch_size=8), tmp_path)
    try:
        worker.ensure(wm.EnsureAdapter("a/1/x", 0, full=True))
        worker.forward_backward(wm.LearnerForwardBackward("a/1/x", batch, "cross_entropy", full=True))
        stepped = worker.step(wm.LearnerStep("a/1/x", AdamParams(1e-3, 0.9, 0.95, 1e-8, 0.0), full=True))
        trained = worker.forward(wm.LearnerForward("a/1/x", batch, full=True))
        worker.ensure(wm.EnsureAdapter("a/2/y", 0, full=True))  # the next job's model replaces it
        assert worker.get_stats(wm.WorkerStats())["full_slots"] == 1
        with pytest.raises(NotResident):
            worker.forward(wm.LearnerForward("a/1/x", batch, full=True))
        worker.ensure(wm.EnsureAdapter("a/1/x", 1, wm.WeightsRef("a/1/x", stepped.version), full=True))
        assert worker.forward(wm.LearnerForward("a/1/x", batch, full=True)) == trained
    finally:
        worker.close()


def test_a_checkpoint_missing_from_this_learners_disk_is_named_as_such(tmp_path: Path) -> None:
    """A learner started where its predecessor's state_dir is not (another machine, no shared
    disk) says what is missing and why, with no path, instead of a file error."""
    from polytinker.engine.learner.worker import LearnerWorker
    from polytinker.errors import ModelError

    worker = LearnerWorker("tiny-random", LearnerWorkerConfig(micro_batch_size=8), tmp_path)
    try:
        missing = wm.WeightsRef("alice/job/agent", 3)
        with pytest.raises(ModelError, match="v3: its checkpoint is not on this learner's disk") as caught:
            worker.ensure(wm.EnsureAdapter("alice/job/agent", 3, missing, rank=4))
        assert str(tmp_path) not in str(caught.value)
    finally:
        worker.close()
