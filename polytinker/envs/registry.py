"""The env registry: versioned ids to lazily imported entry points.

``register("mygame-v0", entry_point="mypkg.games:MyGame", rounds=3)`` records the id; nothing is
imported until ``make("mygame-v0", rounds=5)`` (keyword overrides win over registered ones).
The entry point may also be the class or factory function itself (``entry_point=MyGame``), for
envs defined in a script or a notebook.
Ids end in ``-vN`` so that a changed game gets a new id rather than silently new rules.
Third-party packages add envs through the entry-point group ``polytinker.envs``: each entry's
name is the env id and its value the entry point, for example in ``pyproject.toml``::

    [project.entry-points."polytinker.envs"]
    "mygame-v0" = "mypkg.games:MyGame"
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from polytinker.errors import ConfigError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "polytinker.envs"
# An optional namespace before a slash: "textarena/TicTacToe-v0".
_ID_RE = re.compile(r"^(?:[A-Za-z][A-Za-z0-9_.]*/)?[A-Za-z][A-Za-z0-9_.]*-v\d+$")
# Namespaces whose ids register on demand: the hook registers the id asked for (or says why not).
_NAMESPACES = {"textarena": "polytinker.envs.textarena_adapter:register_textarena_id"}
_ENTRY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class EnvSpec:
    """One registered env."""

    id: str
    # "package.module:attr" (attr is a class or a function returning an env), or that class or
    # function itself.
    entry_point: str | Callable[..., Any]
    # Keyword arguments passed to the entry point (``make`` overrides them).
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Where the registration came from: "builtin", "register()" or the plugin's distribution.
    source: str = "register()"

    def load(self) -> Callable[..., Any]:
        if callable(self.entry_point):
            return self.entry_point
        return load_entry_point(self.entry_point)

    @property
    def entry_point_name(self) -> str:
        """The entry point as text: "package.module:attr" for a callable too."""
        return entry_point_name(self.entry_point)


_REGISTRY: dict[str, EnvSpec] = {}
_plugins_loaded = False


def load_entry_point(entry_point: str) -> Callable[..., Any]:
    """Import ``module:attr`` and return the attribute, with errors that say what to fix."""
    if not _ENTRY_RE.match(entry_point):
        raise ConfigError(f"entry point {entry_point!r} must look like 'package.module:ClassName'")
    module_name, attr = entry_point.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for entry point {entry_point!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"module {module_name!r} has no attribute {attr!r} (entry point {entry_point!r})"
            ) from None
    if not callable(obj):
        raise ConfigError(f"entry point {entry_point!r} is not callable")
    return obj  # type: ignore[no-any-return]


def entry_point_name(entry_point: str | Callable[..., Any]) -> str:
    """``"package.module:attr"`` for a string or a callable entry point (for listings and messages)."""
    if isinstance(entry_point, str):
        return entry_point
    module = getattr(entry_point, "__module__", None) or "?"
    return f"{module}:{getattr(entry_point, '__qualname__', type(entry_point).__name__)}"


def register(id: str, entry_point: str | Callable[..., Any], *, source: str = "register()", **kwargs: Any) -> EnvSpec:
    """Register an env id for an entry point: ``"package.module:attr"`` (imported at ``make``), or
    a class or factory function. Refuses malformed ids and entry points, and ids already taken."""
    if not _ID_RE.match(id):
        raise ConfigError(f"env id {id!r} must be a name and a version, like 'tictactoe-v0'")
    if isinstance(entry_point, str):
        if not _ENTRY_RE.match(entry_point):
            raise ConfigError(f"entry point {entry_point!r} must look like 'package.module:ClassName'")
    elif not callable(entry_point):
        raise ConfigError(
            f"entry point {entry_point!r} must be 'package.module:ClassName', a class or a function "
            f"returning an env, got {type(entry_point).__name__}"
        )
    if id in _REGISTRY:
        prior = _REGISTRY[id]
        raise ConfigError(
            f"env id {id!r} is already registered (entry point {prior.entry_point_name!r}, from {prior.source}); "
            "register the changed env under a new version, e.g. "
            f"{id.rsplit('-v', 1)[0]}-v{int(id.rsplit('-v', 1)[1]) + 1}"
        )
    spec = EnvSpec(id=id, entry_point=entry_point, kwargs=MappingProxyType(dict(kwargs)), source=source)
    _REGISTRY[id] = spec
    return spec


def unregister(id: str) -> None:
    """Remove an id (tests and interactive use)."""
    _REGISTRY.pop(id, None)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        source = f"plugin {ep.dist.name if ep.dist else ep.value}"
        try:
            register(ep.name, ep.value, source=source)
        except ConfigError as exc:
            # One broken plugin must not take the built-in games down with it.
            log.warning("skipping env plugin %s = %s: %s", ep.name, ep.value, exc)


def env_specs() -> Mapping[str, EnvSpec]:
    """Every registered env, plugins included, by id."""
    _load_plugins()
    return MappingProxyType(_REGISTRY)


def spec(id: str) -> EnvSpec:
    specs = env_specs()
    namespace = id.split("/", 1)[0] if "/" in id else ""
    if id not in specs and namespace in _NAMESPACES:
        load_entry_point(_NAMESPACES[namespace])(id)
    if id not in specs:
        close = [k for k in specs if k.split("-v")[0] == id.split("-v")[0]]
        hint = f" Did you mean {', '.join(close)}?" if close else " `polytinker env list` shows the ids."
        raise ConfigError(f"no env registered as {id!r}.{hint}")
    return specs[id]


def make(id: str, **overrides: Any) -> Any:
    """A new env instance for a registered id (or a ``module:Class`` entry point)."""
    if ":" in id:
        return load_entry_point(id)(**overrides)
    s = spec(id)
    return s.load()(**{**s.kwargs, **overrides})


_BUILTINS = {
    "tictactoe-v0": ("polytinker.envs.games.tictactoe:TicTacToeEnv", {}),
    "connect_four-v0": ("polytinker.envs.games.connect_four:ConnectFourEnv", {}),
    "kuhn_poker-v0": ("polytinker.envs.games.kuhn_poker:KuhnPokerEnv", {}),
    "prisoners_dilemma-v0": ("polytinker.envs.games.prisoners_dilemma:PrisonersDilemmaEnv", {}),
    "signal-v0": ("polytinker.envs.games.signal:SignalEnv", {}),
    "negotiation-v0": ("polytinker.envs.games.negotiation:NegotiationEnv", {}),
    "guess_number-v0": ("polytinker.envs.games.guess_number:GuessNumberEnv", {}),
    "debate-v0": ("polytinker.envs.games.debate:DebateEnv", {}),
    "textworld-v0": ("polytinker.envs.games.textworld:TextWorldEnv", {}),
    "math-v0": ("polytinker.envs.games.math:MathEnv", {}),
    "math_tool-v0": ("polytinker.envs.games.math:MathToolEnv", {}),
    "solver_verifier-v0": ("polytinker.envs.games.solver_verifier:SolverVerifierEnv", {}),
    "gomoku-v0": ("polytinker.envs.games.gomoku:GomokuEnv", {}),
    "pz_tictactoe-v3": ("polytinker.envs.adapter:pettingzoo_text_env", {"env": "pettingzoo.classic.tictactoe_v3"}),
    "pz_connect_four-v3": (
        "polytinker.envs.adapter:pettingzoo_text_env",
        {"env": "pettingzoo.classic.connect_four_v3"},
    ),
}
for _id, (_entry, _kwargs) in _BUILTINS.items():
    register(_id, _entry, source="builtin", **_kwargs)

__all__ = [
    "ENTRY_POINT_GROUP",
    "EnvSpec",
    "entry_point_name",
    "env_specs",
    "load_entry_point",
    "make",
    "register",
    "spec",
    "unregister",
]
