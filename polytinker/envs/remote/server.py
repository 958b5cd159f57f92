"""``EnvServer``: serves registered text envs over ZeroMQ, many episodes at once.

Built on the transport's ``RpcServer`` (one I/O thread, handlers in a pool); the env messages
are kinds on that envelope (docs/remote-envs.md). Every episode has its own env instance and
lock, so episodes run concurrently and one episode's calls are serialised. Env calls run on the
handler thread that serves the request, watched for ``step_timeout_s`` (``_deadlines``): an env
that hangs or raises aborts its episode (the client gets an error reply naming the reason, a hung
one's within the timeout and a quarter of it, at most 1 s more) while the server keeps serving
the others; the transport replaces the handler thread a hung env holds.
With ``max_episodes`` open, ``env.open`` is answered ``{"busy": true, ...}`` (the client raises
``EnvBusy``; the coordinator waits and opens again) rather than an error: a full server is a
state to wait out, not a failure. ``env.scripted`` plays the env's own scripted policies (the
opponents of evaluations) on the server, so a client needs no copy of the env's code.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pettingzoo import AECEnv

from polytinker.envs._trace import describe_failure
from polytinker.envs.base import declared_tools
from polytinker.envs.config import EnvConfig, EnvServerConfig
from polytinker.envs.opponents import ScriptedPolicy
from polytinker.envs.registry import env_specs, make, spec
from polytinker.envs.remote import messages as m
from polytinker.envs.remote._deadlines import Deadlines, Watch
from polytinker.envs.types import InvalidAction, PolicyInput, TextObservation
from polytinker.errors import ConfigError, EnvError, ProtocolError
from polytinker.tables import from_table
from polytinker.transport.config import TransportConfig
from polytinker.transport.protocol import RateLimitedLog
from polytinker.transport.rpc import RpcServer, ServerCurve, current_call

log = logging.getLogger(__name__)
_TOMBSTONES = 4096  # aborted episodes remembered, so late requests learn why
BUSY_RETRY_S = 0.5  # the wait a busy answer suggests
_POLICIES_PER_EPISODE = 16  # scripted policy instances (kind, seed) kept per episode


@dataclass
class _Episode:
    env: Any
    env_id: str
    aec: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    seed: int | None = None  # of the last reset: scripted moves derive their randomness from it
    # Parallel envs: the last observations and infos sent (what a scripted policy sees).
    observations: dict[str, Any] = field(default_factory=dict)
    infos: dict[str, Any] = field(default_factory=dict)
    policies: dict[tuple[str, int | None], Any] = field(default_factory=dict)  # (kind, seed) -> policy


class EnvServer:
    """Serve ``env_ids`` (default: every registered env) at ``address``."""

    def __init__(
        self,
        address: str,
        *,
        env_ids: Iterable[str] | None = None,
        config: EnvServerConfig | None = None,
        transport: TransportConfig | None = None,
        curve: ServerCurve | None = None,
        insecure: bool = False,
    ) -> None:
        self.config = config or EnvServerConfig()
        known = env_specs()
        self.env_ids = sorted(env_ids) if env_ids is not None else sorted(known)
        for env_id in self.env_ids:
            if env_id not in known:
                try:
                    spec(env_id)  # an id of a namespace that registers on demand (textarena/...)
                except ConfigError as exc:
                    raise ConfigError(f"cannot serve {env_id!r}: {exc}") from exc
        self._episodes: dict[str, _Episode] = {}
        self._aborted: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        # Env calls past step_timeout_s: answered by the watcher, their handler thread replaced.
        self._deadlines = Deadlines(self.config.step_timeout_s, self._expired)
        handlers: dict[str, Callable[[Any], Any]] = {
            m.KIND_LIST: self._on_list,
            m.KIND_OPEN: self._on_open,
            m.KIND_RESET: self._on_reset,
            m.KIND_STEP: self._on_step,
            m.KIND_OBSERVE: self._on_observe,
            m.KIND_PARSE: self._on_parse,
            m.KIND_SCRIPTED: self._on_scripted,
            m.KIND_CLOSE: self._on_close,
        }
        wrapped = {kind: self._typed(kind, fn) for kind, fn in handlers.items()}
        # Binding beyond loopback needs Curve (or an explicit insecure=True): the transport's rule.
        # arrays=False: env messages are text and token ids; a peer that sends a tensor is refused
        # without this process ever importing torch.
        self._rpc = RpcServer(address, wrapped, config=transport, curve=curve, insecure=insecure, arrays=False)
        self._stopped = threading.Event()
        self._busy_log = RateLimitedLog(log)

    @property
    def address(self) -> str:
        return self._rpc.address

    @property
    def num_episodes(self) -> int:
        return len(self._episodes)

    def start(self) -> EnvServer:
        self._rpc.start()
        self._deadlines.start()
        return self

    def stop(self) -> None:
        self._rpc.stop()
        self._deadlines.stop()
        with self._lock:
            episodes, self._episodes = list(self._episodes.values()), {}
        for ep in episodes:
            try:
                ep.env.close()
            except Exception:
                log.debug("closing an episode's env at stop failed", exc_info=True)
        self._stopped.set()

    def wait(self) -> None:
        """Block until ``stop()`` (or Ctrl-C)."""
        self._stopped.wait()

    def __enter__(self) -> EnvServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- plumbing
    @staticmethod
    def _typed(kind: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def handler(payload: Any) -> Any:
            return fn(m.parse_request(kind, payload))

        return handler

    def _episode(self, episode: str) -> _Episode:
        ep = self._episodes.get(episode)
        if ep is None:
            if episode in self._aborted:
                raise EnvError(f"episode {episode} was aborted: {self._aborted[episode]}")
            raise EnvError(f"no open episode {episode!r} (closed, expired or never opened)")
        ep.last_used = time.monotonic()
        return ep

    def _abort(self, episode: str, reason: str) -> EnvError:
        with self._lock:
            ep = self._episodes.pop(episode, None)
            self._aborted[episode] = reason
            while len(self._aborted) > _TOMBSTONES:
                self._aborted.popitem(last=False)
        if ep is not None:
            try:
                ep.env.close()
            except Exception:
                log.debug("closing aborted episode %s failed", episode, exc_info=True)
        log.warning("episode %s (%s) aborted: %s", episode, ep.env_id if ep else "?", reason)
        return EnvError(f"episode {episode} aborted: {reason}")

    def _run(self, episode: str, ep: _Episode, what: str, fn: Callable[[], Any]) -> Any:
        """Run an env call here, watched for the step timeout; a raise or a hang aborts the episode."""
        watch = self._deadlines.watch(current_call(), episode, what)
        try:
            return fn()
        except Exception as exc:
            if watch.expired:  # answered already, with the timeout; this call's answer is dropped
                raise EnvError(f"episode {episode} aborted: {what} ran past step_timeout_s") from exc
            raise self._abort(episode, f"the env raised in {what}: {describe_failure(exc)}") from exc
        finally:
            # Done: the watch may wait in the queue behind a slower call; the request it held
            # (frames and all) need not wait with it.
            watch.done, watch.call = True, None

    def _expired(self, watch: Watch) -> None:
        """On the watcher's thread: the env call of ``watch`` runs past step_timeout_s."""
        call = watch.call  # None once the call returned (its own answer goes out)
        error = self._abort(watch.episode, f"{watch.what} took longer than step_timeout_s={self.config.step_timeout_s}")
        if call is not None:
            self._rpc.fail_call(call, error)

    def _reap_idle(self) -> None:
        cutoff = time.monotonic() - self.config.idle_episode_s
        with self._lock:  # a copy taken while other handler threads open and close episodes failed
            idle = [episode for episode, ep in self._episodes.items() if ep.last_used < cutoff]
        for episode in idle:
            self._abort(episode, f"idle for more than idle_episode_s={self.config.idle_episode_s}")

    # -- handlers
    def _on_list(self, req: m.ListRequest) -> dict[str, Any]:
        return {"env_ids": list(self.env_ids)}

    def _on_open(self, req: m.OpenRequest) -> dict[str, Any]:
        if req.env_id not in self.env_ids:
            raise EnvError(f"this server does not serve {req.env_id!r}; it serves: {', '.join(self.env_ids)}")
        self._reap_idle()
        if len(self._episodes) >= self.config.max_episodes:
            return self._busy()
        env_config = from_table(EnvConfig, req.config, "env.open config")
        try:
            env = make(req.env_id, config=env_config, **req.kwargs)
        except TypeError as exc:  # a keyword the env does not take: the caller's to fix
            raise ConfigError(f"env.open kwargs of {req.env_id}: {exc}") from exc
        episode = uuid.uuid4().hex
        aec = isinstance(env, AECEnv)
        with self._lock:  # the bound holds under concurrent opens: counted and taken at once
            full = len(self._episodes) >= self.config.max_episodes
            if not full:
                self._episodes[episode] = _Episode(env, req.env_id, aec)
        if full:
            try:
                env.close()
            except Exception:
                log.debug("closing an env opened past max_episodes failed", exc_info=True)
            return self._busy()
        cfg = getattr(env, "config", env_config)
        return {
            "episode": episode,
            "env_id": req.env_id,
            "kind": "aec" if aec else "parallel",
            "name": str(env.metadata.get("name", req.env_id)),
            "possible_agents": list(env.possible_agents),
            "instructions": {a: env.instructions(a) for a in env.possible_agents},
            "tools": {a: list(declared_tools(env, a)) for a in env.possible_agents},
            "max_observation_chars": cfg.max_observation_chars,
            "max_action_chars": cfg.max_action_chars,
            "scripted": sorted(str(kind) for kind in getattr(env, "scripted", None) or {}),
        }

    def _busy(self) -> dict[str, Any]:
        limit = self.config.max_episodes
        self._busy_log("env.open refused: max_episodes=%d open", limit)
        reason = f"the server has max_episodes={limit} open; try again after a close"
        return {"busy": True, "reason": reason, "max_episodes": limit, "retry_after_s": BUSY_RETRY_S}

    def _on_reset(self, req: m.ResetRequest) -> dict[str, Any]:
        ep = self._episode(req.episode)
        with ep.lock:
            ep.seed = req.seed
            if ep.aec:
                raw = self._run(req.episode, ep, "reset", lambda: _then_observe(ep.env, ep.env.reset(seed=req.seed)))
                return self._aec_state(req.episode, ep, raw)
            observations, infos = self._run(req.episode, ep, "reset", lambda: ep.env.reset(seed=req.seed))
            return self._parallel_state(req.episode, ep, observations, {}, {}, {}, infos)

    def _on_step(self, req: m.StepRequest) -> dict[str, Any]:
        ep = self._episode(req.episode)
        limit = self.config.max_action_bytes
        texts = [req.action] if ep.aec else list((req.actions or {}).values())
        for text in texts:
            if text is not None and len(text.encode()) > limit:
                raise ProtocolError(f"an action of {len(text.encode())} bytes exceeds max_action_bytes={limit}")
        with ep.lock:
            if ep.aec:
                raw = self._run(req.episode, ep, "step", lambda: _then_observe(ep.env, ep.env.step(req.action)))
                return self._aec_state(req.episode, ep, raw)
            if req.actions is None:
                raise ProtocolError("env.step on a parallel env needs 'actions' (agent -> text)")
            result = self._run(req.episode, ep, "step", lambda: ep.env.step(dict(req.actions or {})))
            return self._parallel_state(req.episode, ep, *result)

    def _on_observe(self, req: m.ObserveRequest) -> dict[str, Any]:
        ep = self._episode(req.episode)
        if not ep.aec:
            raise EnvError("env.observe is for AEC envs; a parallel env's observations come with reset and step")
        if req.agent not in ep.env.possible_agents:
            raise EnvError(f"no agent {req.agent!r} in {ep.env_id}")
        with ep.lock:
            obs = self._run(req.episode, ep, "observe", lambda: ep.env.observe(req.agent))
            return self._checked_obs(req.episode, req.agent, obs)

    def _on_parse(self, req: m.ParseRequest) -> dict[str, Any]:
        ep = self._episode(req.episode)
        with ep.lock:
            move = self._run(req.episode, ep, "parse_action", lambda: ep.env.parse_action(req.agent, req.text))
        if isinstance(move, InvalidAction):
            return {"valid": False, "move": "", "reason": move.reason}
        return {"valid": True, "move": str(move), "reason": ""}

    def _on_scripted(self, req: m.ScriptedRequest) -> dict[str, Any]:
        ep = self._episode(req.episode)
        table = getattr(ep.env, "scripted", None) or {}
        if req.policy not in table:
            has = ", ".join(sorted(table)) or "none"
            raise EnvError(f"{ep.env_id} has no scripted policy {req.policy!r}; it has: {has}")
        if req.agent not in ep.env.possible_agents:
            raise EnvError(f"no agent {req.agent!r} in {ep.env_id}")
        if not ep.aec and req.agent not in ep.observations:
            raise EnvError(f"{req.agent} has no observation now (not a live agent of episode {req.episode})")
        with ep.lock:
            move = self._run(req.episode, ep, f"scripted policy {req.policy!r}", lambda: _scripted_move(ep, req, table))
        if not isinstance(move, str) or len(move.encode()) > self.config.max_action_bytes:
            shown = f"{len(move.encode())} bytes" if isinstance(move, str) else type(move).__name__
            raise self._abort(req.episode, f"scripted policy {req.policy!r} returned {shown}, not an action text")
        return {"action": move}

    def _on_close(self, req: m.CloseRequest) -> dict[str, Any]:
        with self._lock:
            ep = self._episodes.pop(req.episode, None)
        if ep is not None:
            ep.env.close()
        return {"closed": ep is not None}

    # -- replies
    def _checked_obs(self, episode: str, agent: str, obs: Any) -> dict[str, Any]:
        if not isinstance(obs, dict):
            raise self._abort(episode, f"the observation of {agent} is {type(obs).__name__}, not a text observation")
        size = len(str(obs.get("text", "")).encode()) + sum(len(x.encode()) for x in obs.get("legal_moves", ()))
        if size > self.config.max_observation_bytes:
            raise self._abort(
                episode,
                f"the observation of {agent} is {size} bytes, over max_observation_bytes="
                f"{self.config.max_observation_bytes}",
            )
        return {
            "text": obs["text"],
            "legal_moves": list(obs.get("legal_moves", ())),
            "current_player": obs.get("current_player", ""),
        }

    def _aec_state(self, episode: str, ep: _Episode, raw_observation: Any) -> dict[str, Any]:
        env = ep.env
        selected = env.agent_selection if env.agents else ""
        observation = self._checked_obs(episode, selected, raw_observation) if selected else None
        return {
            "agents": list(env.agents),
            "agent_selection": selected,
            "rewards": {a: float(r) for a, r in env.rewards.items()},
            "cumulative_rewards": {a: float(r) for a, r in env._cumulative_rewards.items()},
            "terminations": {a: bool(v) for a, v in env.terminations.items()},
            "truncations": {a: bool(v) for a, v in env.truncations.items()},
            "infos": dict(env.infos),
            "observation": observation,
        }

    def _parallel_state(
        self, episode: str, ep: _Episode, observations: Any, rewards: Any, terms: Any, truncs: Any, infos: Any
    ) -> dict[str, Any]:
        checked = {a: self._checked_obs(episode, a, o) for a, o in observations.items()}
        ep.observations, ep.infos = checked, dict(infos)
        return {
            "agents": list(ep.env.agents),
            "observations": checked,
            "rewards": {a: float(r) for a, r in rewards.items()},
            "terminations": {a: bool(v) for a, v in terms.items()},
            "truncations": {a: bool(v) for a, v in truncs.items()},
            "infos": dict(infos),
        }


