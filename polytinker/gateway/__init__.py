"""polytinker.gateway: the HTTP front door, a client of the scheduler like any other.

It serves the Tinker HTTP API (what the official ``tinker`` SDK and tinker-cookbook speak: routes in
``tinker_api.py`` and ``tinker_api_runs.py``, the calls in ``tinker_backend.py`` and
``tinker_weights.py``) and OpenAI's ``/v1`` (``openai_api.py``) through
:mod:`polytinker.client`, on a FastAPI app (``app.Gateway``). ``HttpRuntime`` (``runtime.py``) is a
local runtime with its gateway, what ``polytinker serve --http`` runs; ``polytinker gateway`` runs
one alone in front of a scheduler elsewhere (``_cli.py``). docs/tinker.md and docs/openai.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polytinker.gateway.app import Gateway
    from polytinker.gateway.runtime import HttpRuntime

# Loaded on first use: ``polytinker --help`` imports this package's commands, not FastAPI.
_LAZY = {"Gateway": "polytinker.gateway.app", "HttpRuntime": "polytinker.gateway.runtime"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polytinker.gateway' has no attribute {name!r}")


__all__ = ["Gateway", "HttpRuntime"]
