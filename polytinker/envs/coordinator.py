"""The episode coordinator: drives many episodes at once and records per-agent trajectories.

The interaction protocol, and all a training loop needs to know of envs::

    async def policy(agent_id: AgentID, inp: PolicyInput) -> str | AgentAction: ...

    results = await Coordinator(CoordinatorConfig()).run(lambda: make("tictactoe-v0"), policy, seeds=range(64))

For each decision the coordinator calls ``policy(agent_id, PolicyInput)``. ``PolicyInput`` holds
the agent's instructions (system prompt), its current ``TextObservation`` (text, legal moves,
whose turn, info) and the agent's own earlier turns (``history``); ``PolicyInput.to_messages()``
gives the chat list. The policy answers with the action text, or an ``AgentAction`` whose
``sample`` (a model's ``ModelSample``: tokens, logprobs, adapter version) and free-form ``meta``
are kept in the ``Turn``. A policy may be
a coroutine function (awaited, with ``policy_timeout_s``) or a plain function (scripted
opponents); one policy for all agents, or a mapping from agent id to policy.

- AEC envs: turn-taking, one policy call at a time per episode, for ``env.agent_selection``.
- Parallel envs: every agent that must act this round is asked at once; the step waits for all
  (the barrier). ``infos[agent]["needs_action"] == False`` marks an agent whose move is in while
  another agent retries an invalid one.
- Invalid actions: the env refuses them (penalty, retries); the coordinator records the refusal
  (``Turn.invalid_reason``) and asks again with the env's feedback in the observation.
- A policy that times out sends the empty action, which the env refuses like any invalid one.
- An env that raises aborts its episode (``EpisodeResult.aborted``: the error and where in the
  env's code it was raised); the other episodes go on. So does a ``make_env`` that raises, and a
  policy that raises ``EnvError`` (a remote env's scripted opponent whose server failed). Any other
  exception from a policy is the caller's bug and propagates.
- ``current_env()`` is the env of the episode whose policy is being asked (a remote env's
  scripted opponents ask its server for their moves through it).
- Back-pressure: an env source that refuses an open for now (``EnvBusy``: a remote server with
  ``max_episodes`` open) lowers how many episodes this run opens at once to what the source
  admits (its ``max_episodes``, or what is open now), and the refused episode waits (exponential
  back-off with full jitter) and opens again, for up to ``open_wait_s``.

The coordinator knows nothing of models. Envs with ``areset``/``astep`` coroutines (remote envs)
are awaited, so that many remote episodes overlap on one event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pettingzoo import AECEnv

from polytinker.envs._trace import describe_failure
from polytinker.envs.base import declared_tools
from polytinker.envs.config import CoordinatorConfig
from polytinker.envs.types import (
    AgentAction,
    AgentID,
    EpisodeResult,
    ModelSample,
    PolicyInput,
    TextObservation,
    Trajectory,
    Turn,
)
from polytinker.errors import EnvBusy, EnvError

PolicyResult = str | AgentAction
Policy = Callable[[AgentID, PolicyInput], Awaitable[PolicyResult] | PolicyResult]
EnvFactory = Callable[[], Any]
_CURRENT_ENV: contextvars.ContextVar[Any] = contextvars.ContextVar("polytinker_current_env", default=None)


def current_env() -> Any:
    """The env of the episode whose policy the coordinator is asking now (None outside one)."""
    return _CURRENT_ENV.get()


@dataclass
class _OpenTurn:
    observation: TextObservation
    action: str
    meta: Mapping[str, Any]
    sample: ModelSample | None
    timed_out: bool
    latency_s: float
    invalid_reason: str | None = None
    reward: float = 0.0


@dataclass
class _Book:
    """Per-agent bookkeeping of one episode: closed turns, the open one, reward totals."""

    turns: dict[AgentID, list[Turn]] = field(default_factory=dict)
    open: dict[AgentID, _OpenTurn] = field(default_factory=dict)
    totals: dict[AgentID, float] = field(default_factory=dict)
    done: dict[AgentID, tuple[bool, bool]] = field(default_factory=dict)
    streak: dict[AgentID, int] = field(default_factory=dict)  # consecutive invalid actions
    steps: int = 0  # env steps taken (kept here so that an aborted episode reports them too)

    def reward(self, agent: AgentID, r: float) -> None:
        self.totals[agent] = self.totals.get(agent, 0.0) + r
        if agent in self.open:
            self.open[agent].reward += r

    def close(self, agent: AgentID) -> None:
        t = self.open.pop(agent, None)
        if t is not None:
            turn = Turn(t.observation, t.action, t.reward, t.invalid_reason, t.timed_out, t.latency_s, t.meta, t.sample)
            self.turns.setdefault(agent, []).append(turn)

    def mark_invalid(self, agent: AgentID, info: Mapping[str, Any] | None) -> None:
        info = info or {}
        reason = info.get("invalid_action")
        if agent in self.open and reason:
            self.open[agent].invalid_reason = str(reason)
            # Out of retries, the env settled the move: the agent's next decision is a fresh one.
            retrying = info.get("retries_left", 1) > 0
            self.streak[agent] = self.streak.get(agent, 0) + 1 if retrying else 0
        else:
            self.streak[agent] = 0

    def trajectories(self, agents: Iterable[AgentID]) -> dict[AgentID, Trajectory]:
        for a in list(self.open):
            self.close(a)
        return {
            a: Trajectory(
                agent=a,
                turns=tuple(self.turns.get(a, ())),
                total_reward=self.totals.get(a, 0.0),
                terminated=self.done.get(a, (False, False))[0],
                truncated=self.done.get(a, (False, False))[1],
            )
            for a in agents
        }


class _StepLimit(Exception):
    pass


class _PolicyFailed(Exception):
    """Carries a policy's exception (as ``__cause__``) past the env-failure handler."""


