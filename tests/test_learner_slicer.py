"""The scheduler's learner time-slicing (``LearnerSlicer``): a job keeps the learner group until
its step boundary, an idle holder hands it over, and LoRA jobs share a turn while a
full-parameter job holds the group alone and is not overtaken."""

from __future__ import annotations

import threading
import time

from polytinker.scheduler.service import LearnerSlicer


def test_learner_slicer_keeps_a_job_until_its_step_boundary() -> None:
    slicer = LearnerSlicer(idle_s=30.0)
    order: list[str] = []
    with slicer.turn("a", 0):
        order.append("a-fb")

    def b() -> None:
        with slicer.turn("b", 0, ends_step=True):
            order.append("b-step")

    t = threading.Thread(target=b)
    t.start()
    time.sleep(0.2)
    assert order == ["a-fb"]  # b waits: a holds the group between its forward_backward and its step
    with slicer.turn("a", 0, ends_step=True):
        order.append("a-step")
    t.join(5)
    assert order == ["a-fb", "a-step", "b-step"] and slicer.switches == 2


def test_learner_slicer_hands_over_after_an_idle_holder() -> None:
    slicer = LearnerSlicer(idle_s=0.1)
    with slicer.turn("a", 0):
        pass
    start = time.monotonic()
    with slicer.turn("b", 0):
        pass
    assert time.monotonic() - start < 2.0


def test_learner_slicer_lets_lora_jobs_hold_together_and_a_full_job_alone() -> None:
    slicer = LearnerSlicer(idle_s=30.0)
    order: list[str] = []

    def run(job: str, shared: bool, priority: int = 0) -> threading.Thread:
        def body() -> None:
            with slicer.turn(job, priority, ends_step=True, shared=shared):
                order.append(job)

        t = threading.Thread(target=body)
        t.start()
        return t

    with slicer.turn("a", 0, shared=True):
        order.append("a-fb")
    run("b", shared=True).join(5)
    assert order == ["a-fb", "b"]  # b joined a: both are LoRA jobs
    full = run("full", shared=False)
    time.sleep(0.2)
    assert order == ["a-fb", "b"]  # the full-parameter job waits for a's step boundary
    late = run("c", shared=True)
    time.sleep(0.2)
    assert order == ["a-fb", "b"]  # and a LoRA job that comes after it does not overtake it
    with slicer.turn("a", 0, ends_step=True, shared=True):
        order.append("a-step")
    full.join(5)
    late.join(5)
    # Then the policy picks between the two waiters (next_learner_job); each runs in its own turn.
    assert order[:3] == ["a-fb", "b", "a-step"] and sorted(order[3:]) == ["c", "full"]
