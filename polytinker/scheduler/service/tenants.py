"""Tenants and their API keys.

A tenant is identified by an API key sent with every request, or, on a scheduler that serves
with Curve, by the Curve key its client was admitted with (a request with no API key). Only the key's SHA-256 is stored
(a stolen database gives no keys). Comparison is on the hash, looked up by index; a wrong key
and an unknown tenant get the same answer, so a caller learns nothing about which tenants exist.
On a Curve-secured scheduler the key travels inside the encrypted connection.
"""

from __future__ import annotations

import hashlib
import secrets
import threading

from polytinker.errors import AuthError
from polytinker.scheduler.service.config import TenantConfig
from polytinker.scheduler.service.state import StateStore


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    """A fresh random API key (URL-safe, 256 bits)."""
    return "tml-" + secrets.token_urlsafe(32)  # the tinker SDK accepts only keys that start with "tml-"


class Tenants:
    """Resolves API keys to tenant names; a small cache saves a query per request."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()

    def add(self, config: TenantConfig) -> None:
        self._store.upsert_tenant(config.name, hash_key(config.credential()), config.weight)
        with self._lock:
            self._cache.clear()

    def authenticate(self, api_key: object, curve_key: str = "") -> str:
        """The tenant owning ``api_key``, else the one owning the requester's Curve key; AuthError
        if there is none."""
        if not isinstance(api_key, str):
            raise AuthError("the API key must be a string")
        if not api_key and not curve_key:
            raise AuthError("no API key: pass api_key= to ServiceClient or set POLYTINKER_API_KEY")
        h = hash_key(api_key if api_key else f"curve:{curve_key}")
        with self._lock:
            name = self._cache.get(h)
        if name is None:
            name = self._store.tenant_by_key_hash(h)
            if name is None:
                raise AuthError("unknown API key")
            with self._lock:
                self._cache[h] = name
        return name

    def weights(self) -> tuple[tuple[str, float], ...]:
        return tuple(self._store.tenants())


__all__ = ["Tenants", "hash_key", "new_api_key"]