class _Gate:
    """A semaphore whose limit comes down to what the env source admits: the open episodes of
    this run when a refusal came, or the source's own ``max_episodes`` when it says so.

    Waiters queue in order and a release wakes only as many as there is room for (a Condition
    with ``notify_all`` woke every waiter on each release, to find the one that may go)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # resolved by _admit, which counts this holder in
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # admitted, then cancelled: pass the slot on
                self.release()
            elif waiter in self._waiters:  # (a cancelled one that _admit met is gone already)
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.active -= 1
        self._admit()

    def _admit(self) -> None:
        while self._waiters and self.active < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.active += 1
                waiter.set_result(None)

    def refused(self, exc: EnvBusy) -> None:
        """Called by a holder whose open was refused: the others hold what the source admits."""
        admits = exc.max_episodes if exc.max_episodes > 0 else self.active - 1
        self.limit = max(1, min(self.limit, admits))


class Coordinator:
    """Runs episodes of text envs against policies; see the module docstring for the protocol."""

    def __init__(self, config: CoordinatorConfig | None = None) -> None:
        self.config = config or CoordinatorConfig()
        # Over this coordinator's runs: opens refused for now (EnvBusy) and opens that failed.
        self.stats = {"open_refused": 0, "open_failed": 0}
        # The exception of the latest episode an env failure aborted (its traceback is the env's).
        self.last_failure: BaseException | None = None

    async def run(
        self,
        make_env: EnvFactory,
        policy: Policy | Mapping[AgentID, Policy],
        seeds: Iterable[int | None],
        *,
        env_id: str = "",
    ) -> list[EpisodeResult]:
        """One episode per seed, at most ``max_concurrent_episodes`` at once (fewer when the env
        source refuses opens), results in seed order. ``make_env()`` may return an env or an
        awaitable of one; each episode gets a fresh env. A failed open or step aborts its episode."""
        gate = _Gate(self.config.max_concurrent_episodes)

        async def one(seed: int | None) -> EpisodeResult:
            start = time.perf_counter()
            env, why = await self._open(make_env, gate)
            if env is None:
                return _not_opened(seed, env_id, why, time.perf_counter() - start)
            try:
                return await self.run_episode(env, policy, seed=seed, env_id=env_id)
            finally:
                try:
                    await _maybe_await(getattr(env, "aclose", None) or env.close)
                finally:
                    gate.release()

        return list(await asyncio.gather(*(one(s) for s in seeds)))

    async def _open(self, make_env: EnvFactory, gate: _Gate) -> tuple[Any, str]:
        """(env, "") holding a gate slot, or (None, why) holding none. A refusal for now gives
        the slot back, waits and tries again, so refused episodes queue behind the lowered limit."""
        deadline = time.monotonic() + self.config.open_wait_s
        tries = 0
        while True:
            await gate.acquire()
            try:
                env = make_env()
                if inspect.isawaitable(env):
                    env = await env
                return env, ""
            except EnvBusy as exc:
                self.stats["open_refused"] += 1
                gate.refused(exc)
                gate.release()
                if time.monotonic() >= deadline:
                    return None, f"not opened in open_wait_s={self.config.open_wait_s:g}: {exc}"
                ceiling = min(self.config.open_backoff_cap_s, exc.retry_after_s * 2.0 ** min(tries, 16))
                await asyncio.sleep(random.uniform(0.0, ceiling))
                tries += 1
            except Exception as exc:
                self.stats["open_failed"] += 1
                self.last_failure = exc
                gate.release()
                return None, f"open failed: {describe_failure(exc)}"

    def run_sync(
        self,
        make_env: EnvFactory,
        policy: Policy | Mapping[AgentID, Policy],
        seeds: Iterable[int | None],
        *,
        env_id: str = "",
    ) -> list[EpisodeResult]:
        """``run`` from synchronous code (starts and ends its own event loop)."""
        return asyncio.run(self.run(make_env, policy, seeds, env_id=env_id))

    async def run_episode(
        self,
        env: Any,
        policy: Policy | Mapping[AgentID, Policy],
        *,
        seed: int | None = None,
        env_id: str = "",
        episode_id: str | None = None,
    ) -> EpisodeResult:
        """Play one episode of ``env`` (an AEC or parallel text env) to its end."""
        episode_id = episode_id or uuid.uuid4().hex[:12]
        env_id = env_id or str(getattr(env, "metadata", {}).get("name", type(env).__name__))
        book = _Book()
        start = time.perf_counter()
        aborted: str | None = None
        token = _CURRENT_ENV.set(env)
        try:
            drive = self._drive_aec if isinstance(env, AECEnv) else self._drive_parallel
            await drive(env, policy, book, seed, env_id, episode_id)
        except _StepLimit:
            aborted = f"step limit of {self.config.max_steps_per_episode} reached"
        except _PolicyFailed as exc:
            # A policy bug is the caller's to see, not an env failure to paper over.
            raise exc.__cause__ or exc from None
        except Exception as exc:
            # The env (or the link to it) failed: this episode is lost, the others go on.
            aborted = describe_failure(exc)
            self.last_failure = exc
        finally:
            _CURRENT_ENV.reset(token)
        return EpisodeResult(
            episode_id=episode_id,
            env_id=env_id,
            seed=seed,
            trajectories=book.trajectories(env.possible_agents),
            num_steps=book.steps,
            wall_s=time.perf_counter() - start,
            aborted=aborted,
        )

    # -- one decision
    async def _decide(
        self, env: Any, policy: Any, book: _Book, agent: AgentID, obs: TextObservation, ids: tuple[str, str, int | None]
    ) -> str:
        fn = policy[agent] if isinstance(policy, Mapping) else policy
        book.close(agent)  # its previous turn has earned all it will: it goes into the history
        inp = PolicyInput(
            agent=agent,
            episode_id=ids[1],
            env_id=ids[0],
            instructions=env.instructions(agent),
            observation=obs,
            history=tuple(book.turns.get(agent, ())) if self.config.keep_history else (),
            retry=book.streak.get(agent, 0),
            seed=ids[2],
            tools=declared_tools(env, agent),
        )
        start = time.perf_counter()
        timed_out = False
        try:
            result = fn(agent, inp)
            if inspect.isawaitable(result):
                async with asyncio.timeout(self.config.policy_timeout_s):  # no extra task, unlike wait_for
                    result = await result
                    while inspect.isawaitable(result):  # a wrapper handed back an async policy's coroutine
                        result = await result
        except TimeoutError:
            result, timed_out = "", True
        except EnvError:
            raise  # the env failed (a served scripted opponent): the episode aborts, the run goes on
        except Exception as exc:
            raise _PolicyFailed() from exc
        if isinstance(result, str):
            result = AgentAction(result)
        elif not isinstance(result, AgentAction):
            bad = TypeError(f"policy for {agent} returned {type(result).__name__}; return str or AgentAction")
            raise _PolicyFailed() from bad
        latency_s = time.perf_counter() - start
        book.open[agent] = _OpenTurn(obs, result.text, result.meta, result.sample, timed_out, latency_s)
        return result.text

    # -- turn-taking
    async def _drive_aec(
        self, env: Any, policy: Any, book: _Book, seed: int | None, env_id: str, episode_id: str
    ) -> None:
        await _call(env, "reset", seed=seed)
        while env.agents:
            if book.steps >= self.config.max_steps_per_episode:
                raise _StepLimit()
            agent = env.agent_selection
            raw, reward, terminated, truncated, info = env.last()
            book.reward(agent, float(reward))
            if terminated or truncated:
                book.done[agent] = (bool(terminated), bool(truncated))
                await _call(env, "step", None)
                continue
            obs = TextObservation.from_raw(raw, info)
            action = await self._decide(env, policy, book, agent, obs, (env_id, episode_id, seed))
            await _call(env, "step", action)
            book.steps += 1
            book.mark_invalid(agent, env.infos.get(agent))

    # -- simultaneous moves
    async def _drive_parallel(
        self, env: Any, policy: Any, book: _Book, seed: int | None, env_id: str, episode_id: str
    ) -> None:
        observations, infos = await _call(env, "reset", seed=seed)
        ids = (env_id, episode_id, seed)
        while env.agents:
            if book.steps >= self.config.max_steps_per_episode:
                raise _StepLimit()
            acting = [a for a in env.agents if infos.get(a, {}).get("needs_action", True)]
            decisions = [
                self._decide(env, policy, book, a, TextObservation.from_raw(observations[a], infos.get(a)), ids)
                for a in acting
            ]
            texts = await _all(decisions)  # the barrier: everyone's move before the step
            actions = dict.fromkeys(env.agents, "")
            actions.update(zip(acting, texts, strict=True))
            observations, rewards, terminations, truncations, infos = await _call(env, "step", actions)
            book.steps += 1
            for a, r in rewards.items():
                book.reward(a, float(r))
            for a in acting:
                book.mark_invalid(a, infos.get(a))
            for a, terminated in terminations.items():
                truncated = bool(truncations.get(a, False))
                if terminated or truncated:
                    book.done[a] = (bool(terminated), truncated)


def _not_opened(seed: int | None, env_id: str, why: str, wall_s: float) -> EpisodeResult:
    return EpisodeResult(uuid.uuid4().hex[:12], env_id, seed, {}, 0, wall_s, aborted=why)


async def _all(decisions: Sequence[Coroutine[Any, Any, str]]) -> list[str]:
    """``gather`` for the barrier, one task cheaper: the last decision runs in this task while
    the others run as tasks (they overlap all the same). A failure cancels the rest."""
    if not decisions:
        return []
    tasks = [asyncio.ensure_future(d) for d in decisions[:-1]]
    try:
        last = await decisions[-1]
        return [*[await t for t in tasks], last]
    finally:
        for t in tasks:
            t.cancel()


async def _call(env: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``env.a<name>`` when the env has it (remote envs), else the plain method."""
    async_method = getattr(env, "a" + name, None)
    if async_method is not None:
        return await async_method(*args, **kwargs)
    return getattr(env, name)(*args, **kwargs)


async def _maybe_await(fn: Callable[[], Any]) -> None:
    result = fn()
    if inspect.isawaitable(result):
        await result


__all__ = ["Coordinator", "EnvFactory", "Policy", "PolicyResult"]
