"""Trained adapters out of polytinker, as directories other tools load.

``ServiceClient.export_weights(model_path, out_dir)`` writes a saved version
(``polytinker://JOB/AGENT@VERSION``, or Tinker's ``tinker://JOB/sampler_weights/AGENT@VERSION``)
or a ``save_state`` checkpoint (``polytinker-ckpt://JOB/NAME``, Tinker's ``tinker://JOB/weights/NAME``:
its weights, without the optimizer state) as a peft adapter directory:

- ``adapter_config.json``: peft's config, whose ``base_model_name_or_path`` is the base model's hub
  id where polytinker knows one (a preset's, or the hub id the runtime was started with), else the
  runtime's model name; never a path of the serving machine;
- ``adapter_model.safetensors``: the weights;
- ``polytinker.json``: what the adapter was trained on exactly: the runtime's model, the hub id,
  how the preset differs from the hub checkpoint, the version.

With ``merged=True`` it writes instead a whole Hugging Face model directory (the base model with
the adapter merged into its weights, and the tokenizer), which stock ``transformers`` and vLLM load
without peft. The base model is loaded on this machine for that (``resolve_model``). A
full-parameter version is always written that way, with its own weights in place of the base's.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from polytinker.client._connection import Connection
from polytinker.engine.models import PRESET_HUB_IDS, _looks_like_hub_id, load_model
from polytinker.engine.types import UNEMBED_MODULE, LoraConfig
from polytinker.errors import ConfigError, NotBuiltError
from polytinker.model_path import TINKER_PREFIX, from_tinker
from polytinker.scheduler.service import messages as m
from polytinker.scheduler.service.replies import ExportWeightsReply

MANIFEST = "polytinker.json"


def _model_path(path: str) -> str:
    """A Tinker sampler or checkpoint path as the polytinker path it names; any other path as it
    is (the scheduler checks it)."""
    return from_tinker(path) if path.startswith(TINKER_PREFIX) else path


def base_identity(base_model: str) -> dict[str, str]:
    """``{"base_model", "hub_id", "note"}``: the runtime's model and the hub id it stands for."""
    if base_model in PRESET_HUB_IDS:
        hub_id, note = PRESET_HUB_IDS[base_model]
    elif _looks_like_hub_id(base_model):
        hub_id, note = base_model, "the hub checkpoint itself"
    else:
        hub_id, note = "", "a preset or local directory with no hub id: load the base as the runtime did"
    return {"base_model": base_model, "hub_id": hub_id, "note": note}


def _write_dir(out: Path, write: Any, overwrite: bool) -> Path:
    """``write(tmp)`` fills a fresh directory that then replaces ``out`` in one rename."""
    # torch and safetensors load only where weights are written, not with polytinker.client.
    from polytinker.engine.learner.state import write_atomic_dir

    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists: pick another directory or pass overwrite")
    return write_atomic_dir(out, write)


def _fetch(conn: Connection, path: str) -> ExportWeightsReply:
    return conn.ask(m.ExportWeights(conn.api_key, path))


def adapter_files(conn: Connection, model_path: str, *, merged: bool = False) -> tuple[dict[str, bytes], str]:
    """The peft adapter directory of the saved LoRA version ``model_path`` as ``{file name:
    bytes}`` (see the module docstring), and the base model it was trained on. ``merged`` is only
    recorded in the manifest."""
    path = _model_path(model_path)
    reply = _fetch(conn, path)
    if reply.full:
        raise NotBuiltError(f"{model_path} is a full-parameter version: it has no adapter files (export_weights)")
    return _adapter_files(reply, path, merged), reply.base_model


def _adapter_files(reply: ExportWeightsReply, path: str, merged: bool) -> dict[str, bytes]:
    identity = base_identity(reply.base_model)
    hub_name = identity["hub_id"] or identity["base_model"]
    if reply.adapter_config:
        config = json.loads(reply.adapter_config)
        config["base_model_name_or_path"] = hub_name
    else:  # a save_state checkpoint: peft's config from the LoRA shape its meta.json records
        config = _peft_config(json.loads(reply.checkpoint_meta)["lora"], hub_name)
    manifest = {**identity, "model_path": path, "version": reply.version, "merged": merged}
    return {
        "adapter_config.json": (json.dumps(config, indent=2) + "\n").encode(),
        "adapter_model.safetensors": bytes(reply.weights),
        MANIFEST: (json.dumps(manifest, indent=2) + "\n").encode(),
    }


