"""The served model's tokenizer under its hub id, for clients on the serving machine.

``get_info`` names the tokenizer the SDK's ``get_tokenizer`` (and tinker-cookbook's, by the model
name a recipe is given) loads with ``AutoTokenizer.from_pretrained``. For a model that stands for a
hub id (``smollm2-135m-instruct``: ``HuggingFaceTB/SmolLM2-135M-Instruct``) the gateway answers the
hub id, and first makes sure the Hugging Face cache of this machine holds that id's tokenizer, so
``from_pretrained(hub_id)`` loads with ``HF_HUB_OFFLINE=1``. Where the cache has none, the model's
tokenizer files are placed there in the cache's documented layout
(https://huggingface.co/docs/huggingface_hub/guides/manage-cache)::

    $HF_HUB_CACHE/models--ORG--NAME/refs/main            the snapshot's revision
    $HF_HUB_CACHE/models--ORG--NAME/snapshots/REV/FILE   the tokenizer files and config.json (copies, no blobs)

``REV`` is a hash of the files' contents. A cache that already resolves the id's tokenizer (the
hub's own download) is left as it is; one whose ``refs/main`` names another snapshot without a
tokenizer is not touched either, and ``get_info`` then answers the model's directory here instead.
A model without a hub id (``tiny-random``, a local directory) is answered by its directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from polytinker.engine.models import hub_id, resolve_model

log = logging.getLogger("polytinker.http")

# What AutoTokenizer reads (whichever of them a model has): the model's config.json too (it looks
# there for the model's type); the weights stay out.
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
PROBES = ("config.json", "tokenizer_config.json")  # a cache that resolves both has what AutoTokenizer needs


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache of this process: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (huggingface_hub's own resolution of them)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _revision(files: list[Path]) -> str:
    """A 40-hex revision named by the files' names and bytes: the same tokenizer, the same snapshot."""
    digest = hashlib.sha1(usedforsecurity=False)
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def place_tokenizer(hub_id: str, model_dir: Path, cache_dir: Path | None = None) -> bool:
    """Make ``AutoTokenizer.from_pretrained(hub_id)`` load offline from ``cache_dir`` (the hub
    cache by default), copying ``model_dir``'s tokenizer files there if it does not already;
    whether it will."""
    from huggingface_hub import try_to_load_from_cache

    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    if all(isinstance(try_to_load_from_cache(hub_id, f, cache_dir=str(cache)), str) for f in PROBES):
        return True  # the hub's own files, or ours from an earlier start
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.exists():
        log.warning("the hub cache %s holds another snapshot of %s without its tokenizer: left as it is", cache, hub_id)
        return False
    files = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not {f.name for f in files} >= set(PROBES):
        return False
    rev = _revision(files)
    snapshot = repo / "snapshots" / rev
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    if not snapshot.is_dir():  # filled aside and renamed: a reader never sees half of it
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=snapshot.parent))
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, snapshot)
        except OSError:  # another process placed the same snapshot first
            shutil.rmtree(tmp, ignore_errors=True)
    ref.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_ref = tempfile.mkstemp(prefix=".main-", dir=ref.parent)
    with os.fdopen(fd, "w") as out:
        out.write(rev)
    os.replace(tmp_ref, ref)
    log.info("placed the tokenizer of %s in the hub cache %s (snapshot %s)", hub_id, cache, rev)
    return True


def tokenizer_id(model: str) -> str:
    """What ``get_info`` answers as the tokenizer of ``model`` (a preset, hub id or directory, as the
    runtime serves it): its hub id once the hub cache here holds that id's tokenizer, else the
    model's directory on this machine."""
    model_dir = resolve_model(model)
    hub = hub_id(model)
    if not hub:
        return str(model_dir)
    try:
        placed = place_tokenizer(hub, model_dir)
    except OSError as exc:  # a read-only or full cache: clients here can still read the directory
        log.warning("could not place the tokenizer of %s in the hub cache: %s", hub, exc)
        placed = False
    return hub if placed else str(model_dir)


__all__ = ["hub_cache_dir", "place_tokenizer", "tokenizer_id"]
