"""What dvi's API adds to vLLM's own OpenAI server, as an ASGI middleware in vLLM's API-server process.

`DviRequests` wraps vLLM's `/v1/completions` and `/v1/chat/completions` (dvi's endpoint plugin,
`dvi.cli.vllm.loop.DviEndpoints`, installs it on vLLM's application before vLLM adds its own middleware, so vLLM's
API key and origin checks run first):

- **the domain tag** as dvi's API takes it: the `X-DVI-Domain` header or the body's `"dvi": {"domain": "code"}` becomes
  vLLM's `"vllm_xargs": {"dvi_domain": "code"}`, which the loop in the engine-core process reads (a `dvi_domain` the
  client set there itself wins); a malformed tag is refused with one 400, as dvi's API refuses it;
- **the per-client cap** (`serve.max_inflight_per_client`): a client (its API key, else its address) with that many
  requests in flight gets a 429 for the next, until one finishes (a streamed answer holds its slot until its stream ends);
- **the `dvi` field** of a JSON answer (not of a streamed one): which drafters drafted for the request and how well,
  as dvi's API answers it, relayed from the loop's view in the engine-core process (`GET /requests/<answer id>` on
  127.0.0.1:$DVI_LOOP_PORT). The engine core hands a finished request to the loop before vLLM sends its output, so the
  field is there when the answer is. Where the loop does not answer, the answer goes out without it: the field never
  fails or holds up a request.

It knows HTTP and the shape of those requests and answers; what a domain, a drafter version or a statistic means is the
replica's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.parse
from collections.abc import Callable

from dvi.busy import BusyFile
from dvi.serving.api import ApiError, ClientSlots, domain_tag
from dvi.serving.openai_shapes import extension
from dvi.cli.vllm.engine import DOMAIN_ARG

log = logging.getLogger("dvi.cli.vllm.plugin")

PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
HEADER = b"x-dvi-domain"


def tagged(body: dict, header: str | None) -> dict:
    """`body` with its domain tag (the `dvi` object's `domain`, else the `X-DVI-Domain` header) moved into vLLM's
    `vllm_xargs` as `dvi_domain`, the `dvi` object removed (vLLM knows no such field). A `dvi_domain` already in
    `vllm_xargs` is kept. ApiError (400) for a tag dvi's API would refuse."""
    domain = domain_tag(body, header)  # as dvi's own API reads and checks it
    if domain is None:
        return body
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):  # vLLM's own validation answers for it
        return body
    out = {k: v for k, v in body.items() if k != "dvi"}
    out["vllm_xargs"] = {DOMAIN_ARG: domain, **xargs}
    return out


def with_extension(answer: dict, fields: list[dict]) -> dict:
    """`answer` with dvi's field: its requests' own (one per choice, in choice order)."""
    return {**answer, "dvi": extension(fields)} if fields else answer


def client_of(scope: dict, keyed: bool) -> str:
    """Who a request's slot is counted against: its API key where the server has one, else its address."""
    if keyed:
        return "key:" + dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
    client = scope.get("client")
    return f"addr:{client[0] if client else '-'}"


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: vLLM waits here for a disconnect

    return replayed


async def _error(send, e: ApiError) -> None:
    data = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class DviRequests:
    """The ASGI middleware (see the module docstring). `fields(answer_id)`: the loop's `dvi` fields of the requests
    behind an answer, [] where it has none (called in a worker thread); None: no `dvi` field. `cap`: requests a client
    may have in flight (0: no cap); `keyed`: the server has an API key (the client is its key, else its address)."""

    def __init__(self, app, fields: Callable[[str], list[dict]] | None = None, cap: int = 0, keyed: bool = False):
        self.app = app
        self.fields = fields
        self.slots = ClientSlots(cap, BusyFile.from_env())
        self.keyed = keyed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            return await self.app(scope, receive, send)
        raw = await _body(receive)
        try:
            body = json.loads(raw)
        except ValueError:  # vLLM's own answer for a body it cannot read
            body = None
        streamed = True
        try:
            if isinstance(body, dict):
                header = dict(scope.get("headers") or []).get(HEADER)
                tagged_body = tagged(body, header.decode("latin-1") if header is not None else None)
                if tagged_body is not body:
                    raw = json.dumps(tagged_body).encode()
                streamed = bool(body.get("stream"))
            release = self.slots.take(client_of(scope, self.keyed))
        except ApiError as e:
            return await _error(send, e)
        try:
            out = send if streamed or self.fields is None else _Answer(send, self.fields).send
            await self.app(scope, _replay(raw, receive), out)
        finally:
            release()


class _Answer:
    """The `send` of one JSON answer: held until it is whole, then sent with dvi's field added."""

    def __init__(self, send, fields: Callable[[str], list[dict]]):
        self._send, self._fields = send, fields
        self._start: dict | None = None
        self._chunks: list[bytes] = []

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] != "http.response.body" or self._start is None:
            return await self._send(message)
        self._chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = b"".join(self._chunks)
        start, self._start = self._start, None
        if start["status"] == 200:
            body = await self._added(body)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await self._send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body})

    async def _added(self, body: bytes) -> bytes:
        try:
            answer = json.loads(body)
            fields = await asyncio.get_running_loop().run_in_executor(None, self._fields, str(answer["id"]))
            return json.dumps(with_extension(answer, fields)).encode() if fields else body
        except Exception as e:  # the answer goes out as vLLM made it
            log.warning("no dvi field for an answer: %s", e)
            return body


def relayed_fields(view: Callable[[int, str], bytes], port: int) -> Callable[[str], list[dict]]:
    """The loop's `dvi` fields of an answer's requests, read from its view on 127.0.0.1:`port` (`view(port, path)`)."""

    def fields(answer_id: str) -> list[dict]:
        try:
            return json.loads(view(port, "/requests/" + urllib.parse.quote(answer_id, safe="")))["fields"]
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []
            raise

    return fields
