"""The HTTP face of a serving replica: OpenAI-compatible completions over a `dvi.serving.replica.Replica`.

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (JSON, or server-sent events with
`"stream": true`), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Every completion carries
an extension field `dvi` with the request id, the drafter version(s) that drafted for it and its speculative
stats; a domain or tenant tag may come in as `"dvi": {"domain": "..."}` or the `X-DVI-Domain` header and goes
into the request's DecisionRecords.

Bodies are parsed by hand (`parse_completion`) so every mistake gets one clear 4xx in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}): malformed JSON, a missing or empty prompt, an unknown model,
out-of-range sampling values or max_tokens, `n` > 1, unsupported fields; a body that is not JSON is a 415. With an
API key set (`serve.api_key` or $DVI_API_KEY), everything but /health needs `Authorization: Bearer <key>`, and
/health says only that the replica is up to a caller without it. A request that carries an `Origin` (a web page in
a browser) is refused with 403 unless `serve.allowed_origins` lists it, so no page a user opens can drive
generations; `serve.max_inflight_per_client` caps the requests one client (its key, else its address) has in flight
(429 beyond it).

`draining_server` runs the app under uvicorn so that a SIGINT or SIGTERM first drains the replica (requests in
flight finish or end with an error, never cut off as if complete). This module knows HTTP, uvicorn and the
OpenAI request shapes; decoding, batching and swaps are the replica's.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI reads the handlers' annotations from here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dvi.errors import DviError
from dvi.records import DOMAIN
from dvi.serving.replica import Replica, Unavailable

log = logging.getLogger("dvi.serving.api")

MAX_BODY_BYTES = 4 << 20
_KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
          "n", "stop", "user", "dvi", "stream_options"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Completion:
    """A parsed completion request."""

    prompt: str | list[int] | None  # text, or token ids (completions)
    messages: list[dict] | None  # chat
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    domain: str | None


def parse_completion(raw: bytes, chat: bool, *, model_name: str, default_max_tokens: int, max_max_tokens: int,
                     default_temperature: float, default_top_p: float, domain_header: str | None = None) -> Completion:
    """The request in `raw`, or ApiError (400 / 404 / 413) naming what is wrong."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting deeper than json can parse
        raise ApiError(400, f"malformed JSON body: {str(e)[:200] or 'nested too deeply'}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ApiError(400, f"unsupported fields {unknown}", unknown[0])
    model = body.get("model")
    if model not in (None, "", model_name, "dvi"):
        raise ApiError(404, f"model {model!r} not found: this server serves {model_name!r}", "model", "not_found_error")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    if body.get("stop") not in (None, [], ""):
        raise ApiError(400, "stop sequences are not supported; the model stops at its end-of-text token", "stop")

    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ApiError(400, f"messages[{i}] must be an object with string 'role' and 'content'", "messages")
            if m["role"] not in ("system", "user", "assistant"):
                raise ApiError(400, f"messages[{i}].role {m['role']!r} is not system, user or assistant", "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids (one prompt per request)", "prompt")
        elif not isinstance(prompt, str) or not prompt.strip():
            raise ApiError(400, "'prompt' must be a non-empty string", "prompt")

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= max_max_tokens:
        raise ApiError(400, f"max_tokens must be an integer in [1, {max_max_tokens}], got {max_tokens!r}", "max_tokens")
    temperature = _number(body, "temperature", default_temperature, lambda x: 0 <= x <= 100, "a number in [0, 100] (0 = greedy)")
    top_p = _number(body, "top_p", default_top_p, lambda x: 0 < x <= 1, "a number in (0, 1]")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise ApiError(400, f"seed must be an integer in [0, 2^63), got {seed!r}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    ext = body.get("dvi") or {}
    if not isinstance(ext, dict):
        raise ApiError(400, "'dvi' must be an object, e.g. {\"domain\": \"code\"}", "dvi")
    domain = ext.get("domain", domain_header)
    if domain is not None and (not isinstance(domain, str) or not DOMAIN.fullmatch(domain)):
        raise ApiError(400, "the domain tag must be 1 to 64 letters, digits, '.', '_' or '-'", "dvi.domain")
    return Completion(prompt, messages, max_tokens, temperature, top_p, seed, stream, domain)


def _number(body: dict, key: str, default: float, ok, expected: str) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ApiError(400, f"{key} must be {expected}, got {value!r}", key)
    return float(value)


class TextStream:
    """Incremental detokenization: the text each new batch of token ids adds (held back while it ends mid-character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def feed(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta


def create_app(replica: Replica) -> Any:
    """The FastAPI application over a replica."""

    app = FastAPI(title="dvi", version="1", docs_url=None, redoc_url=None)
    key = replica.api_key
    origins = frozenset(replica.cfg.serve.allowed_origins)
    per_client = replica.cfg.serve.max_inflight_per_client
    inflight: Counter[str] = Counter()  # client -> requests in flight (touched on the event loop only)

    def authorized(request: Request) -> bool:
        given = request.headers.get("authorization", "")
        return not key or hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Browser pages of other sites may not drive the API (their requests carry an Origin this server does not
        list); with an API key, everything but /health needs it."""
        origin = request.headers.get("origin")
        if origin is not None and origin not in origins:
            replica.metrics.error(403)
            return JSONResponse(ApiError(403, f"requests from the web page at {origin[:100]!r} are not allowed; list the "
                                              "origin in serve.allowed_origins to allow it", kind="permission_error").body(),
                                status_code=403)
        if request.url.path != "/health" and not authorized(request):
            replica.metrics.error(401)
            return JSONResponse(ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                                         kind="authentication_error").body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        replica.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    # health and metrics take the replica's locks: plain functions, run in the threadpool, never on the event loop
    @app.get("/health")
    def health(request: Request):
        # with an API key, a caller without it learns that the replica is up, and nothing about the host
        return replica.health() if authorized(request) else {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(replica.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": replica.model_name, "object": "model", "owned_by": "dvi"}]}

    def submit(req, domain, on_tokens=None):
        try:
            return replica.submit(req, domain, on_tokens)
        except Unavailable as e:
            raise ApiError(503, str(e), kind="server_error") from None

    async def complete(request: Request, chat: bool):
        media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, f"the body must be JSON (Content-Type: application/json), not {media[:80]!r}")
        client = f"key:{request.headers.get('authorization', '')}" if key else f"addr:{request.client.host if request.client else '-'}"
        if per_client and inflight[client] >= per_client:
            raise ApiError(429, f"{inflight[client]} requests of this client are already in flight "
                                f"(serve.max_inflight_per_client={per_client}); retry when one has finished",
                           kind="rate_limit_error")
        inflight[client] += 1
        released = False

        def release() -> None:  # once decoding is done (a streamed answer: when its job finishes)
            nonlocal released
            if not released:
                released = True
                inflight[client] -= 1
                if not inflight[client]:
                    del inflight[client]

        try:
            response = await _complete(request, chat, release)
        except BaseException:
            release()
            raise
        if not isinstance(response, StreamingResponse):
            release()
        return response

    async def _complete(request: Request, chat: bool, release):
        raw = await read_body(request, MAX_BODY_BYTES)
        c = parse_completion(raw, chat, model_name=replica.model_name, default_max_tokens=replica.defaults.max_new_tokens,
                             max_max_tokens=replica.cfg.serve.max_max_tokens, default_temperature=replica.defaults.temperature,
                             default_top_p=replica.defaults.top_p, domain_header=request.headers.get("x-dvi-domain"))
        try:
            req = replica.request(c)
        except DviError as e:  # the engine's checks: prompt too long, ids out of the vocabulary, ...
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        kind = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        if not c.stream:
            job = submit(req, c.domain)
            try:
                result = await asyncio.wrap_future(job.future)
            except DviError as e:  # the server drained it on shutdown
                raise ApiError(503, str(e), kind="server_error") from None
            text = replica.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return {"id": f"cmpl-{req.request_id}", "object": kind, "created": created, "model": replica.model_name,
                    "choices": [choice], "usage": _usage(req, result), "dvi": replica.extension(result)}

        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        detok = TextStream(replica.tokenizer)
        job = submit(req, c.domain, on_tokens=lambda ids: loop.call_soon_threadsafe(chunks.put_nowait, ids))
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(chunks.put_nowait, None))
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(release))  # decoding done: the slot is free

        def chunk(delta: str | None, finish: str | None = None, **extra) -> str:
            choice = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {"content": delta} if delta is not None else {}
            else:
                choice["text"] = delta or ""
            obj = {"id": f"cmpl-{req.request_id}", "object": f"{kind}.chunk" if chat else kind, "created": created,
                   "model": replica.model_name, "choices": [choice], **extra}
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            if chat:
                yield chunk(None, **{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            while (ids := await chunks.get()) is not None:
                delta = detok.feed(ids)
                if delta:
                    yield chunk(delta)
            try:
                result = job.future.result()
            except Exception as e:  # shut down or failed: say so in the stream, never end it as if complete
                error = ApiError(503, str(e), kind="server_error") if isinstance(e, DviError) else \
                    ApiError(500, f"decoding failed: {e}", kind="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            yield chunk("" if not chat else None, result.finish_reason, usage=_usage(req, result), dvi=replica.extension(result))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with 413 as soon as it is known to exceed `limit` bytes (by its Content-Length,
    or while it streams in): a huge body is never held in memory whole."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {int(length)} bytes exceeds {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _usage(req, result) -> dict:
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(result.token_ids),
            "total_tokens": len(req.prompt_ids) + len(result.token_ids)}


def draining_server(config: uvicorn.Config, replica: Replica, grace_s: float) -> uvicorn.Server:
    """A uvicorn server that, on the first SIGINT / SIGTERM, drains the replica (`Replica.drain`) before it shuts
    down: requests in flight finish or end with an error, never cut off as if complete. A second signal stops at once."""

    class _Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True

            def drain() -> None:
                failed = replica.drain(grace_s)
                if failed:
                    log.warning("shutting down: %d request(s) still unfinished after %g s ended with an error", failed, grace_s)
                uvicorn.Server.handle_exit(self, sig, frame)

            threading.Thread(target=drain, name="dvi-drain", daemon=True).start()

    return _Server(config)
