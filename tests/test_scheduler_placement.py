"""Adapter placement on engines, cluster accounting, learner time-slicing choice, queue order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polytinker.errors import ConfigError
from polytinker.scheduler import (
    AdapterPlacement,
    ClusterSpec,
    ClusterState,
    EngineSpec,
    Job,
    JobKind,
    LearnerSpec,
    Placement,
    next_learner_job,
)
from polytinker.scheduler.placement import AdapterLoad
from polytinker.scheduler.queue import TenantQueue, iter_heap
from polytinker.scheduler.victims import find_victims


def some(load: AdapterLoad | None) -> AdapterLoad:
    assert load is not None
    return load


def fitted(state: ClusterState, job: Job) -> Placement:
    p = state.fit(job, 0.0)
    assert p is not None, f"{job.job_id} should fit"
    return p


ENGINES = (
    EngineSpec("a0", "model-a", memory_gb=40.0, adapter_slots=2),
    EngineSpec("a1", "model-a", memory_gb=40.0, adapter_slots=2),
    EngineSpec("b0", "model-b", memory_gb=40.0, adapter_slots=2),
)


def test_adapters_stay_on_engines_of_their_base_model():
    placement = AdapterPlacement(ENGINES)
    for i in range(20):
        load = placement.route(f"ad{i}", "model-a", float(i))
        assert load is not None and load.engine in ("a0", "a1")
    assert placement.route("x", "model-c", 0.0) is None  # no engine serves that model


def test_capacity_and_lru_eviction():
    placement = AdapterPlacement(ENGINES[:1])
    assert some(placement.route("first", "model-a", 1.0)).evicted is None
    assert some(placement.route("second", "model-a", 2.0)).evicted is None
    placement.route("first", "model-a", 3.0)  # used again: "second" is now least recently used
    load = some(placement.route("third", "model-a", 4.0))
    assert load.load and load.evicted == "second"
    assert placement.resident("a0") == ["first", "third"]
    assert len(placement.resident("a0")) <= ENGINES[0].adapter_slots


def test_pinned_adapters_are_never_evicted():
    placement = AdapterPlacement(ENGINES[:1])
    placement.route("kept", "model-a", 1.0)
    placement.pin("kept")
    placement.route("other", "model-a", 2.0)
    for i in range(5):
        load = placement.route(f"new{i}", "model-a", 3.0 + i)
        assert load is not None and load.evicted != "kept"
    assert "kept" in placement.resident("a0")
    # A job holding an adapter pins it too; with every slot pinned there is no room.
    placement.acquire("a0", "busy", 10.0) if placement.can_host("a0", "busy") else None
    assert placement.route("one-more", "model-a", 11.0) is None
    with pytest.raises(ConfigError, match="pinned"):
        placement.acquire("a0", "one-more", 12.0)
    placement.release("a0", "busy", 13.0)
    placement.unpin("kept")
    assert some(placement.route("one-more", "model-a", 14.0)).evicted == "kept"  # least recently used now


def test_hot_adapter_gets_replicas_and_load_is_spread():
    placement = AdapterPlacement(ENGINES, hot_requests_per_s=5.0, max_replicas=2, half_life_s=10.0)
    engines = [some(placement.route("hot", "model-a", i * 0.01)).engine for i in range(400)]
    assert placement.holders("hot") == {"a0", "a1"}
    assert engines.count("a0") > 50 and engines.count("a1") > 50
    assert "b0" not in engines


def test_choose_engine_prefers_a_warm_engine_then_the_least_loaded():
    placement = AdapterPlacement(ENGINES)
    placement.acquire("a1", "warm", 0.0)
    placement.release("a1", "warm", 1.0)
    assert placement.choose_engine("warm", "model-a", ["a0", "a1"], 2.0) == "a1"
    placement.acquire("a1", "busy", 2.0)
    assert placement.choose_engine("cold", "model-a", ["a0", "a1"], 3.0) == "a0"


def lora(job_id: str, learner_gb: float, engine_gb: float = 5.0) -> Job:
    return Job(job_id, "t", JobKind.LORA_RL, "model-a", 0, 3, 1.0, 1.0, learner_gb, engine_gb, adapter=job_id)


def test_cluster_state_respects_memory_exclusivity_and_affinity():
    g0 = LearnerSpec("g0", "model-a", 40.0, max_jobs=3, host_memory_gb=60.0)
    spec = ClusterSpec(ENGINES, (g0, LearnerSpec("g1", "model-b", 40.0)))
    state = ClusterState(spec)
    p = state.fit(lora("j1", 30.0), 0.0)
    assert p is not None and p.learner == "g0" and p.engine in ("a0", "a1")
    state.allocate(lora("j1", 30.0), p, 0.0)
    assert state.fit(lora("big", 41.0), 0.0) is None  # its working set exceeds g0's memory
    assert state.fit(lora("j2", 31.0), 0.0) is None  # states of both exceed g0's host memory; g1 serves model-b
    for name in ("j2", "j3"):
        state.allocate(lora(name, 10.0), fitted(state, lora(name, 10.0)), 0.0)
    assert state.fit(lora("j4", 1.0), 0.0) is None  # g0 time-slices at most 3 jobs
    for name in ("j2", "j3"):
        state.release(name, 0.5)
    full = Job("full", "t", JobKind.FULL_RL, "model-a", 0, 1, 1.0, 1.0, 40.0, 10.0)
    assert state.fit(full, 0.0) is None  # needs the group to itself
    with pytest.raises(ConfigError, match="does not fit"):
        state.allocate(lora("j2", 31.0), Placement("g0", "a0"), 0.0)
    state.release("j1", 1.0)
    p_full = state.fit(full, 1.0)
    assert p_full is not None
    state.allocate(full, p_full, 1.0)
    assert state.fit(lora("j3", 1.0), 1.0) is None  # nothing shares a full-parameter job's group


def test_victims_are_taken_lowest_rank_first():
    spec = ClusterSpec((EngineSpec("a0", "model-a", 40.0, 4),), (LearnerSpec("g0", "model-a", 40.0, 16, 40.0),))
    state = ClusterState(spec)
    rank = {"lo": 0, "mid": 1, "hi": 2}
    for name in rank:
        job = lora(name, 12.0)
        state.allocate(job, fitted(state, job), 0.0)
    found = find_victims(state, lora("new", 10.0), lambda j: rank[j] < 2, lambda j: (rank[j.job_id],))
    assert found is not None and found[1] == ["lo"]
    found = find_victims(state, lora("new", 20.0), lambda j: rank[j] < 2, lambda j: (rank[j.job_id],))
    assert found is not None and found[1] == ["lo", "mid"]
    assert find_victims(state, lora("new", 40.0), lambda j: rank[j] < 2, lambda j: (rank[j.job_id],)) is None


def test_learner_takes_turns_by_priority_then_longest_wait():
    assert next_learner_job([("a", 0, 5.0), ("b", 0, 1.0), ("c", 0, 3.0)]) == "b"
    assert next_learner_job([("a", 0, 5.0), ("b", 1, 9.0)]) == "b"
    assert next_learner_job([]) is None


@given(st.lists(st.integers(-50, 50), max_size=60))
def test_iter_heap_yields_sorted_order(values):
    import heapq

    heap = [(v, 0.0, i, str(i)) for i, v in enumerate(values)]
    heapq.heapify(heap)
    assert list(iter_heap(heap)) == sorted(heap)


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 100), st.booleans()), max_size=80))
def test_tenant_queue_ranks_live_jobs(items):
    q = TenantQueue()
    live = {}
    for i, (prio, size, remove) in enumerate(items):
        q.push(f"j{i}", prio, size, i)
        live[f"j{i}"] = (-prio, size, i)
        if remove:
            q.remove(f"j{i}")
            del live[f"j{i}"]
    assert [e[3] for e in q.ranked()] == sorted(live, key=live.__getitem__)
    assert len(q) == len(live)
    oldest = q.oldest()
    assert (oldest[1] if oldest else None) == min(live, key=lambda j: live[j][2], default=None)


def test_a_free_slot_elsewhere_beats_an_eviction():
    placement = AdapterPlacement(ENGINES[:2])
    for name in ("x", "y"):
        placement.acquire("a0", name, 0.0)
        placement.release("a0", name, 0.0)
    for _ in range(3):  # a0 is full but idle; a1 has a free slot and three running jobs
        placement.acquire("a1", "z", 0.0)
    load = some(placement.route("new", "model-a", 1.0))
    assert load.engine == "a1" and load.evicted is None


def test_jobs_and_adapters_go_to_the_workers_there_now_and_to_the_others_only_when_none_will_do():
    """A scheduler tells its cluster which declared workers are registered and alive: new jobs and
    adapters go to those, and a declared worker that is not there gets work only when nothing that
    is there fits (its calls then wait for it, as before)."""
    learners = (LearnerSpec("g0", "model-a", 40.0, max_jobs=4), LearnerSpec("g1", "model-a", 40.0, max_jobs=4))
    state = ClusterState(ClusterSpec(ENGINES, learners))
    assert fitted(state, lora("j0", 1.0)) == Placement("g0", "a0")  # every one there: the first in order
    there = {"g1", "a1"}
    state.set_presence(lambda rid: rid in there)
    assert fitted(state, lora("j1", 1.0)) == Placement("g1", "a1")
    assert some(state.adapters.route("new", "model-a", 0.0)).engine == "a1"
    there.clear()  # nothing there: placed as if every declared worker were, to wait for them
    assert fitted(state, lora("j2", 1.0)) == Placement("g0", "a0")
    assert some(state.adapters.route("new2", "model-a", 0.0)).engine in ("a0", "a1")


def test_an_adapter_whose_engines_are_gone_is_loaded_on_one_that_is_there():
    placement = AdapterPlacement(ENGINES)
    assert some(placement.route("ad", "model-a", 0.0)).engine == "a0"
    placement.present = lambda rid: rid != "a0"  # a0 left (its process died, its node is gone)
    moved = some(placement.route("ad", "model-a", 1.0))
    assert (moved.engine, moved.load) == ("a1", True)
    assert some(placement.route("ad", "model-a", 2.0)).engine == "a1"  # a present holder now
    placement.present = lambda rid: rid == "b0"  # no engine of model-a there: a holder, to wait for
    assert some(placement.route("ad", "model-a", 3.0)).engine in ("a0", "a1")
