"""Where a worker's model lives, and in which dtype: the one home of device and dtype names.

A device is ``auto`` (the first CUDA device when torch sees one, else the CPU), ``cpu``, ``cuda``
(``cuda:0``) or ``cuda:N``. A group of ``world_size`` replicas on ``cuda:N`` takes the devices N to
N + world_size - 1, one per rank, so several workers share a multi-GPU host by their device (an
engine on 0-1, learners from 2 on) or by ``CUDA_VISIBLE_DEVICES`` per worker. A dtype is ``auto``
(bfloat16 on CUDA, float32 on the CPU, where float32 is fast and exact), ``float32`` or
``bfloat16``.

``check_device`` / ``check_dtype`` check the spelling where a config is read (no torch needed, so
a scheduler host without CUDA accepts a config whose remote workers have it); ``resolve_device``
checks the machine, where the worker starts: asking for CUDA where torch sees none is a
``ConfigError`` that says so, before any model loads.
"""

from __future__ import annotations

import re
from typing import Any

from polytinker.engine.models import DType
from polytinker.errors import ConfigError

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("auto", "float32", "bfloat16")


def check_device(field: str, spec: object) -> None:
    if not isinstance(spec, str) or DEVICE_PATTERN.fullmatch(spec) is None:
        raise ConfigError(f"{field} must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}")


def check_dtype(field: str, spec: object) -> None:
    if spec not in DTYPES:
        raise ConfigError(f"{field} must be one of {', '.join(DTYPES)}, got {spec!r}")


def resolve_device(spec: str, world_size: int = 1) -> Any:
    """The ``torch.device`` of rank 0 (rank r: the index plus r on CUDA); ``ConfigError`` when
    this machine lacks what ``spec`` asks for."""
    import torch

    check_device("device", spec)
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"device {spec!r}: torch {torch.__version__} ({build}) sees no CUDA device on this machine; "
            "use device = 'cpu', or 'auto' to take a GPU only where there is one"
        )
    first = int(spec.split(":")[1]) if ":" in spec else 0
    count = torch.cuda.device_count()
    if first + world_size > count:
        wanted = f"cuda:{first}" if world_size == 1 else f"cuda:{first}..cuda:{first + world_size - 1}"
        raise ConfigError(f"device {spec!r}: {wanted} asked for, but this machine has {count} CUDA device(s)")
    return torch.device(f"cuda:{first}")


def rank_device(device: Any, rank: int) -> Any:
    """Rank ``rank``'s device in a group whose rank 0 is on ``device``."""
    import torch

    if device.type != "cuda":
        return device
    return torch.device(f"cuda:{(device.index or 0) + rank}")


def resolve_dtype(spec: str, device: Any) -> DType:
    check_dtype("dtype", spec)
    if spec == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return "bfloat16" if spec == "bfloat16" else "float32"


__all__ = ["DTYPES", "check_device", "check_dtype", "rank_device", "resolve_device", "resolve_dtype"]
