"""Exported weights on their way out: signed download URLs (the Tinker SDK's
``get_external_weights_urls``) and age encryption to the recipients a save named.

An authenticated call puts a checkpoint's files here and gets a token; each file is then served
at ``/api/v1/downloads/TOKEN/FILE`` without a key, as a signed URL is, until the token expires.
The token is 256 random bits (the URL is the capability); tokens live in this process only, so a
restart of the gateway invalidates them (the SDK and the cookbook sign new ones when a download
fails or nears expiry).

Bounded per tenant and in total (``[http] max_download_*``, HttpConfig), and one tenant never
evicts another's URLs: a tenant holds at most ``max_per_tenant`` sets of files and
``max_tenant_bytes`` bytes (its own oldest go first when it signs more); all tenants together at
most ``max_entries`` sets and ``max_bytes`` bytes, and a tenant whose new set does not fit even
after dropping its own is refused (``OverloadedError``, a 429) until others' expire.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from polytinker.errors import ConfigError, OverloadedError
from polytinker.gateway.errors import HttpError


@dataclass(frozen=True)
class _Signed:
    owner: str
    expires: float
    files: dict[str, bytes]
    size: int


class SignedDownloads:
    def __init__(
        self,
        *,
        max_per_tenant: int,
        max_tenant_bytes: int,
        max_entries: int,
        max_bytes: int,
        ttl_s: float = 3600.0,
    ) -> None:
        if min(ttl_s, max_per_tenant, max_tenant_bytes, max_entries, max_bytes) <= 0:
            raise ConfigError("SignedDownloads: every bound must be > 0")
        self.ttl_s = ttl_s
        self.max_per_tenant, self.max_tenant_bytes = max_per_tenant, min(max_tenant_bytes, max_bytes)
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, _Signed] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, owner: str, files: dict[str, bytes]) -> tuple[str, float]:
        """A new token of tenant ``owner`` for ``files`` and when it expires (a Unix time). Drops
        the tenant's own oldest sets as its bounds need; HttpError 413 for a set larger than a
        tenant may hold, OverloadedError while other tenants' sets fill the total."""
        size = sum(len(data) for data in files.values())
        if size > self.max_tenant_bytes:
            raise HttpError(
                413,
                f"these files ({size} bytes) are more than one tenant may sign for download here "
                f"({self.max_tenant_bytes} bytes); polytinker checkpoints export writes them to a directory",
            )
        token = secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            self._drop_expired(now)
            own = [t for t, e in self._entries.items() if e.owner == owner]
            others = [e for e in self._entries.values() if e.owner != owner]
            other_bytes = sum(e.size for e in others)
            if len(others) + 1 > self.max_entries or other_bytes + size > self.max_bytes:
                wait_s = min(60.0, min(e.expires for e in others) - now) if others else 1.0
                bounds = f"{self.max_entries} sets of files, {self.max_bytes} bytes over all tenants"
                raise OverloadedError(
                    f"the gateway holds as many download URLs as it may ({bounds}): try again later", wait_s
                )
            held = [self._entries[t] for t in own]
            own_bytes = sum(e.size for e in held)
            while own and (
                len(own) + 1 > self.max_per_tenant
                or own_bytes + size > self.max_tenant_bytes
                or len(self._entries) + 1 > self.max_entries
                or self._bytes + size > self.max_bytes
            ):
                dropped = self._entries.pop(own.pop(0))
                own_bytes -= dropped.size
                self._bytes -= dropped.size
            self._entries[token] = _Signed(owner, now + self.ttl_s, dict(files), size)
            self._bytes += size
        return token, now + self.ttl_s

    def get(self, token: str, name: str) -> bytes | None:
        """The file ``name`` of an unexpired token; None otherwise."""
        with self._lock:
            self._drop_expired(time.time())
            entry = self._entries.get(token)
        return None if entry is None else entry.files.get(name)

    def _drop_expired(self, now: float) -> None:
        for token in [t for t, e in self._entries.items() if e.expires <= now]:
            self._bytes -= self._entries.pop(token).size


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