def _peft_config(lora: dict[str, Any], base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` of an adapter of shape ``lora`` (a checkpoint's ``meta.json``
    ``lora``), written as the learner's exports write it."""
    # torch and safetensors load only where weights are written, not with polytinker.client.
    from polytinker.engine.inference.adapter_io import peft_config_dict

    shape = LoraConfig(**{**lora, "target_modules": tuple(lora["target_modules"])})
    return peft_config_dict(shape, base_model)


def export_weights(
    conn: Connection, model_path: str, out_dir: str | os.PathLike[str], *, merged: bool = False, overwrite: bool = False
) -> Path:
    """Write the saved version ``model_path`` of this tenant to ``out_dir`` (see the module
    docstring); a full-parameter version always as a whole model directory."""
    path = _model_path(model_path)
    reply = _fetch(conn, path)
    if reply.full:
        return _write_dir(Path(out_dir), lambda d: _write_full(d, reply, path), overwrite)
    files = _adapter_files(reply, path, merged)

    def write_adapter(d: Path) -> None:
        for name, data in files.items():
            (d / name).write_bytes(data)

    if not merged:
        return _write_dir(Path(out_dir), write_adapter, overwrite)

    def write_merged(d: Path) -> None:
        from peft import PeftModel

        with tempfile.TemporaryDirectory(prefix="polytinker-adapter-") as adapter:
            write_adapter(Path(adapter))
            model, tokenizer = load_model(reply.base_model)
            if UNEMBED_MODULE in json.loads(files["adapter_config.json"])["target_modules"]:
                _untie_unembedding(model)
            peft_model = PeftModel.from_pretrained(model, adapter)
            merged_model = peft_model.merge_and_unload()
        _save_model_dir(d, merged_model, tokenizer, reply.base_model, files[MANIFEST])

    return _write_dir(Path(out_dir), write_merged, overwrite)


def _untie_unembedding(model: Any) -> None:
    """Give the unembedding its own weights before an adapter on it is merged: tied to the input
    embeddings (as the default model's are), merging would change those too."""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embed.weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False


def _save_model_dir(d: Path, model: Any, tokenizer: Any, base_model: str, manifest: bytes) -> None:
    """A whole Hugging Face model directory: the model (named by the base's hub id, else the
    runtime's model name, never a path of this machine), its tokenizer and the manifest."""
    identity = base_identity(base_model)
    model.config.name_or_path = identity["hub_id"] or identity["base_model"]
    model.save_pretrained(str(d), safe_serialization=True)
    tokenizer.save_pretrained(str(d))
    (d / MANIFEST).write_bytes(manifest)


def _write_full(d: Path, reply: ExportWeightsReply, path: str) -> None:
    """A full-parameter version as a whole Hugging Face model directory: the base model's config
    and tokenizer with the version's weights (read back as the engines read them)."""
    # torch and safetensors load only where weights are written, not with polytinker.client.
    from polytinker.engine.learner.state import META_FILE, WEIGHTS_FILE, load_full_weights

    model, tokenizer = load_model(reply.base_model)
    with tempfile.TemporaryDirectory(prefix="polytinker-full-") as ckpt:
        (Path(ckpt) / WEIGHTS_FILE).write_bytes(bytes(reply.weights))
        (Path(ckpt) / META_FILE).write_text(reply.checkpoint_meta)
        load_full_weights(ckpt, model)
    identity = base_identity(reply.base_model)
    manifest = {**identity, "model_path": path, "version": reply.version, "merged": True, "full": True}
    _save_model_dir(d, model, tokenizer, reply.base_model, (json.dumps(manifest, indent=2) + "\n").encode())


__all__ = ["MANIFEST", "adapter_files", "base_identity", "export_weights"]
