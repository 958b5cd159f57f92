"""A training run's saved weights through the Tinker API: ``save_weights`` (``save_state``),
``save_weights_for_sampler``, ``save_weights_external``, ``load_weights`` (into the run, or into a
new run shaped like the one that saved them) and ``weights_info``.

Each call turns into the run's polytinker training client call (``TrainingClient.save_state``,
``save_weights_for_sampler``, ``load_state``, ...) and answers the ``tinker://`` path of what it
saved (tinker_backend.py's table). The gateway's store notes when each save was made through it,
a named sampler save's version and an external save's age recipients, which the run's checkpoint
listing and its download URLs read back (tinker_runs.py).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from typing import Any

from polytinker.engine.types import ATTN_MODULES, DEFAULT_TARGET_MODULES, MLP_MODULES, UNEMBED_MODULE
from polytinker.engine.worker.layout import check_name
from polytinker.errors import ConfigError, NotBuiltError
from polytinker.gateway.downloads import age_recipients
from polytinker.gateway.store import SamplerRow, SavedRow
from polytinker.gateway.tinker_backend import Tenant, TinkerBackend
from polytinker.gateway.tinker_names import (
    EXTERNAL_NAME_PREFIX,
    external_path,
    from_tinker_path,
    named_sampler_path,
    run_request_key,
    to_tinker_path,
)
from polytinker.gateway.wire import ttl_of


class TinkerWeights:
    """The weights calls over one gateway's backend. Each save or load returns at once with a
    ``concurrent.futures.Future`` that the route files under a request id."""

    def __init__(self, backend: TinkerBackend) -> None:
        self.backend = backend

    def save_state(self, t: Tenant, req: dict[str, Any]) -> Future[str]:
        """Save the run's weights and optimizer state as ``path`` (a name); the future answers the
        polytinker path. The gateway notes when, for the run's checkpoint listing."""
        tc = self.backend.training_client(t, str(req.get("model_id", "")))
        name = str(req.get("path") or f"state-{uuid.uuid4().hex[:8]}")
        saved = tc.save_state(name, ttl_seconds=ttl_of(req))

        def note(f: Future[str]) -> None:
            if f.exception() is None:
                path = f.result()
                self.backend.store.add_saved(SavedRow(tc.job_id, "training", name, to_tinker_path(path), time.time()))

        saved.add_done_callback(note)
        return saved

    def save_for_sampler(self, t: Tenant, req: dict[str, Any]) -> Future[dict[str, Any]]:
        """Make the current version sampleable. Named (``path``): answer ``tinker://JOB/sampler_weights/NAME``,
        which samples that version; unnamed (``save_weights_and_get_sampling_client``): also open a
        sampling session on it, whose session holds the version (it is not pruned while the session lives)."""
        row = self.backend.model(t, str(req.get("model_id", "")))
        tc = self.backend.training_client(t, row.model_id)
        name = str(req.get("path") or "")
        if name.startswith(EXTERNAL_NAME_PREFIX):
            raise ConfigError(f"sampler names starting with {EXTERNAL_NAME_PREFIX!r} are save_weights_external's")
        saved = tc.save_weights_for_sampler(name, ttl_seconds=ttl_of(req))
        store = self.backend.store
        fut: Future[dict[str, Any]] = Future()

        def done(f: Future[str]) -> None:
            try:
                path = to_tinker_path(f.result())
                out: dict[str, Any] = {"type": "save_weights_for_sampler", "path": path}
                if name:
                    out["path"] = path = named_sampler_path(row.job_id, name)
                    store.add_sampler_name(row.job_id, name, f.result())
                    store.add_saved(SavedRow(row.job_id, "sampler", name, path, time.time()))
                else:
                    session_id, _, _ = row.model_id.partition(":")
                    if store.session_owner(session_id) == t.owner:  # a run made in a session
                        t.service.hold_weights(session_id, f.result())
                    sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
                    store.add_sampler(SamplerRow(sampler_id, t.owner, row.base_model, f.result()))
                    store.add_sampler_session(sampler_id, session_id)
                    out["sampling_session_id"] = sampler_id
                fut.set_result(out)
            except BaseException as exc:
                fut.set_exception(exc)

        saved.add_done_callback(done)
        return fut

    def save_external(self, t: Tenant, req: dict[str, Any]) -> Future[dict[str, Any]]:
        """``save_weights_external(NAME)``: keep the current version as a named sampler save
        (``external.NAME``) and answer ``tinker://JOB/external_weights/NAME``, whose files
        ``get_external_weights_urls`` serves: the peft adapter directory ``export_weights`` writes."""
        recipients: list[str] = req.get("age_encryption_recipients") or []
        age_recipients(recipients)  # refused here, before anything is saved, when one is not a key
        row = self.backend.model(t, str(req.get("model_id", "")))
        if row.lora_rank == 0:
            raise NotBuiltError("save_weights_external of a full-parameter run is not built (LoRA runs only)")
        name = check_name("external weights name", req.get("path"))
        tc = self.backend.training_client(t, row.model_id)
        saved = tc.save_weights_for_sampler(EXTERNAL_NAME_PREFIX + name, ttl_seconds=ttl_of(req))
        store = self.backend.store
        fut: Future[dict[str, Any]] = Future()

        def done(f: Future[str]) -> None:
            try:
                sampler_path = to_tinker_path(f.result())
                store.set_recipients(row.job_id, name, recipients)
                store.add_saved(SavedRow(row.job_id, "external", name, sampler_path, time.time()))
                path = external_path(row.job_id, name)
                fut.set_result({"type": "save_weights_external", "path": path, "size_bytes": None})
            except BaseException as exc:
                fut.set_exception(exc)

        saved.add_done_callback(done)
        return fut

    def load_state(self, t: Tenant, req: dict[str, Any]) -> Future[dict[str, Any]]:
        """Load a checkpoint's weights (``optimizer``: and its optimizer state, as
        ``load_state_with_optimizer`` asks) into the request's model, or, without a ``model_id``
        (``create_training_client_from_state``), into a new run shaped like the one that saved it."""
        path = from_tinker_path(str(req.get("path", "")), "weights")
        optimizer = bool(req.get("optimizer"))
        if req.get("model_id"):
            model_id = str(req["model_id"])
            tc = self.backend.training_client(t, model_id)

            def run() -> None:
                (tc.load_state_with_optimizer(path) if optimizer else tc.load_state(path)).result()
        else:
            session_id = str(req.get("session_id", ""))
            self.backend.check_session(t, session_id)
            model_id = f"{session_id}:train:{int(req.get('model_seq_id', 0))}"
            key = run_request_key(session_id, req.get("model_seq_id"))  # a resend: the same job
            source = self.backend.source(t, path)

            def run() -> None:
                made = t.service.create_training_client_from_state(path, optimizer=optimizer, request_key=key)
                rank = int((source.lora or {}).get("rank", 0))
                self.backend.add_run(t, model_id, made, source.base_model, rank, req.get("user_metadata"))

        def loaded() -> dict[str, Any]:
            run()
            return {"type": "load_weights", "path": req.get("path"), "model_id": model_id}

        return self.backend.pool.submit(loaded)

    def weights_info(self, t: Tenant, tinker_path: str) -> dict[str, Any]:
        """``weights_info``: the saved weights' base model and LoRA shape, as the scheduler knows
        them (the tenant's own, or published ones)."""
        source = self.backend.source(t, self.backend.polytinker_path(tinker_path))
        lora = source.lora or {}
        modules = set(lora.get("target_modules") or DEFAULT_TARGET_MODULES)  # none named: the learner's default
        return {
            "base_model": source.base_model,
            "is_lora": source.lora is not None,
            "lora_rank": lora.get("rank"),
            "train_unembed": UNEMBED_MODULE in modules,
            "train_mlp": bool(modules & set(MLP_MODULES)),
            "train_attn": bool(modules & set(ATTN_MODULES)),
        }


__all__ = ["TinkerWeights"]
