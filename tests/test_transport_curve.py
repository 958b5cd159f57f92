"""CurveZMQ: the allow-listed key connects; a wrong key (AuthError at once), a wrong server key or
no Curve (no answer) is refused.
And the loopback rule for servers without Curve; and `polytinker keys generate`."""

from __future__ import annotations

import stat
import time

import pytest
import zmq

from polytinker import cli
from polytinker.errors import AuthError, ConfigError, PeerDeadError, RequestTimeout, TransportError
from polytinker.transport import ClientCurve, RpcClient, RpcServer, ServerCurve, TransportConfig, load_keypair
from polytinker.transport._echo import HANDLERS
from polytinker.transport.auth import check_bind_address

FAST = TransportConfig(heartbeat_interval_s=0.2, heartbeat_liveness=5, request_timeout_s=1.0)
REFUSED = (RequestTimeout, PeerDeadError)


@pytest.fixture(scope="module")
def keys():
    server, good, bad = (zmq.curve_keypair() for _ in range(3))  # (public, secret) each
    return {"server": server, "good": good, "bad": bad}


@pytest.fixture
def curve_server(keys):
    curve = ServerCurve(keys["server"][0], keys["server"][1], frozenset({keys["good"][0]}))
    with RpcServer("tcp://127.0.0.1:0", HANDLERS, config=FAST, curve=curve) as srv:
        yield srv


def test_allowed_key_connects(curve_server, keys):
    curve = ClientCurve(keys["good"][0], keys["good"][1], keys["server"][0])
    with RpcClient(curve_server.address, config=FAST, curve=curve) as c:
        assert c.call("echo", "secret") == "secret"


def test_key_not_on_the_allow_list_is_refused_with_auth_error_within_the_timeout(curve_server, keys):
    curve = ClientCurve(keys["bad"][0], keys["bad"][1], keys["server"][0])
    with RpcClient(curve_server.address, config=FAST, curve=curve) as c:
        for _ in range(3):  # the first call, and those after it: the client knows it is refused
            t0 = time.monotonic()
            with pytest.raises(AuthError, match="allow-list"):
                c.call("echo", "secret", timeout_s=5.0)
            assert time.monotonic() - t0 < 4.0  # the handshake's answer, not the call's timeout


def test_a_key_admitted_later_is_served(keys):
    """A refused client is not refused for ever: once the server admits its key, it is served."""
    curve = ServerCurve(keys["server"][0], keys["server"][1], frozenset({keys["good"][0]}))
    client_curve = ClientCurve(keys["bad"][0], keys["bad"][1], keys["server"][0])
    with RpcServer("tcp://127.0.0.1:0", HANDLERS, config=FAST, curve=curve) as srv:
        address = srv.address
        with RpcClient(address, config=FAST, curve=client_curve) as c:
            with pytest.raises(AuthError):
                c.call("echo", 1, timeout_s=5.0)
            srv.stop()
            wider = ServerCurve(keys["server"][0], keys["server"][1], frozenset({keys["good"][0], keys["bad"][0]}))
            with _bind_again(address, wider):
                end = time.monotonic() + 10
                while True:
                    try:
                        assert c.call("echo", 2, timeout_s=2.0) == 2
                        break
                    except (AuthError, *REFUSED):
                        assert time.monotonic() < end
                        time.sleep(0.2)


def _bind_again(address: str, curve: ServerCurve) -> RpcServer:
    """A server on the address another one just left (libzmq releases the port asynchronously)."""
    end = time.monotonic() + 10
    while True:
        try:
            return RpcServer(address, HANDLERS, config=FAST, curve=curve).start()
        except TransportError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_client_without_curve_is_refused(curve_server):
    with RpcClient(curve_server.address, config=FAST) as c, pytest.raises(REFUSED):
        c.call("echo", "secret")


def test_client_expecting_another_server_key_is_refused(curve_server, keys):
    curve = ClientCurve(keys["good"][0], keys["good"][1], keys["bad"][0])
    with RpcClient(curve_server.address, config=FAST, curve=curve) as c, pytest.raises(REFUSED):
        c.call("echo", "secret")


def test_two_servers_keep_separate_allow_lists(curve_server, keys):
    other = ServerCurve(keys["server"][0], keys["server"][1], frozenset({keys["bad"][0]}))
    with RpcServer("tcp://127.0.0.1:0", HANDLERS, config=FAST, curve=other) as srv2:
        bad = ClientCurve(keys["bad"][0], keys["bad"][1], keys["server"][0])
        good = ClientCurve(keys["good"][0], keys["good"][1], keys["server"][0])
        with RpcClient(srv2.address, config=FAST, curve=bad) as c:
            assert c.call("echo", 2) == 2
        with RpcClient(curve_server.address, config=FAST, curve=good) as c:
            assert c.call("echo", 1) == 1


def test_curve_server_may_bind_every_interface(keys):
    curve = ServerCurve(keys["server"][0], keys["server"][1], frozenset({keys["good"][0]}))
    with RpcServer("tcp://0.0.0.0:0", HANDLERS, config=FAST, curve=curve) as srv:
        port = srv.address.rsplit(":", 1)[1]
        good = ClientCurve(keys["good"][0], keys["good"][1], keys["server"][0])
        with RpcClient(f"tcp://127.0.0.1:{port}", config=FAST, curve=good) as c:
            assert c.call("echo", 3) == 3


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:0", "tcp://localhost:5555", "tcp://[::1]:0", "ipc:///tmp/x", "inproc://x"]
)
def test_loopback_binds_need_no_curve(address):
    check_bind_address(address, None, insecure=False)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:0", "tcp://*:5555", "tcp://10.1.2.3:1", "tcp://eth0:1"])
def test_other_binds_need_curve_or_the_insecure_flag(address):
    with pytest.raises(ConfigError, match="insecure=True"):
        RpcServer(address, HANDLERS)
    check_bind_address(address, None, insecure=True)


def test_bad_keys_are_config_errors(keys):
    with pytest.raises(ConfigError):
        ServerCurve(b"short", keys["server"][1], frozenset({keys["good"][0]}))
    with pytest.raises(ConfigError, match="allowed_clients is empty"):
        ServerCurve(keys["server"][0], keys["server"][1], frozenset())


def test_keys_generate_cli_and_files_round_trip(tmp_path):
    assert cli.main(["keys", "generate", "--dir", str(tmp_path), "--name", "server"]) == 0
    assert cli.main(["keys", "generate", "--dir", str(tmp_path), "--name", "alice"]) == 0
    assert cli.main(["keys", "generate", "--dir", str(tmp_path), "--name", "alice"]) == 1  # never overwrites
    secret = tmp_path / "server.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    public, sec = load_keypair(secret)
    assert len(public) == 40 and sec is not None and len(sec) == 40

    server_curve = ServerCurve.from_files(secret, [tmp_path / "alice.key"])
    client_curve = ClientCurve.from_files(tmp_path / "alice.key_secret", tmp_path / "server.key")
    with (
        RpcServer("tcp://127.0.0.1:0", HANDLERS, config=FAST, curve=server_curve) as srv,
        RpcClient(srv.address, config=FAST, curve=client_curve) as c,
    ):
        assert c.call("echo", "from files") == "from files"
