"""The gateway against hostile clients: malformed bodies (400, never 500), wrong API keys
(throttled per address), slow or idle connections and oversized headers (closed), and who may
read `/metrics`. The connection tests use raw sockets on 127.0.0.1, each bounded in time."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.app import GuardedH11Protocol, HttpServer, build_app
from gateway.limits import FailedAuthThrottle
from tests.unit.test_gateway import MODEL, error, settings
from tests.unit.test_gateway_fakes import FakeReplica, ThreadedGateway

KEY = "k-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT_S = 15.0  # the most any connection test waits for the server to act: a loaded CPU is slow


@pytest.fixture(scope="module")
def plain() -> Iterator[ThreadedGateway]:
    g = ThreadedGateway(settings(), [FakeReplica()])
    yield g
    g.close()


@pytest.fixture(scope="module")
def guarded() -> Iterator[ThreadedGateway]:
    """Short connection deadlines, a small header limit and a key (so 401s come before the
    body is read)."""
    g = ThreadedGateway(
        settings(
            api_keys=[{"key": KEY}],
            idle_timeout_s=0.5,
            header_timeout_s=1.0,
            body_timeout_s=1.0,
            max_header_bytes=8192,
        ),
        [FakeReplica()],
    )
    yield g
    g.close()


# --------------------------------------------------------------------------- malformed bodies


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = b'"model": "fake-model", "prompt": "x"'
MESSAGES = b'"model": "fake-model", "messages": [{"role": "user", "content": "x"}]'

MALFORMED = [
    # (route, body, param)
    (COMPLETIONS, b"{" + PROMPT + b', "x": ' + _nested(1000) + b"}", None),
    (COMPLETIONS, b"{" + PROMPT + b', "x": ' + _nested(100) + b"}", "x"),
    (CHAT, b'{"model": "fake-model", "messages": ' + _nested(5000) + b"}", None),
    (COMPLETIONS, b"{" + PROMPT + b', "max_tokens": 1e30}', "max_tokens"),
    (COMPLETIONS, b"{" + PROMPT + b', "max_tokens": 1e18}', "max_tokens"),
    (COMPLETIONS, b"{" + PROMPT + b', "max_tokens": 4294967296}', "max_tokens"),
    (CHAT, b"{" + MESSAGES + b', "max_completion_tokens": 1e30}', "max_completion_tokens"),
    (COMPLETIONS, b"{" + PROMPT + b', "n": 99999999999999999999}', "n"),
    (COMPLETIONS, b"{" + PROMPT + b', "top_k": 99999999999}', "top_k"),
    (COMPLETIONS, b"{" + PROMPT + b', "seed": 1e300}', "seed"),
    (COMPLETIONS, b"{" + PROMPT + b', "stop_token_ids": [99999999999]}', "stop_token_ids[0]"),
    (COMPLETIONS, b'{"model": "fake-model", "prompt": [99999999999]}', "prompt"),
    (COMPLETIONS, b'{"model": "fake-model", "prompt": [[1, -99999999999]]}', "prompt"),
    (COMPLETIONS, b"{" + PROMPT + b', "repetition_penalty": 1e300}', "repetition_penalty"),
    (COMPLETIONS, b"{" + PROMPT + b', "repetition_penalty": 1e400}', "repetition_penalty"),
    (COMPLETIONS, b"{" + PROMPT + b', "temperature": NaN}', "temperature"),
    (COMPLETIONS, b"{" + PROMPT + b', "top_p": -Infinity}', "top_p"),
    (COMPLETIONS, b"{" + PROMPT + b', "whatever": Infinity}', "whatever"),
    (COMPLETIONS, b"{" + PROMPT + b', "x": ' + b"9" * 5000 + b"}", None),
    (
        CHAT,
        b"{" + MESSAGES + b', "chat_template_kwargs": {"a": 1' + b"0" * 400 + b"}}",
        "chat_template_kwargs.a",
    ),
    (COMPLETIONS, b'{"model": "fake-model", "prompt": "\\ud800"}', "prompt"),
    (COMPLETIONS, b'{"model": "fake-model", "prompt": ["ok", "a\\udfffb"]}', "prompt[1]"),
    (COMPLETIONS, b'{"model": "\\ud800", "prompt": "x"}', "model"),
    (COMPLETIONS, b"{" + PROMPT + b', "stop": "\\udc00"}', "stop"),
    (COMPLETIONS, b"{" + PROMPT + b', "\\ud800": 1}', None),
    (
        CHAT,
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        "messages[0].content",
    ),
    (
        CHAT,
        b"{" + MESSAGES + b', "chat_template_kwargs": {"k": ["\\ud800"]}}',
        "chat_template_kwargs.k[0]",
    ),
    # a surrogate in UTF-8 bytes (CESU-8): json decodes bytes with "surrogatepass"
    (COMPLETIONS, b'{"model": "fake-model", "prompt": "\xed\xa0\x80"}', "prompt"),
]


@pytest.mark.parametrize(("route", "body", "param"), MALFORMED)
def test_malformed_body_is_a_400_naming_the_field(
    plain: ThreadedGateway, route: str, body: bytes, param: str | None
) -> None:
    r = httpx.post(plain.url + route, content=body, headers={"content-type": "application/json"})
    e = error(r, 400)
    assert e["type"] == "invalid_request_error"
    assert e["param"] == param, e


def test_valid_unicode_and_numbers_still_pass(plain: ThreadedGateway) -> None:
    """Surrogate pairs are fine (json.dumps escapes emoji as them), and so are the largest
    values the fields take."""
    body = {"model": MODEL, "prompt": "caf\u00e9 \U0001f600", "max_tokens": 2, "top_k": 2**31 - 1}
    r = httpx.post(
        plain.url + COMPLETIONS,
        content=json.dumps(body, ensure_ascii=True),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "\U0001f600"}], "seed": -1}
    assert httpx.post(plain.url + CHAT, json=chat).status_code == 200


# --------------------------------------------------------------------------- failed auth


def test_wrong_keys_are_throttled_per_address() -> None:
    g = ThreadedGateway(
        settings(api_keys=[{"key": KEY}], auth_max_failures=3, auth_failure_window_s=30.0),
        [FakeReplica()],
    )
    try:
        throttle = g.gateway.auth.throttle
        assert throttle is not None
        now = [1000.0]
        throttle.clock = lambda: now[0]  # the window passes when the test says so
        url = g.url + COMPLETIONS
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        bad = {"Authorization": "Bearer guess"}
        assert httpx.post(url, json=body, headers=AUTH).status_code == 200
        for _ in range(2):
            assert error(httpx.post(url, json=body, headers=bad), 401)["code"] == "invalid_api_key"
        # successes do not count, and do not reset the count either
        assert httpx.post(url, json=body, headers=AUTH).status_code == 200
        assert error(httpx.post(url, json=body, headers=bad), 401)["code"] == "invalid_api_key"
        for headers in (bad, {}, AUTH):  # locked: the key is not even looked at
            r = httpx.post(url, json=body, headers=headers)
            e = error(r, 429)
            assert e["code"] == "too_many_failed_auth_attempts"
            assert int(r.headers["retry-after"]) == 30
        assert error(httpx.get(g.url + "/v1/models", headers=bad), 429)
        assert httpx.get(g.url + "/health").status_code == 200  # needs no key
        now[0] += 29.5
        r = httpx.post(url, json=body, headers=bad)
        assert error(r, 429) and r.headers["retry-after"] == "1"
        now[0] += 1.0
        assert httpx.post(url, json=body, headers=AUTH).status_code == 200
        assert error(httpx.post(url, json=body, headers=bad), 401)  # a fresh window
    finally:
        g.close()


def test_failed_auth_throttle_window_and_addresses() -> None:
    now = [0.0]
    t = FailedAuthThrottle(max_failures=3, window_s=10.0, clock=lambda: now[0], max_addresses=2)
    t.fail("a")
    now[0] = 6.0
    t.fail("a")
    now[0] = 11.0  # the first failure left the window
    t.fail("a")
    assert t.locked_for("a") == 0
    t.fail("a")
    assert t.locked_for("a") == pytest.approx(10.0)
    assert t.locked_for("b") == 0
    now[0] = 21.0
    assert t.locked_for("a") == 0
    for address in ("c", "d", "e"):  # only the most recent addresses are kept
        t.fail(address)
    assert list(t._failures) == ["d", "e"]


# --------------------------------------------------------------------------- /metrics


@pytest.mark.parametrize(
    ("access", "keys", "without", "with_key"),
    [
        (None, True, 401, 200),  # the default: the key, when keys are configured
        ("key", False, 200, 200),  # no keys: open, like every route
        ("open", True, 200, 200),
        ("off", True, 404, 404),
    ],
)
def test_metrics_access(access: str | None, keys: bool, without: int, with_key: int) -> None:
    kw: dict[str, object] = {"api_keys": [{"key": KEY}] if keys else []}
    if access is not None:
        kw["metrics_access"] = access
    g = ThreadedGateway(settings(**kw), [FakeReplica()])
    try:
        r = httpx.get(g.url + "/metrics")
        assert r.status_code == without, r.text
        if without != 200:
            error(r, without)
        r = httpx.get(g.url + "/metrics", headers=AUTH)
        assert r.status_code == with_key
        if with_key == 200:
            assert "rlfleet_gateway_requests_total" in r.text
    finally:
        g.close()


# --------------------------------------------------------------------------- connections


def _connect(g: ThreadedGateway) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", g.http.port), timeout=WAIT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, timeout_s: float = WAIT_S) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the server did not close the connection; read {out[:200]!r}"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            pytest.fail(f"the server did not close the connection; read {out[:200]!r}")
        if not chunk:
            return out, time.monotonic()
        out += chunk


def _closed(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (without blocking)."""
    readable, _, _ = select.select([s], [], [], 0)
    if not readable:
        return False
    try:
        return s.recv(65536, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_server_settings_reach_uvicorn(plain: ThreadedGateway) -> None:
    s = settings(idle_timeout_s=7.0, max_header_bytes=9000, max_connections=123)
    server = HttpServer(build_app(plain.gateway), s, port=0)
    try:
        config = server.server.config
        assert config.http is GuardedH11Protocol
        assert config.timeout_keep_alive == 7.0
        assert config.h11_max_incomplete_event_size == 9000
        assert config.limit_concurrency == 123
    finally:
        server.socket.close()


def test_idle_new_connection_is_closed(guarded: ThreadedGateway) -> None:
    with _connect(guarded) as s:
        start = time.monotonic()
        out, closed = _read_until_closed(s)
    assert out == b"" and closed - start >= 0.4


def test_idle_keep_alive_connection_is_closed(guarded: ThreadedGateway) -> None:
    with _connect(guarded) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        out, _ = _read_until_closed(s)
    assert _status(out) == 200


def test_slowloris_is_closed_after_the_header_timeout(guarded: ThreadedGateway) -> None:
    """Header bytes trickle in faster than the idle timeout, but the head never ends."""
    head = b"GET /health HTTP/1.1\r\nHost: gw\r\n" + b"X-Slow: " + b"a" * 10_000
    with _connect(guarded) as s:
        start = time.monotonic()
        for i in range(len(head)):
            assert time.monotonic() - start < WAIT_S, "never closed"
            if _closed(s):
                break
            try:
                s.sendall(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the whole head was sent without the connection being closed")


def test_oversized_header_is_refused(guarded: ThreadedGateway) -> None:
    big = b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    with _connect(guarded) as s:
        # closed while we were still sending: refused all the same
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(big)
        out, _ = _read_until_closed(s)
    assert out == b"" or _status(out) in (400, 431), out[:200]
    # a head under the limit is served
    r = httpx.get(guarded.url + "/health", headers={"X-Fine": "a" * 4000})
    assert r.status_code == 200


def test_slow_body_gets_a_408_and_the_connection_closed(guarded: ThreadedGateway) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n"
    )
    with _connect(guarded) as s:
        s.sendall(head + b'{"model": ')
        out, _ = _read_until_closed(s)
    assert _status(out) == 408, out[:300]
    body = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"


def test_unread_body_cannot_keep_the_connection_open(guarded: ThreadedGateway) -> None:
    """A 401 goes out before the body is read; the rest of the body then has the body
    timeout to arrive, however it trickles."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    with _connect(guarded) as s:
        s.sendall(head)
        start = time.monotonic()
        got = b""
        while not got.endswith(b"}"):
            assert time.monotonic() - start < WAIT_S
            got += s.recv(65536)
        assert _status(got) == 401
        while not _closed(s):
            assert time.monotonic() - start < WAIT_S, "never closed"
            try:
                s.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)


def test_still_serving_after_the_abuse(guarded: ThreadedGateway) -> None:
    r = httpx.post(
        guarded.url + COMPLETIONS,
        json={"model": MODEL, "prompt": "x", "max_tokens": 2},
        headers=AUTH,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
