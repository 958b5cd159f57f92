"""The coordinator against a real env server that refuses opens past a small ``max_episodes``
and an env whose step crashes: refused opens wait and retry, never more episodes open than the
server admits, a failed open or step aborts its own episode only, and every other one completes."""

from __future__ import annotations

import itertools
import threading

import pytest

from polytinker.envs import Coordinator, CoordinatorConfig, EnvBusy, EnvServer, EnvServerConfig, RemoteEnv

LOOPBACK = "tcp://127.0.0.1:0"


def test_a_full_server_is_waited_out_and_a_crashing_step_aborts_only_its_episode(flaky_id):
    config = EnvServerConfig(max_episodes=3, step_timeout_s=5.0)
    with EnvServer(LOOPBACK, env_ids=[flaky_id], config=config) as srv:
        peak, lock = [0], threading.Lock()

        def policy(agent, inp):
            with lock:
                peak[0] = max(peak[0], srv.num_episodes)
            return "boom" if inp.seed == 5 else "ok"  # seed 5's first step raises on the server

        coordinator = Coordinator(CoordinatorConfig(max_concurrent_episodes=16, open_backoff_cap_s=0.2))
        results = coordinator.run_sync(lambda: RemoteEnv.aopen(srv.address, flaky_id), policy, range(40))
        assert srv.num_episodes == 0  # every episode closed, the aborted one too
    assert [r.seed for r in results] == list(range(40))
    aborted = {r.seed: r.aborted for r in results if r.aborted}
    assert list(aborted) == [5] and "the env blew up" in str(aborted[5])
    assert all(r.total_rewards == {"player_0": 3.0} for r in results if r.seed != 5)
    assert coordinator.stats["open_refused"] >= 1  # 16 opens at once against 3 places
    assert coordinator.stats["open_failed"] == 0
    assert peak[0] <= 3


def test_a_failed_open_aborts_its_episode_with_the_reason_and_the_others_complete(flaky_id):
    with EnvServer(LOOPBACK, env_ids=[flaky_id]) as srv:
        calls = itertools.count()

        def make_env():
            # The fourth open names an env the server does not serve: an open that fails for good.
            env_id = "chess-v9" if next(calls) == 3 else flaky_id
            return RemoteEnv.aopen(srv.address, env_id)

        coordinator = Coordinator(CoordinatorConfig(max_concurrent_episodes=4))
        results = coordinator.run_sync(make_env, lambda agent, inp: "ok", range(12))
    aborted = [r for r in results if r.aborted]
    assert len(aborted) == 1 and "open failed" in str(aborted[0].aborted)
    assert "does not serve 'chess-v9'" in str(aborted[0].aborted) and aborted[0].trajectories == {}
    assert sum(r.aborted is None and r.total_rewards == {"player_0": 3.0} for r in results) == 11
    assert coordinator.stats == {"open_refused": 0, "open_failed": 1}


def test_a_refusal_waits_no_longer_than_open_wait_s(flaky_id):
    config = EnvServerConfig(max_episodes=1)
    with EnvServer(LOOPBACK, env_ids=[flaky_id], config=config) as srv:
        holder = RemoteEnv(srv.address, flaky_id)  # takes the only place for the whole run
        with pytest.raises(EnvBusy, match="max_episodes=1 open") as info:
            RemoteEnv(srv.address, flaky_id)
        assert info.value.max_episodes == 1 and info.value.retry_after_s > 0
        coordinator = Coordinator(CoordinatorConfig(open_wait_s=0.5, open_backoff_cap_s=0.1))
        results = coordinator.run_sync(lambda: RemoteEnv.aopen(srv.address, flaky_id), lambda a, i: "ok", range(2))
        holder.close()
    assert all("not opened in open_wait_s=0.5" in str(r.aborted) for r in results)
    assert coordinator.stats["open_refused"] >= 2


def test_the_gate_admits_waiters_in_order_one_per_free_place_and_a_cancelled_one_passes_it_on():
    """The coordinator's gate (what bounds the episodes open at once): a release admits the next
    waiter only, in arrival order; a waiter cancelled after it was admitted hands its place on."""
    import asyncio

    from polytinker.envs.coordinator import _Gate

    async def main() -> None:
        gate = _Gate(2)
        await gate.acquire()
        await gate.acquire()
        admitted: list[int] = []

        async def wait(i: int) -> None:
            await gate.acquire()
            admitted.append(i)

        tasks = [asyncio.create_task(wait(i)) for i in range(5)]
        await asyncio.sleep(0)
        assert admitted == [] and gate.active == 2
        gate.release()
        await asyncio.sleep(0)
        assert admitted == [0] and gate.active == 2  # one place, one waiter: the first
        tasks[1].cancel()  # a waiter cancelled before its turn leaves the queue
        gate.release()
        gate.release()
        await asyncio.sleep(0)
        assert admitted == [0, 2, 3] and gate.active == 2
        gate.release()  # admits 4 ...
        tasks[4].cancel()  # ... which is cancelled before it runs: its place is free again
        await asyncio.gather(*tasks, return_exceptions=True)
        assert admitted == [0, 2, 3] and gate.active == 1
        await gate.acquire()  # no waiter left: taken at once
        assert gate.active == 2

    asyncio.run(main())
