"""dvi's request middleware in vLLM's API-server process (dvi.cli.vllm.middleware) and the engine-core view's lookup of an
answer's requests (dvi.cli.vllm.loop.answer_fields), as pure logic: the middleware around a stand-in ASGI application
that answers as vLLM's completions route does. `tests/dvi/cli/test_vllm_plugin.py` drives both in a real `vllm serve`."""

from __future__ import annotations

import asyncio
import json

import pytest

from dvi.cli.vllm.middleware import DviRequests, client_of, tagged, with_extension
from dvi.cli.vllm.loop import answer_fields
from dvi.serving.api import ApiError


def test_the_domain_tag_moves_into_vllm_xargs_from_the_dvi_object_or_the_header():
    body = {"prompt": "x", "dvi": {"domain": "code"}}
    assert tagged(body, None) == {"prompt": "x", "vllm_xargs": {"dvi_domain": "code"}}
    assert tagged({"prompt": "x"}, "qa") == {"prompt": "x", "vllm_xargs": {"dvi_domain": "qa"}}
    assert tagged({"prompt": "x", "dvi": {"domain": "code"}}, "qa")["vllm_xargs"] == {"dvi_domain": "code"}  # the body's wins
    # a dvi_domain the client gave vLLM itself is kept, its other vllm_xargs too
    assert tagged({"dvi": {"domain": "code"}, "vllm_xargs": {"dvi_domain": "math", "x": 1}}, None)["vllm_xargs"] == {"dvi_domain": "math", "x": 1}
    untouched = {"prompt": "x"}
    assert tagged(untouched, None) is untouched
    for bad, where in [({"dvi": "code"}, None), ({"dvi": {"domain": "a b"}}, None), ({}, "x" * 65), ({"dvi": {"domain": 3}}, None)]:
        with pytest.raises(ApiError) as e:
            tagged(bad, where)
        assert e.value.status == 400


def test_the_answer_gets_one_field_or_one_per_choice_and_none_without_fields():
    one = {"request_id": "r-1", "stats": {"drafted": 3}}
    assert with_extension({"id": "r"}, [one]) == {"id": "r", "dvi": one}
    two = with_extension({"id": "r"}, [one, {**one, "request_id": "r-2"}])["dvi"]
    assert [c["request_id"] for c in two["choices"]] == ["r-1", "r-2"]
    assert with_extension({"id": "r"}, []) == {"id": "r"}


def test_an_answer_finds_its_own_requests_in_choice_order_and_no_other():
    answered = [("cmpl-ab-0f0f0f0f", {"n": "one"}), ("cmpl-a-12345678", {"n": "a"}), ("1_cmpl-c-1-00000000", {"n": "c1/1"}),
                ("0_cmpl-c-1-aaaaaaaa", {"n": "c1/0"}), ("0_cmpl-c-0-bbbbbbbb", {"n": "c0/0"}), ("cmpl-a-1234567", {"n": "short"})]
    assert answer_fields(answered, "cmpl-a") == [{"n": "a"}]  # not cmpl-ab's, not a malformed suffix
    assert answer_fields(answered, "cmpl-c") == [{"n": "c0/0"}, {"n": "c1/0"}, {"n": "c1/1"}]  # prompt, then choice
    assert answer_fields(answered, "cmpl-z") == []
    assert answer_fields(answered, "cmpl-a.*") == []  # an id is matched as text


def test_the_client_is_its_key_where_the_server_has_one_else_its_address():
    scope = {"headers": [(b"authorization", b"Bearer k1")], "client": ("10.0.0.2", 5)}
    assert client_of(scope, keyed=True) == "key:Bearer k1" and client_of(scope, keyed=False) == "addr:10.0.0.2"


class Completions:
    """A stand-in for vLLM's completions route: the body it was given; a JSON answer, or `chunks` streamed events;
    `release` set holds the answer until then."""

    def __init__(self, chunks: int = 0):
        self.bodies: list[dict] = []
        self.chunks = chunks
        self.release: asyncio.Event | None = None

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.bodies.append(json.loads(message["body"]))
        if self.release is not None:
            await self.release.wait()
        if self.chunks:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(self.chunks):
                await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        data = json.dumps({"id": "cmpl-1", "choices": [{"text": "hi"}]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data[:5], "more_body": True})
        await send({"type": "http.response.body", "body": data[5:]})


async def call(app, body: dict, headers=(), path="/v1/completions", client=("127.0.0.1", 1)) -> tuple[int, dict, bytes]:
    """One request through `app`: its status, headers and body."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers), "client": client}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_middleware_tags_adds_the_field_and_refuses_a_bad_tag():
    inner = Completions()
    asked = []
    app = DviRequests(inner, fields=lambda answer_id: asked.append(answer_id) or [{"request_id": answer_id + "-0f0f0f0f"}])
    status, headers, body = asyncio.run(call(app, {"prompt": "x"}, headers=[(b"x-dvi-domain", b"code")]))
    answer = json.loads(body)
    assert status == 200 and inner.bodies[-1] == {"prompt": "x", "vllm_xargs": {"dvi_domain": "code"}}
    assert answer["dvi"] == {"request_id": "cmpl-1-0f0f0f0f"} and asked == ["cmpl-1"]
    assert int(headers[b"content-length"]) == len(body)  # the length of the answer as sent
    status, _, body = asyncio.run(call(app, {"prompt": "x", "dvi": {"domain": "no spaces"}}))
    assert status == 400 and json.loads(body)["error"]["param"] == "dvi.domain" and len(inner.bodies) == 1  # vLLM never saw it
    # other routes pass as they came; a loop that cannot answer leaves the answer as vLLM made it
    status, _, body = asyncio.run(call(app, {"x": 1}, path="/tokenize", headers=[(b"x-dvi-domain", b"code")]))
    assert inner.bodies[-1] == {"x": 1}

    def down(answer_id):
        raise OSError("connection refused")

    status, _, body = asyncio.run(call(DviRequests(Completions(), fields=down), {"prompt": "x"}))
    assert status == 200 and "dvi" not in json.loads(body)


def test_a_streamed_answer_passes_as_it_streams():
    app = DviRequests(Completions(chunks=3), fields=lambda answer_id: pytest.fail("a stream has no dvi field"))
    status, headers, body = asyncio.run(call(app, {"prompt": "x", "stream": True}))
    assert status == 200 and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_a_client_gets_at_most_its_cap_in_flight_and_a_slot_back_when_one_ends():
    async def scenario():
        inner = Completions()
        inner.release = asyncio.Event()
        app = DviRequests(inner, cap=2)
        held = [asyncio.create_task(call(app, {"prompt": "x"})) for _ in range(2)]
        while len(inner.bodies) < 2:
            await asyncio.sleep(0)
        third = await call(app, {"prompt": "x"})
        other = asyncio.create_task(call(app, {"prompt": "x"}, client=("10.0.0.9", 1)))  # another client's own slots
        while len(inner.bodies) < 3:
            await asyncio.sleep(0)
        inner.release.set()
        done = [await t for t in [*held, other]]
        return third, done, await call(app, {"prompt": "x"})

    third, done, after = asyncio.run(scenario())
    assert third[0] == 429 and "max_inflight_per_client=2" in json.loads(third[2])["error"]["message"]
    assert [d[0] for d in done] == [200, 200, 200] and after[0] == 200
