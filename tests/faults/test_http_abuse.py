"""Scenario 10, HTTP abuse: malformed JSON, huge prompts, negative or huge max_tokens, slow clients and many
connections get a 4xx or bounded queueing (503), never a crash; with the API key set, unauthenticated requests
get 401. Against `dvi serve` on the real demo pair, dvi's own HTTP server (serve.engine=dvi; on the default engine the
server is vLLM's own)."""

from __future__ import annotations

import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from broker_fixtures import stream_config
from faults_helpers import Serve, stream_overrides

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.broker, pytest.mark.real_model]

KEY = "abuse-test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(broker, demo_target_dir, tmp_path_factory):
    from streams.topics import ensure_topics

    stream_cfg = stream_config(broker.bootstrap)
    ensure_topics(stream_cfg)
    tmp = tmp_path_factory.mktemp("abuse")
    # every request here is one client's (one API key): the server-wide bounds are under test, so the per-client cap
    # is off (its own test: tests/dvi/serving/test_replica.py::test_hostile_http_requests_get_a_clear_4xx_and_cost_nothing)
    s = Serve(tmp, *stream_overrides(stream_cfg), "serve.max_connections=24", "serve.max_queue=4", "serve.max_batch=2",
              "serve.max_inflight_per_client=0",
              "serve.max_max_tokens=256", "tracking.enabled=false", f"serve.swap.store={tmp / 'store'}",
              env={"DVI_API_KEY": KEY}, engine="dvi")  # a secret: from the environment, never the command line
    yield s
    assert s.stop() == 0  # it never crashed: a clean stop at the end


def post(server, body, path="/v1/completions", headers=AUTH, **kw):
    data = body if isinstance(body, (bytes, str)) else __import__("json").dumps(body)
    return requests.post(server.url + path, data=data, headers={"Content-Type": "application/json", **headers}, timeout=120, **kw)


def test_bad_bodies_get_one_clear_4xx_each(server):
    cases = {
        "malformed JSON": (b'{"prompt": "hi", ', 400),
        "not an object": (b'[1, 2, 3]', 400),
        "negative max_tokens": ({"prompt": "hi", "max_tokens": -5}, 400),
        "huge max_tokens": ({"prompt": "hi", "max_tokens": 10**12}, 400),
        "max_tokens not a number": ({"prompt": "hi", "max_tokens": "lots"}, 400),
        "prompt longer than the context window": ({"prompt": "word " * 9000, "max_tokens": 4}, 400),
        "token id outside the vocabulary": ({"prompt": [1, 2, 10**9], "max_tokens": 4}, 400),
        "unknown model": ({"model": "gpt-9", "prompt": "hi"}, 404),
    }
    for what, (body, status) in cases.items():
        r = post(server, body)
        assert r.status_code == status, (what, r.status_code, r.text)
        assert r.json()["error"]["message"], what
    assert post(server, {"prompt": "hi", "max_tokens": 4}, headers={}).status_code == 401
    assert post(server, {"prompt": "hi", "max_tokens": 4}, headers={"Authorization": "Bearer nope-nope-nope"}).status_code == 401
    assert post(server, {"prompt": "Hello", "max_tokens": 4}).status_code == 200


def answer_before_the_body_ends(server, head: bytes, body_part: bytes) -> bytes:
    """Send a request's head and only part of its body, then read: the status line the server sends without
    waiting for the rest (a server that reads the whole body first never answers, and the read times out)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + body_part)
        try:
            return s.recv(200)
        except socket.timeout:
            return b"(no answer while the body was incomplete)"


def test_huge_bodies_are_refused_before_they_are_read(server):
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    declared = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                + b"Content-Length: 1073741824\r\n\r\n")  # 1 GiB announced, 1 KiB sent
    t0 = time.perf_counter()
    got = answer_before_the_body_ends(server, declared, b"{" + b" " * 1023)
    seconds = time.perf_counter() - t0
    assert got.startswith(b"HTTP/1.1 413"), got
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
               + b"Transfer-Encoding: chunked\r\n\r\n")  # no length: 5 MiB streamed, the body never ends
    got = answer_before_the_body_ends(server, chunked, (b"100000\r\n" + b" " * (1 << 20) + b"\r\n") * 5)
    assert got.startswith(b"HTTP/1.1 413"), got
    print(f"\na 1 GiB body was refused with 413 after 1 KiB of it, in {seconds:.2f} s; a chunked one after 5 MiB")
    assert server.health()["status"] == "ok"


def test_slow_clients_and_a_flood_get_bounded_queueing_never_a_crash(server):
    # slow clients: connections that dribble their headers hold a slot each but do not stop others
    slow = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    try:
        r = post(server, {"prompt": "def add(a, b):", "max_tokens": 4})
        assert r.status_code == 200, r.text

        # a flood: 64 requests at once against 24 connections and a queue of 4
        def one(i):
            try:
                return post(server, {"prompt": f"Count to {i}:", "max_tokens": 8}).status_code
            except requests.ConnectionError:
                return "refused"

        t0 = time.perf_counter()
        with ThreadPoolExecutor(64) as pool:
            statuses = Counter(pool.map(one, range(64)))
        seconds = time.perf_counter() - t0
    finally:
        for s in slow:
            s.close()
    print(f"\nflood of 64 requests with 8 slow clients holding connections: {dict(statuses)} in {seconds:.1f} s")
    assert set(statuses) <= {200, 503}, statuses  # served, or told to come back: nothing else
    assert statuses[200] >= 1 and statuses[503] >= 1
    assert server.child.running and server.health()["status"] == "ok"
    assert post(server, {"prompt": "Hello again", "max_tokens": 4}).status_code == 200


def test_connections_beyond_the_limit_are_told_503_at_once(server):
    held = []
    try:
        for _ in range(24):  # serve.max_connections idle clients, each holding a connection open mid-request
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        time.sleep(0.5)
        r = post(server, {"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 503, r.text
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    assert post(server, {"prompt": "Hello", "max_tokens": 4}).status_code == 200
