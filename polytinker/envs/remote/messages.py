"""The env messages of the remote-env protocol (docs/remote-envs.md), typed at the edge.

Requests travel as plain msgpack maps inside the transport's RPC envelope, so that a server in
any language can speak them; ``parse_request`` turns one into its dataclass or raises
``ProtocolError`` saying which field is wrong. Replies are plain maps built by the server.

Kinds: ``env.list``, ``env.open``, ``env.reset``, ``env.step``, ``env.observe``, ``env.parse``,
``env.scripted`` (a move of one of the env's scripted policies), ``env.close``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polytinker.errors import ProtocolError

KIND_LIST = "env.list"
KIND_OPEN = "env.open"
KIND_RESET = "env.reset"
KIND_STEP = "env.step"
KIND_OBSERVE = "env.observe"
KIND_PARSE = "env.parse"
KIND_SCRIPTED = "env.scripted"
KIND_CLOSE = "env.close"
KINDS = (KIND_LIST, KIND_OPEN, KIND_RESET, KIND_STEP, KIND_OBSERVE, KIND_PARSE, KIND_SCRIPTED, KIND_CLOSE)

_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class OpenRequest:
    env_id: str
    # Keyword arguments for the env (scalars only), e.g. {"rounds": 3}.
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    # EnvConfig fields, e.g. {"max_retries": 0}.
    config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResetRequest:
    episode: str
    seed: int | None = None


@dataclass(frozen=True)
class StepRequest:
    episode: str
    # AEC envs: the action text of agent_selection (None for a terminated agent).
    action: str | None = None
    # Parallel envs: agent -> action text.
    actions: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ObserveRequest:
    episode: str
    agent: str


@dataclass(frozen=True)
class ParseRequest:
    episode: str
    agent: str
    text: str


@dataclass(frozen=True)
class ScriptedRequest:
    """Ask the server for the move its scripted policy ``policy`` makes for ``agent`` now."""

    episode: str
    agent: str
    # A kind the env's open reply listed under "scripted" ("random", "heuristic").
    policy: str
    # The policy's seed (None: unseeded).
    policy_seed: int | None = None
    # The agent's earlier decisions in the episode and its refusals in a row: with the episode's
    # seed they seed the move, so that a served policy plays as the same policy run locally.
    turn: int = 0
    retry: int = 0


@dataclass(frozen=True)
class CloseRequest:
    episode: str


@dataclass(frozen=True)
class ListRequest:
    pass


def _field(payload: Mapping[str, Any], kind: str, name: str, types: tuple[type, ...], required: bool = True) -> Any:
    if name not in payload:
        if required:
            raise ProtocolError(f"{kind}: missing field {name!r}")
        return None
    value = payload[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("nil" if t is type(None) else t.__name__ for t in types)
        raise ProtocolError(f"{kind}: field {name!r} must be {names}, got {type(value).__name__}")
    return value


def _scalar_map(kind: str, name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, _SCALARS) for k, v in value.items()
    ):
        raise ProtocolError(f"{kind}: field {name!r} must map names to scalars (str, int, float, bool, nil)")
    return dict(value)


def parse_request(kind: str, payload: Any) -> Any:
    """The typed request for ``kind``; ProtocolError when the payload does not fit."""
    if payload is None and kind == KIND_LIST:
        return ListRequest()
    if not isinstance(payload, Mapping):
        raise ProtocolError(f"{kind}: the payload must be a map, got {type(payload).__name__}")
    if kind == KIND_LIST:
        return ListRequest()
    if kind == KIND_OPEN:
        return OpenRequest(
            env_id=_field(payload, kind, "env_id", (str,)),
            kwargs=_scalar_map(kind, "kwargs", payload.get("kwargs")),
            config=_scalar_map(kind, "config", payload.get("config")),
        )
    episode = _field(payload, kind, "episode", (str,))
    if kind == KIND_RESET:
        return ResetRequest(episode, _field(payload, kind, "seed", (int, type(None)), required=False))
    if kind == KIND_STEP:
        action = _field(payload, kind, "action", (str, type(None)), required=False)
        actions = payload.get("actions")
        if actions is not None and (
            not isinstance(actions, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in actions.items())
        ):
            raise ProtocolError(f"{kind}: field 'actions' must map agent names to action texts")
        return StepRequest(episode, action, dict(actions) if actions is not None else None)
    if kind == KIND_OBSERVE:
        return ObserveRequest(episode, _field(payload, kind, "agent", (str,)))
    if kind == KIND_PARSE:
        return ParseRequest(episode, _field(payload, kind, "agent", (str,)), _field(payload, kind, "text", (str,)))
    if kind == KIND_SCRIPTED:
        return _scripted(payload, kind, episode)
    if kind == KIND_CLOSE:
        return CloseRequest(episode)
    raise ProtocolError(f"unknown env message kind {kind!r}; known: {', '.join(KINDS)}")


def _scripted(payload: Mapping[str, Any], kind: str, episode: str) -> ScriptedRequest:
    turn = _field(payload, kind, "turn", (int,), required=False) or 0
    retry = _field(payload, kind, "retry", (int,), required=False) or 0
    if turn < 0 or retry < 0:
        raise ProtocolError(f"{kind}: 'turn' and 'retry' must be >= 0")
    return ScriptedRequest(
        episode,
        _field(payload, kind, "agent", (str,)),
        _field(payload, kind, "policy", (str,)),
        _field(payload, kind, "policy_seed", (int, type(None)), required=False),
        turn,
        retry,
    )


__all__ = [
    "KINDS",
    "KIND_CLOSE",
    "KIND_LIST",
    "KIND_OBSERVE",
    "KIND_OPEN",
    "KIND_PARSE",
    "KIND_RESET",
    "KIND_SCRIPTED",
    "KIND_STEP",
    "CloseRequest",
    "ListRequest",
    "ObserveRequest",
    "OpenRequest",
    "ParseRequest",
    "ResetRequest",
    "ScriptedRequest",
    "StepRequest",
    "parse_request",
]
