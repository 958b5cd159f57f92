"""Exported weights on their way out: signed download URLs (the Tinker SDK's
``get_external_weights_urls``) and age encryption to the recipients a save named.

An authenticated call puts a checkpoint's files here and gets a token; each file is then served
at ``/api/v1/downloads/TOKEN/FILE`` without a key, as a signed URL is, until the token expires.
The token is 256 random bits (the URL is the capability); tokens live in this process only, so a
restart of the gateway invalidates them (the SDK and the cookbook sign new ones when a download
fails or nears expiry). Bounded: at most ``max_entries`` sets of files, oldest dropped first.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

from polytinker.errors import ConfigError


class SignedDownloads:
    def __init__(self, *, ttl_s: float = 3600.0, max_entries: int = 16) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._entries: OrderedDict[str, tuple[float, dict[str, bytes]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, files: dict[str, bytes]) -> tuple[str, float]:
        """A new token for ``files`` and when it expires (a Unix time)."""
        token = secrets.token_urlsafe(32)
        expires = time.time() + self.ttl_s
        with self._lock:
            self._drop_expired()
            self._entries[token] = (expires, dict(files))
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        return token, expires

    def get(self, token: str, name: str) -> bytes | None:
        """The file ``name`` of an unexpired token; None otherwise."""
        with self._lock:
            self._drop_expired()
            entry = self._entries.get(token)
        if entry is None:
            return None
        return entry[1].get(name)

    def _drop_expired(self) -> None:
        now = time.time()
        for token in [t for t, (expires, _) in self._entries.items() if expires <= now]:
            del self._entries[token]


MAX_AGE_RECIPIENTS = 10  # as Tinker allows


def age_recipients(value: Any) -> list[Any]:
    """The age recipients of a save_weights_external request (native ``age1...`` keys or SSH
    public keys), parsed; a ConfigError names one that is not."""
    import pyrage

    if not isinstance(value, list) or len(value) > MAX_AGE_RECIPIENTS:
        raise ConfigError(f"age_encryption_recipients: a list of at most {MAX_AGE_RECIPIENTS} keys")
    out = []
    for text in value:
        if not isinstance(text, str) or len(text) > 16_384:
            raise ConfigError("age_encryption_recipients: each an age1... key or an SSH public key")
        kind = pyrage.x25519 if text.startswith("age1") else pyrage.ssh
        try:
            out.append(kind.Recipient.from_str(text))
        except pyrage.RecipientError as exc:
            raise ConfigError(f"age recipient {text[:24]!r}...: {exc}") from None
    return out


def age_encrypt(files: dict[str, bytes], recipients: list[str]) -> dict[str, bytes]:
    """Each file encrypted to ``recipients`` as ``NAME.age``; the files as they are without any."""
    if not recipients:
        return files
    import pyrage

    parsed = age_recipients(recipients)
    return {f"{name}.age": pyrage.encrypt(data, parsed) for name, data in files.items()}


__all__ = ["MAX_AGE_RECIPIENTS", "SignedDownloads", "age_encrypt", "age_recipients"]
