"""The gateway's signed download URLs and age encryption of exported files (unit level; the
SDK's download through a real serve is tests/test_http_checkpoints.py)."""

from __future__ import annotations

import pyrage
import pytest

from polytinker.errors import ConfigError
from polytinker.scheduler.http.downloads import SignedDownloads, age_encrypt, age_recipients


def test_a_token_serves_its_files_until_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    import polytinker.scheduler.http.downloads as downloads

    now = [1000.0]
    monkeypatch.setattr(downloads.time, "time", lambda: now[0])
    table = SignedDownloads(ttl_s=60.0, max_entries=2)
    token, expires = table.put({"a.json": b"{}"})
    assert expires == 1060.0 and len(token) >= 40
    assert table.get(token, "a.json") == b"{}"
    assert table.get(token, "b.json") is None and table.get("x" + token, "a.json") is None
    now[0] = 1060.0
    assert table.get(token, "a.json") is None  # expired
    first, _ = table.put({"f": b"1"})
    table.put({"f": b"2"})
    table.put({"f": b"3"})  # over max_entries: the oldest goes
    assert table.get(first, "f") is None


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
