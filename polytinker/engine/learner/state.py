"""Checkpoints of one slot (adapter or full model): tensors, optimizer state, version; written atomically.

A checkpoint is a directory:

- ``weights.safetensors``: the slot's tensors (peft key layout for an adapter);
- ``optimizer.pt``: AdamW's ``state_dict`` (tensors and numbers only: read back with ``weights_only=True``);
- ``meta.json``: format, mode, adapter name, version, LoRA shape.

It is written into a sibling temporary directory, every file fsynced, then renamed into place, so
a crash leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from polytinker.engine.learner.sharding import copy_into_shards
from polytinker.errors import ConfigError

FORMAT_VERSION = 1
WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"


@dataclass
class Checkpoint:
    tensors: dict[str, torch.Tensor]  # on the CPU
    optimizer_state: dict[str, Any] | None  # None: the slot had not stepped yet
    meta: dict[str, Any]  # format, mode, adapter, version, lora


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic_dir(path: str | os.PathLike[str], write: Any) -> Path:
    """Call ``write(tmp_dir)`` to fill a fresh directory, fsync it, then rename it to ``path``
    (replacing an older one)."""
    final = Path(path).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        for child in tmp.iterdir():
            _fsync_path(child)
        _fsync_path(tmp)
        if final.exists():
            # rename cannot replace a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            old.rmdir()
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_checkpoint(path: str | os.PathLike[str], ckpt: Checkpoint) -> Path:
    def write(tmp: Path) -> None:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in ckpt.tensors.items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        if ckpt.optimizer_state is not None:
            torch.save(ckpt.optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps({"format": FORMAT_VERSION, **ckpt.meta}, indent=2))

    return write_atomic_dir(path, write)


def load_checkpoint(path: str | os.PathLike[str], *, optimizer: bool = True) -> Checkpoint:
    """The checkpoint at ``path``; ``optimizer=False`` leaves its optimizer state unread (None)."""
    root = Path(path)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        raise ConfigError(f"{root} is not a learner checkpoint (no {META_FILE}); pass a directory save_state wrote")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{root}: checkpoint format {meta.get('format')} is not {FORMAT_VERSION}")
    opt_path = root / OPTIMIZER_FILE
    optimizer_state = None
    if optimizer and opt_path.is_file():
        optimizer_state = torch.load(opt_path, map_location="cpu", weights_only=True)
    return Checkpoint(load_file(str(root / WEIGHTS_FILE)), optimizer_state, meta)


def copy_full_weights(path: str | os.PathLike[str], ckpt: Checkpoint, params: Mapping[str, torch.Tensor]) -> None:
    """Copy a full-parameter checkpoint's weights into ``params`` (by parameter name), refusing one
    that is not full model weights or lacks a parameter."""
    if ckpt.meta.get("mode") != "full":
        raise ConfigError(f"{path} holds a {ckpt.meta.get('mode')!r} checkpoint, not full model weights")
    missing = sorted(set(params) - set(ckpt.tensors))
    if missing:
        raise ConfigError(f"{path} lacks parameters {missing[:3]}; was it saved from another model?")
    copy_into_shards(params, ckpt.tensors)


def load_full_weights(path: str | os.PathLike[str], model: torch.nn.Module) -> None:
    """Copy a full-parameter checkpoint's weights into ``model`` (same architecture), without
    reading its optimizer state. An engine serves a full-parameter job's version this way: the
    checkpoint is the export, so no second copy of the weights is written."""
    copy_full_weights(path, load_checkpoint(path, optimizer=False), dict(model.named_parameters()))


__all__ = [
    "Checkpoint",
    "copy_full_weights",
    "load_checkpoint",
    "load_full_weights",
    "save_checkpoint",
    "write_atomic_dir",
]
