"""torch.distributed boilerplate in one place.

- ``DistInfo``: rank, world size, local rank, device of this process.
- ``init_distributed()``: joins the process group described by the environment (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), as ``torchrun`` sets it;
  gloo on the CPU, NCCL on a GPU. Without ``WORLD_SIZE`` it is a single process and no group is
  created. (``group.LearnerGroup.start`` spawns a group itself, with an explicit TCP address.)
- ``all_reduce_sum_``: sums tensors across ranks in place, flattened into one buffer per dtype.
- ``log0``: logs on rank 0 only.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from polytinker.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    # This process's index in the group, 0-based; rank 0 talks to the outside world and logs.
    world_size: int
    # Number of processes in the group; 1 means no collective is ever called.
    local_rank: int
    # Index on this machine; picks the GPU.
    device: torch.device
    # Where this rank's model lives.

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"DistInfo: rank {self.rank} is outside world size {self.world_size}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def init_distributed(backend: str | None = None, device: str | None = None) -> DistInfo:
    """Join the group the environment names (idempotent); a lone process without it gets rank 0 of 1.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise; ``device`` to the local
    GPU or the CPU.
    """
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(0, 1, 0, torch.device("cuda:0" if use_cuda else "cpu"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        chosen = backend or ("nccl" if use_cuda else "gloo")
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise ConfigError(f"init_distributed: {key} is not set; launch with torchrun (or set them)")
        dist.init_process_group(backend=chosen, rank=rank, world_size=world, device_id=dev if use_cuda else None)
        log0(log, "joined a %s group of %d", chosen, world)
    return DistInfo(rank, world, local_rank, dev)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def all_reduce_sum_(tensors: Sequence[torch.Tensor], group: Any = None) -> None:
    """Sum ``tensors`` over all ranks, in place; one collective per dtype rather than one per tensor."""
    if not dist.is_initialized():  # a group of one still reduces: the NCCL/gloo path stays exercised
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Make every rank hold rank ``src``'s values (e.g. a freshly initialised adapter)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():  # in place on leaf parameters: autograd must not record it
        for t in tensors:
            dist.broadcast(t, src=src)


def log0(logger: logging.Logger, msg: str, *args: Any) -> None:
    """Log at INFO on rank 0 only, so a group of K processes prints each line once."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(msg, *args)


__all__ = [
    "SINGLE",
    "DistInfo",
    "all_reduce_sum_",
    "broadcast_",
    "free_port",
    "init_distributed",
    "log0",
]