def _scripted_move(ep: _Episode, req: m.ScriptedRequest, table: Any) -> Any:
    """The move of the env's scripted policy for ``req.agent``, from what the agent sees now."""
    key = (req.policy, req.policy_seed)
    if key not in ep.policies:
        if len(ep.policies) >= _POLICIES_PER_EPISODE:
            ep.policies.clear()  # a client cycling through seeds: bounded, not remembered for ever
        ep.policies[key] = table[req.policy](req.policy_seed)
    policy = ep.policies[key]
    if ep.aec:
        raw, info = ep.env.observe(req.agent), ep.env.infos.get(req.agent, {})
    else:
        raw, info = ep.observations[req.agent], ep.infos.get(req.agent, {})
    inp = PolicyInput(
        agent=req.agent,
        episode_id=req.episode,
        env_id=ep.env_id,
        instructions=ep.env.instructions(req.agent),
        observation=TextObservation.from_raw(raw, info),
        retry=req.retry,
        seed=ep.seed,
    )
    # No history is kept here: a ScriptedPolicy takes the decision count instead; another
    # callable sees an empty history.
    return policy.move(req.agent, inp, turn=req.turn) if isinstance(policy, ScriptedPolicy) else policy(req.agent, inp)


def _then_observe(env: Any, _: Any) -> Any:
    """After a reset or step (run first, as the argument): the selected agent's observation, in
    the same guarded call, so that an env whose observe raises or hangs aborts its episode too."""
    return env.observe(env.agent_selection) if env.agents else None


__all__ = ["EnvServer"]
