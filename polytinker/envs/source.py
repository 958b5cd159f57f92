"""``EnvSource``: where the episodes of one env come from, the same for training, play and checks.

An env is named by its id and, optionally, the address of an env server:

- ``EnvSource("tictactoe-v0")``: a registered id (or a ``"package.module:Class"`` entry point),
  built in this process by ``make``;
- ``EnvSource("tictactoe-v0", address="tcp://host:5599")``: an id that the env server at that
  address serves (``polytinker env serve``), played over ZeroMQ; nothing of the env is imported
  here, and its scripted opponents are played by the server.

``polytinker train`` (``[env] id`` and ``address``, or ``--env-address``), ``polytinker env play``
and ``polytinker env check`` (``--env-address``) all build one, so they accept the same names.
The ``EnvConfig`` (retries, penalties) goes to the env either way: as ``config=`` to a local env,
in the ``env.open`` request to a server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polytinker.envs.config import EnvConfig, RemoteEnvConfig
from polytinker.envs.registry import make
from polytinker.envs.remote.client import RemoteEnv
from polytinker.errors import ConfigError

ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class EnvSource:
    """One env, local or served; ``make()`` opens an episode's env, ``factory()`` is the
    coordinator's ``make_env``."""

    env_id: str
    """A registered id or ``"package.module:Class"`` (local); an id the server serves (remote)."""
    address: str = ""
    """The env server's ZeroMQ address (``tcp://HOST:PORT``); empty: build the env here."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env (scalars only for a remote env: they travel in ``env.open``)."""
    config: EnvConfig | None = None
    """How the env treats invalid actions; None: the env's defaults."""
    remote: RemoteEnvConfig = field(default_factory=RemoteEnvConfig)
    """Timeouts of the remote env client."""
    curve: Any = None
    """A ``ClientCurve`` for a server bound with Curve (``polytinker.transport.rpc``)."""

    def __post_init__(self) -> None:
        if not self.env_id:
            raise ConfigError("an env needs an id, e.g. 'tictactoe-v0' (`polytinker env list` shows them)")
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        if not self.address:
            return
        if not self.address.startswith(ADDRESS_SCHEMES):
            raise ConfigError(
                f"env address {self.address!r} must be a ZeroMQ address such as tcp://127.0.0.1:5599 "
                "(where `polytinker env serve ... --bind` listens)"
            )
        if ":" in self.env_id:
            raise ConfigError(f"a remote env is named by the id its server serves, not an entry point: {self.env_id!r}")
        bad = sorted(k for k, v in self.kwargs.items() if not isinstance(v, _SCALARS))
        if bad:
            raise ConfigError(f"env kwargs {bad} of a remote env must be scalars (str, int, float, bool)")

    @property
    def is_remote(self) -> bool:
        return bool(self.address)

    def describe(self) -> str:
        return f"{self.env_id} at {self.address}" if self.address else self.env_id

    def _config_kwargs(self) -> dict[str, Any]:
        return {"config": self.config} if self.config is not None else {}

    def make(self) -> Any:
        """A new env (an opened remote episode, for a remote env): the caller closes it."""
        if self.address:
            return RemoteEnv(
                self.address, self.env_id, config=self.remote, env_kwargs=dict(self.kwargs),
                env_config=self.config, curve=self.curve,
            )  # fmt: skip

        return make(self.env_id, **self._config_kwargs(), **self.kwargs)

    def factory(self) -> Any:
        """The coordinator's ``make_env``: a new env per call, or, for a remote env, the awaitable
        of its opening (so that opens do not block the event loop)."""
        if not self.address:
            return self.make

        def open_remote() -> Any:
            return RemoteEnv.aopen(
                self.address, self.env_id, config=self.remote, env_kwargs=dict(self.kwargs),
                env_config=self.config, curve=self.curve,
            )  # fmt: skip

        return open_remote


__all__ = ["ADDRESS_SCHEMES", "EnvSource"]
