"""The gateway's signed download URLs, bounded per tenant and in total, and age encryption of
exported files (unit level; the SDK's download through a real serve is tests/test_http_tinker.py,
and one tenant's URLs surviving another's is tests/test_http_hostile.py)."""

from __future__ import annotations

import pyrage
import pytest

from polytinker.errors import ConfigError, OverloadedError
from polytinker.gateway.downloads import SignedDownloads, age_encrypt, age_recipients
from polytinker.gateway.errors import HttpError
from polytinker.scheduler.service.http_config import HttpConfig


def _table(ttl_s: float = 3600.0, **bounds: int) -> SignedDownloads:
    """A table with the gateway's default bounds (HttpConfig) but for ``bounds``."""
    c = HttpConfig()
    defaults = {
        "max_per_tenant": c.max_download_urls_per_tenant,
        "max_tenant_bytes": c.max_download_bytes_per_tenant,
        "max_entries": c.max_download_urls,
        "max_bytes": c.max_download_bytes,
    }
    return SignedDownloads(ttl_s=ttl_s, **{**defaults, **bounds})


def test_a_token_serves_its_files_until_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    import polytinker.gateway.downloads as downloads

    now = [1000.0]
    monkeypatch.setattr(downloads.time, "time", lambda: now[0])
    table = _table(ttl_s=60.0, max_per_tenant=2)
    token, expires = table.put("alice", {"a.json": b"{}"})
    assert expires == 1060.0 and len(token) >= 40
    assert table.get(token, "a.json") == b"{}"
    assert table.get(token, "b.json") is None and table.get("x" + token, "a.json") is None
    now[0] = 1060.0
    assert table.get(token, "a.json") is None  # expired
    first, _ = table.put("alice", {"f": b"1"})
    table.put("alice", {"f": b"2"})
    table.put("alice", {"f": b"3"})  # over max_per_tenant: the tenant's oldest goes
    assert table.get(first, "f") is None


def test_a_tenant_signing_many_evicts_only_its_own_oldest() -> None:
    table = _table(max_per_tenant=16)
    bobs, _ = table.put("bob", {"adapter": b"bob's"})
    alices = [table.put("alice", {"adapter": b"alice's %d" % i})[0] for i in range(17)]
    assert table.get(bobs, "adapter") == b"bob's"  # untouched by alice's 17
    assert table.get(alices[0], "adapter") is None  # alice's own oldest made room
    assert all(table.get(t, "adapter") for t in alices[1:])


def test_the_total_bound_refuses_a_tenant_rather_than_evict_another() -> None:
    table = SignedDownloads(max_per_tenant=4, max_tenant_bytes=130, max_entries=3, max_bytes=150)
    bob1, _ = table.put("bob", {"f": b"x" * 60})
    bob2, _ = table.put("bob", {"f": b"x" * 60})
    with pytest.raises(OverloadedError) as refused:  # 120 of bob's + 40 > 150: bob's stay
        table.put("alice", {"f": b"y" * 40})
    assert 0 < refused.value.retry_after_s <= 60
    assert table.get(bob1, "f") and table.get(bob2, "f")
    carol, _ = table.put("carol", {"f": b"z" * 20})  # fits beside bob's
    with pytest.raises(OverloadedError):  # three sets held: a fourth of another tenant waits
        table.put("alice", {"f": b"y"})
    again, _ = table.put("carol", {"f": b"w" * 25})  # carol's own set makes room for her next
    assert table.get(carol, "f") is None and table.get(again, "f") == b"w" * 25
    assert table.get(bob1, "f") and table.get(bob2, "f")
    with pytest.raises(HttpError) as too_big:  # more than any one tenant may hold: never fits
        table.put("alice", {"f": b"y" * 131})
    assert too_big.value.status == 413


def test_files_are_encrypted_to_every_recipient_and_bad_keys_are_refused() -> None:
    alice, bob = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    keys = [str(alice.to_public()), str(bob.to_public())]
    sealed = age_encrypt({"adapter_config.json": b'{"r": 4}'}, keys)
    assert list(sealed) == ["adapter_config.json.age"]
    for who in (alice, bob):
        assert pyrage.decrypt(sealed["adapter_config.json.age"], [who]) == b'{"r": 4}'
    assert age_encrypt({"f": b"plain"}, []) == {"f": b"plain"}
    for bad in (["age1nope"], "age1" + "q" * 58, [7], ["ssh-rsa AAAA"], [keys[0]] * 11):
        with pytest.raises(ConfigError):
            age_recipients(bad)
