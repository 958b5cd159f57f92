"""``RemoteEnv``: one episode of an env served elsewhere, with the PettingZoo API.

``RemoteEnv(address, env_id)`` opens an episode on the server and returns a
``RemoteAECEnv`` (an ``AECEnv``) or a ``RemoteParallelEnv`` (a ``ParallelEnv``), as the
server's env is. Both also have ``areset``/``astep`` coroutines, which the coordinator uses
so that many remote episodes overlap on one event loop. Clients of one address share one
transport connection.

A server that dies mid-episode makes the next call fail within ``request_timeout_s`` (or
sooner, when the transport's heartbeats stop) with ``RequestTimeout``/``PeerDeadError``
naming the server and the episode; an env that raised on the server arrives as ``EnvError``.
A server with ``max_episodes`` open answers the open "busy": the open raises ``EnvBusy`` (with
the server's ``retry_after_s`` and ``max_episodes``), which the coordinator waits out.

``env.scripted`` lists the env's scripted policies as the server has them (``{"random": ...,
"heuristic": ...}``, like a local env's class attribute): ``RemoteScriptedPolicy`` asks the server
for their moves (``env.scripted``), so evaluations against scripted opponents work without the
env's code on this side.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from pettingzoo import AECEnv, ParallelEnv

from polytinker.envs.base import text_spaces
from polytinker.envs.config import EnvConfig, RemoteEnvConfig
from polytinker.envs.coordinator import current_env
from polytinker.envs.remote import messages as m
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import (
    ConfigError,
    EnvBusy,
    EnvError,
    PeerDeadError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
)
from polytinker.transport.rpc import ClientCurve, RpcClient

_Key = tuple[str, ClientCurve | None]
_clients: dict[_Key, tuple[RpcClient, int]] = {}
_clients_lock = threading.Lock()


def _acquire(key: _Key) -> RpcClient:
    """The shared transport client of (address, curve): one socket for all episodes there."""
    with _clients_lock:
        client, refs = _clients.get(key, (None, 0))
        if client is None:
            client = RpcClient(key[0], curve=key[1])
        _clients[key] = (client, refs + 1)
        return client


def _release(key: _Key) -> None:
    with _clients_lock:
        client, refs = _clients.get(key, (None, 0))
        if client is None:
            return
        if refs <= 1:
            del _clients[key]
            client.close()
        else:
            _clients[key] = (client, refs - 1)


class _Inbox:
    """Replies for one event loop, handed to it in batches. ``asyncio.wrap_future`` wakes the loop
    once per reply (a write to its self-pipe from the client's I/O thread, which gives the GIL
    away each time); the replies the I/O thread reads in one go here wake it once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak: _inboxes is keyed by the loop, which a strong reference here would keep for ever.
        self._loop = weakref.ref(loop)
        self._replies: collections.deque[tuple[asyncio.Future[Any], Future[Any]]] = collections.deque()
        self._due = False  # a _deliver is queued on the loop
        self._lock = threading.Lock()

    def put(self, waiter: asyncio.Future[Any], reply: Future[Any]) -> None:
        """On the client's I/O thread (the reply future's done callback)."""
        self._replies.append((waiter, reply))
        if self._due:  # a _deliver not yet begun: it will see this one
            return
        with self._lock:
            if self._due:
                return
            self._due = True
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits any more
                loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        self._due = False  # before reading: a reply put from now on queues another _deliver
        replies = self._replies
        while replies:
            waiter, reply = replies.popleft()
            if waiter.done():  # its caller was cancelled
                continue
            if reply.cancelled():
                waiter.cancel()
            elif (exc := reply.exception()) is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(reply.result())


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = weakref.WeakKeyDictionary()


async def _reply(future: Future[Any]) -> Any:
    """``await asyncio.wrap_future(future)``, woken through the loop's inbox; cancelling the
    awaiting task cancels the call (and so the request on the server)."""
    loop = asyncio.get_running_loop()
    inbox = _inboxes.get(loop)
    if inbox is None:
        inbox = _inboxes[loop] = _Inbox(loop)
    waiter = loop.create_future()
    future.add_done_callback(functools.partial(inbox.put, waiter))
    try:
        return await waiter
    except asyncio.CancelledError:
        future.cancel()
        raise


@contextlib.contextmanager
def _opening(key: _Key, env_id: str) -> Iterator[None]:
    """Around the open call, sync or async: a failure gives the shared client back and says what failed."""
    try:
        yield
    except Exception as exc:
        _release(key)
        raise _translate(exc, f"opening {env_id} at {key[0]}") from exc


def _translate(exc: BaseException, what: str) -> BaseException:
    """Transport errors to errors that name the env and say what to check."""
    if isinstance(exc, RemoteError):
        if exc.code == ProtocolError.code:
            return ProtocolError(f"{what}: the server refused the request: {exc.args[0]}")
        if exc.code == ConfigError.code:
            return ConfigError(f"{what}: {exc.args[0]}")
        return EnvError(f"{what}: {exc.args[0]}")
    if isinstance(exc, RequestTimeout):
        return RequestTimeout(f"{what}: no reply in time; is the env server still running? ({exc})")
    if isinstance(exc, PeerDeadError):
        return PeerDeadError(f"{what}: the env server stopped answering (dead or unreachable): {exc}")
    return exc


class RemoteEnv:
    """Opens an episode; ``RemoteEnv(...)`` returns a RemoteAECEnv or a RemoteParallelEnv."""

    address: str
    env_id: str
    episode: str

    def __new__(
        cls,
        address: str,
        env_id: str,
        *,
        config: RemoteEnvConfig | None = None,
        env_kwargs: dict[str, Any] | None = None,
        env_config: EnvConfig | dict[str, Any] | None = None,
        curve: ClientCurve | None = None,
    ) -> Any:
        if cls is not RemoteEnv:
            return super().__new__(cls)
        config = config or RemoteEnvConfig()
        key = (address, curve)
        client, payload = _acquire(key), _open_payload(env_id, env_kwargs, env_config)
        with _opening(key, env_id):
            hello = client.call(m.KIND_OPEN, payload, timeout_s=config.request_timeout_s)
        return _opened(key, env_id, client, hello, config)

    @classmethod
    async def aopen(
        cls,
        address: str,
        env_id: str,
        *,
        config: RemoteEnvConfig | None = None,
        env_kwargs: dict[str, Any] | None = None,
        env_config: EnvConfig | dict[str, Any] | None = None,
        curve: ClientCurve | None = None,
    ) -> Any:
        """``RemoteEnv(...)`` without blocking the event loop (``make_env`` may return this)."""
        config = config or RemoteEnvConfig()
        key = (address, curve)
        client, payload = _acquire(key), _open_payload(env_id, env_kwargs, env_config)
        with _opening(key, env_id):
            future = client.call_async(m.KIND_OPEN, payload, timeout_s=config.request_timeout_s)
            hello = await _reply(future)
        return _opened(key, env_id, client, hello, config)

    def __init__(self, address: str, env_id: str, **kwargs: Any) -> None:
        # All set up in __new__ / aopen (Python calls __init__ again on what __new__ returns).
        pass

    def _setup(self, key: _Key, env_id: str, client: RpcClient, hello: dict, config: RemoteEnvConfig) -> None:
        self._key = key
        self.address, self.env_id, self._client, self._cfg = key[0], env_id, client, config
        self.episode = str(hello["episode"])
        self.possible_agents = list(hello["possible_agents"])
        self.metadata = {"name": hello.get("name", env_id), "render_modes": [], "remote": key[0]}
        self._instructions = dict(hello["instructions"])
        # What each agent may call (run on this side, by the agents' runtime); a server that sends
        # none gives no tools.
        self._tools = {str(a): tuple(str(t) for t in names) for a, names in (hello.get("tools") or {}).items()}
        env_config = EnvConfig(
            max_observation_chars=int(hello["max_observation_chars"]), max_action_chars=int(hello["max_action_chars"])
        )
        self._obs_spaces, self._act_spaces = text_spaces(self.possible_agents, env_config)
        # The server plays these (env.scripted); a server that lists none leaves the random policy
        # to this side (scripted_policy's default), which needs only the legal moves.
        self.scripted = {str(k): functools.partial(RemoteScriptedPolicy, str(k)) for k in hello.get("scripted") or ()}
        self._closed = False

    # -- calls
    def _call(self, kind: str, payload: dict[str, Any]) -> Any:
        try:
            return self._client.call(kind, payload, timeout_s=self._cfg.request_timeout_s)
        except Exception as exc:
            raise _translate(exc, f"{kind} of {self.env_id} episode {self.episode} at {self.address}") from exc

    async def _acall(self, kind: str, payload: dict[str, Any]) -> Any:
        future = self._client.call_async(kind, payload, timeout_s=self._cfg.request_timeout_s)
        try:
            return await _reply(future)
        except Exception as exc:
            raise _translate(exc, f"{kind} of {self.env_id} episode {self.episode} at {self.address}") from exc

    # -- the text-env surface
    def observation_space(self, agent: AgentID) -> Any:
        return self._obs_spaces[agent]

    def action_space(self, agent: AgentID) -> Any:
        return self._act_spaces[agent]

    def instructions(self, agent: AgentID) -> str:
        return str(self._instructions[agent])

    def tools(self, agent: AgentID) -> tuple[str, ...]:
        return self._tools.get(agent, ())

    def parse_action(self, agent: AgentID, text: str) -> str | InvalidAction:
        reply = self._call(m.KIND_PARSE, {"episode": self.episode, "agent": agent, "text": text})
        return str(reply["move"]) if reply["valid"] else InvalidAction(str(reply["reason"]))

    def scripted_move(
        self, agent: AgentID, policy: str, policy_seed: int | None = None, *, turn: int = 0, retry: int = 0
    ) -> str:
        """The move the server's scripted ``policy`` makes for ``agent`` now (``env.scripted``)."""
        payload = _scripted_payload(self.episode, agent, policy, policy_seed, turn, retry)
        return str(self._call(m.KIND_SCRIPTED, payload)["action"])

    async def ascripted_move(
        self, agent: AgentID, policy: str, policy_seed: int | None = None, *, turn: int = 0, retry: int = 0
    ) -> str:
        """``scripted_move`` without blocking the event loop. A dead or silent server is an
        ``EnvError`` here, so that the coordinator aborts the episode rather than the run."""
        payload = _scripted_payload(self.episode, agent, policy, policy_seed, turn, retry)
        try:
            reply = await self._acall(m.KIND_SCRIPTED, payload)
        except (RequestTimeout, PeerDeadError) as exc:
            raise EnvError(str(exc)) from exc
        return str(reply["action"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._client.call(m.KIND_CLOSE, {"episode": self.episode}, timeout_s=self._cfg.request_timeout_s)
        except Exception:
            pass  # the server may be gone; the episode dies with it (or expires there)
        finally:
            _release(self._key)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._acall(m.KIND_CLOSE, {"episode": self.episode})
        except Exception:
            pass
        finally:
            _release(self._key)


def _open_payload(
    env_id: str, env_kwargs: dict[str, Any] | None, env_config: EnvConfig | dict[str, Any] | None
) -> dict:
    config = dataclasses.asdict(env_config) if isinstance(env_config, EnvConfig) else dict(env_config or {})
    return {"env_id": env_id, "kwargs": dict(env_kwargs or {}), "config": config}


def _scripted_payload(
    episode: str, agent: AgentID, policy: str, policy_seed: int | None, turn: int, retry: int
) -> dict[str, Any]:
    return {
        "episode": episode,
        "agent": agent,
        "policy": policy,
        "policy_seed": policy_seed,
        "turn": turn,
        "retry": retry,
    }


class RemoteScriptedPolicy:
    """A scripted policy of a remote env, played by its server: the policy for the episodes of
    that env (``scripted_policy(remote_env, "heuristic", seed)`` makes one). A coroutine policy:
    the coordinator awaits its move, asked for the episode being played (``current_env()``)."""

    def __init__(self, kind: str, seed: int | None = None) -> None:
        self.kind, self.seed = kind, seed

    async def __call__(self, agent: AgentID, inp: PolicyInput) -> str:
        env = current_env()
        env = getattr(env, "unwrapped", env)  # through PettingZoo's wrappers (and play's view)
        if not isinstance(env, RemoteEnv):
            raise ConfigError(
                f"the scripted policy {self.kind!r} of a remote env plays only in episodes of a remote env "
                f"(this episode's env is {type(env).__name__}); use the local env's scripted_policy there"
            )
        return await env.ascripted_move(agent, self.kind, self.seed, turn=len(inp.history), retry=inp.retry)


def _opened(key: _Key, env_id: str, client: RpcClient, hello: Any, config: RemoteEnvConfig) -> Any:
    if isinstance(hello, dict) and hello.get("busy"):
        _release(key)
        raise EnvBusy(
            f"opening {env_id} at {key[0]}: {hello.get('reason', 'the server is busy')}",
            float(hello.get("retry_after_s", 0.5)),
            int(hello.get("max_episodes", 0)),
        )
    if not isinstance(hello, dict) or hello.get("kind") not in ("aec", "parallel"):
        _release(key)
        raise ProtocolError(f"opening {env_id} at {key[0]}: the reply is not an env.open reply: {hello!r:.200}")
    sub = RemoteAECEnv if hello["kind"] == "aec" else RemoteParallelEnv
    env = object.__new__(sub)
    env._setup(key, env_id, client, hello, config)
    return env


def _obs(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    return {"text": raw["text"], "legal_moves": tuple(raw["legal_moves"]), "current_player": raw["current_player"]}


class RemoteAECEnv(RemoteEnv, AECEnv):
    """A remote turn-taking env; state arrives with each reply, ``observe`` of another agent asks."""

    def _apply(self, state: dict[str, Any]) -> None:
        self.agents = list(state["agents"])
        self.agent_selection = state["agent_selection"]
        self.rewards = dict(state["rewards"])
        self._cumulative_rewards = dict(state["cumulative_rewards"])
        self.terminations = dict(state["terminations"])
        self.truncations = dict(state["truncations"])
        self.infos = {a: dict(i) for a, i in state["infos"].items()}
        self._observation = (self.agent_selection, _obs(state["observation"]))

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        self._apply(self._call(m.KIND_RESET, {"episode": self.episode, "seed": seed}))

    def step(self, action: Any) -> None:
        self._apply(self._call(m.KIND_STEP, {"episode": self.episode, "action": action}))

    async def areset(self, seed: int | None = None, options: dict | None = None) -> None:
        self._apply(await self._acall(m.KIND_RESET, {"episode": self.episode, "seed": seed}))

    async def astep(self, action: Any) -> None:
        self._apply(await self._acall(m.KIND_STEP, {"episode": self.episode, "action": action}))

    def observe(self, agent: AgentID) -> Any:
        who, obs = self._observation
        if agent == who and obs is not None:
            return obs
        return _obs(self._call(m.KIND_OBSERVE, {"episode": self.episode, "agent": agent}))

    def render(self) -> str:
        obs = self.observe(self.agent_selection)
        return str(obs["text"]) if obs else ""


class RemoteParallelEnv(RemoteEnv, ParallelEnv):
    """A remote simultaneous-move env."""

    def _apply(self, state: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        self.agents = list(state["agents"])
        observations = {a: _obs(o) for a, o in state["observations"].items()}
        infos = {a: dict(i) for a, i in state["infos"].items()}
        return observations, dict(state["rewards"]), dict(state["terminations"]), dict(state["truncations"]), infos

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        observations, _, _, _, infos = self._apply(self._call(m.KIND_RESET, {"episode": self.episode, "seed": seed}))
        return observations, infos

    def step(self, actions: dict[AgentID, Any]) -> tuple[dict, dict, dict, dict, dict]:
        return self._apply(self._call(m.KIND_STEP, {"episode": self.episode, "actions": _texts(actions)}))

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        state = await self._acall(m.KIND_RESET, {"episode": self.episode, "seed": seed})
        observations, _, _, _, infos = self._apply(state)
        return observations, infos

    async def astep(self, actions: dict[AgentID, Any]) -> tuple[dict, dict, dict, dict, dict]:
        return self._apply(await self._acall(m.KIND_STEP, {"episode": self.episode, "actions": _texts(actions)}))


def _texts(actions: dict[AgentID, Any]) -> dict[AgentID, str]:
    # The wire carries text; anything else (PettingZoo's checker samples) becomes its str.
    return {a: v if isinstance(v, str) else str(v) for a, v in actions.items()}


__all__ = ["RemoteAECEnv", "RemoteEnv", "RemoteParallelEnv", "RemoteScriptedPolicy"]
