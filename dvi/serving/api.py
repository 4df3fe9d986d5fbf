"""The HTTP face of a serving replica: OpenAI-compatible completions over a `dvi.serving.replica.Replica`.

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (JSON, or server-sent events with
`"stream": true`), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Every completion carries
an extension field `dvi` with the request id, the drafter version(s) that drafted for it and its speculative
stats; a domain or tenant tag may come in as `"dvi": {"domain": "..."}` or the `X-DVI-Domain` header and goes
into the request's DecisionRecords.

Bodies are parsed by hand (`parse_completion`) so every mistake gets one clear 4xx in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}): malformed JSON, a missing or empty prompt, an unknown model,
out-of-range sampling values, max_tokens, `n` or `logprobs` (the target's unwarped log-probs, as vLLM's default;
streamed, each chunk carries the tokens decoded since the previous one); a body that is not JSON is a 415.
As vLLM does, fields this server does not know are ignored with a warning in its log, and it takes vLLM's
extensions `ignore_eos`, `min_tokens` and `skip_special_tokens` (and transformers' `split_special_tokens`: a raw prompt's
special-token text as its characters; chat contents always are); `stop` strings end generation and are cut from
the text (held back while streaming until they cannot start a stop string: the streamed text is exactly the
unstreamed one); chat content may be a list of text parts; `stream_options.include_usage` adds vLLM's last chunk
with the usage and no choices; `n` choices decode as n requests of the same prompt (seeds seed + i). A request whose client goes away is cancelled: its row leaves the batch at the
next round boundary (its decisions so far are still logged). With an
API key set (`serve.api_key` or $DVI_API_KEY), everything but /health needs `Authorization: Bearer <key>`, and
/health says only that the replica is up to a caller without it. A request that carries an `Origin` (a web page in
a browser) is refused with 403 unless `serve.allowed_origins` lists it, so no page a user opens can drive
generations; `serve.max_inflight_per_client` caps the requests one client (its key, else its address) has in flight
(429 beyond it). A request's CPU work (parsing, chat templating, tokenizing, an answer's detokenizing) runs on worker
threads (`off_loop`), not on the event loop (a stream's text is decoded there as it comes, a round's few tokens at a
time), and a prompt too long for `serve.max_prompt_tokens` is refused before it is
tokenized (`Replica.request`): one client's huge prompt never holds up another's request or `/health`.

`draining_server` runs the app under uvicorn so that a SIGINT or SIGTERM first drains the replica (requests in
flight finish or end with an error, never cut off as if complete). This module knows HTTP, uvicorn and the
OpenAI request shapes; the answers' JSON is built by `dvi.serving.openai_shapes`; decoding, batching and swaps are
the replica's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI reads the handlers' annotations from here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import Headers

from dvi.busy import BusyFile
from dvi.engine_api import LogProb, Result, TokenHook
from dvi.engine_api import Request as EngineRequest  # FastAPI's Request is the HTTP one
from dvi.errors import DviError
from dvi.records import DOMAIN
from dvi.serving import openai_shapes as shapes
from dvi.serving.replica import Job, Replica, Unavailable

log = logging.getLogger("dvi.serving.api")

MAX_BODY_BYTES = 4 << 20
LARGE_BODY_BYTES = 64 << 10  # a body past this is parsed and tokenized on the threads for large ones
_KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
          "n", "stop", "user", "dvi", "stream_options", "ignore_eos", "min_tokens", "skip_special_tokens", "logprobs",
          "top_logprobs", "split_special_tokens"}
ROLES = ("system", "developer", "user", "assistant", "tool")  # the chat template decides what it renders
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
_warned: set[str] = set()  # ignored field names already logged (bounded)


# a request's CPU work (parsing, templating, tokenizing, an answer's detokenizing) runs on these threads, not the loop;
# bodies over LARGE_BODY_BYTES two at a time on their own, so small requests never queue behind them
_POOLS = {"small": concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="dvi-prepare"),
          "large": concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dvi-prepare-large")}


async def off_loop(size: int, fn, *args):
    """`fn(*args)` on a worker thread (the large bodies' threads when `size` bytes exceed LARGE_BODY_BYTES)."""
    pool = _POOLS["large" if size > LARGE_BODY_BYTES else "small"]
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def domain_tag(body: dict, header: str | None) -> str | None:
    """A request's domain tag: its `dvi` object's `domain`, else the `X-DVI-Domain` header (None: neither); ApiError
    (400) for a malformed one."""
    ext = body.get("dvi") or {}
    if not isinstance(ext, dict):
        raise ApiError(400, "'dvi' must be an object, e.g. {\"domain\": \"code\"}", "dvi")
    domain = ext.get("domain", header)
    if domain is not None and (not isinstance(domain, str) or not DOMAIN.fullmatch(domain)):
        raise ApiError(400, "the domain tag must be 1 to 64 letters, digits, '.', '_' or '-'", "dvi.domain")
    return domain


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
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage and no choices
    n: int = 1  # choices: the prompt decoded n times (sampled: each with its own seed)
    logprobs: int | None = None  # the emitted tokens' log-probs with this many top alternatives (None: not asked)
    split_special_tokens: bool = False  # completions: special-token text in the prompt is its characters (chat: always)


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
    ignored = sorted(set(body) - _KNOWN)
    if ignored:  # as vLLM does: a client written for another server still gets an answer
        fresh = [k[:40] for k in ignored if k[:40] not in _warned]
        if fresh and len(_warned) < 256:
            _warned.update(fresh)
            log.warning("ignoring request fields this server does not implement: %s", fresh)
    model = body.get("model")
    if model not in (None, "", model_name, "dvi"):
        raise ApiError(404, f"model {model!r} not found: this server serves {model_name!r}", "model", "not_found_error")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    logprobs = _logprobs(body, chat)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters", "stop")

    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = [_message(m, i) for i, m in enumerate(messages)]
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
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object, e.g. {\"include_usage\": true}", "stream_options")
    include_usage = _flag(options, "include_usage", False, "stream_options.include_usage")
    ignore_eos = _flag(body, "ignore_eos", False)
    skip_special = _flag(body, "skip_special_tokens", True)
    split_special = _flag(body, "split_special_tokens", False)
    min_tokens = body.get("min_tokens", 0)
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or not 0 <= min_tokens <= max_tokens:
        raise ApiError(400, f"min_tokens must be an integer in [0, max_tokens={max_tokens}], got {min_tokens!r}", "min_tokens")
    domain = domain_tag(body, domain_header)
    return Completion(prompt, messages, max_tokens, temperature, top_p, seed, stream, domain, tuple(stop), ignore_eos,
                      min_tokens, skip_special, include_usage, n, logprobs, split_special)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives a request wants with its tokens' log-probs (None: no log-probs). Completions:
    `logprobs` is that number; chat: `logprobs: true` and `top_logprobs` the number."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")

    def count(v, name: str) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS:
            raise ApiError(400, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}", name)
        return v

    if not chat:
        return None if lp is None else count(lp, "logprobs")
    if lp not in (None, True, False):
        raise ApiError(400, f"logprobs must be true or false, got {lp!r}", "logprobs")
    top = 0 if top is None else count(top, "top_logprobs")
    if top and not lp:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return top if lp else None


def _message(m: Any, i: int) -> dict:
    """A chat message with its content as one string: text parts are joined (OpenAI's content parts)."""
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
    if m["role"] not in ROLES:
        raise ApiError(400, f"messages[{i}].role {m['role'][:40]!r} is not one of {', '.join(ROLES)}", "messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{i}].content parts must be text parts {{\"type\": \"text\", \"text\": ...}} "
                                "(this server serves a text model)", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": m["role"], "content": content}


def _flag(body: dict, key: str, default: bool, param: str | None = None) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{param or key} must be true or false, got {value!r}", param or key)
    return value


def _number(body: dict, key: str, default: float, ok, expected: str) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ApiError(400, f"{key} must be {expected}, got {value!r}", key)
    return float(value)


class TextStream:
    """Incremental detokenization: the text each new batch of token ids adds (held back while it ends mid-character)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip, self.ids, self.sent = tokenizer, skip_special_tokens, [], 0

    def text(self, n: int | None = None) -> str:
        """The text of the first `n` ids (all by default)."""
        return self.tokenizer.decode(self.ids[:n], skip_special_tokens=self.skip)

    def feed(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta


class StopText:
    """Text released to a client, cut before the first stop string. What could still be the start of a stop
    string is held back until it cannot, so the released text is the same however it was split into deltas."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.sent = stops, "", 0
        self.stopped: str | None = None  # the stop string found
        self.end = 0  # where the stop string ends in `text`

    def feed(self, delta: str) -> str:
        """The text that can be released now that `delta` followed what came before."""
        if self.stopped is not None:
            return ""
        self.text += delta
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            i, self.stopped = min(hits)
            self.end = i + len(self.stopped)
            out, self.sent = self.text[self.sent : i], i
            return out
        left = len(self.text) - self.sent
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, left), 0, -1) if self.text.endswith(s[:n])), default=0)
        out, self.sent = self.text[self.sent : len(self.text) - hold], len(self.text) - hold
        return out

    def flush(self) -> str:
        """Generation ended without a stop string: release what was held back."""
        if self.stopped is not None:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class Output:
    """One completion's text as its tokens arrive: detokenized, cut at a stop string, and the number of tokens
    that made it (through the one that completed the stop string, as vLLM counts them)."""

    def __init__(self, tokenizer, c: Completion):
        self.detok, self.stop = TextStream(tokenizer, c.skip_special_tokens), StopText(c.stop)
        self.released: list[str] = []
        self.tokens: int | None = None  # set when a stop string ended the text
        self.logprobs: list[LogProb] = []  # the fed tokens' (streamed with logprobs)
        self.reported = 0  # tokens whose logprobs went out in a chunk

    def feed(self, ids: list[int], logprobs: list[LogProb] | None = None) -> str:
        self.logprobs += logprobs or []
        before = len(self.detok.ids)
        out = self.stop.feed(self.detok.feed(ids))
        if self.stop.stopped is not None and self.tokens is None:
            self.tokens = next((n for n in range(before + 1, len(self.detok.ids) + 1) if len(self.detok.text(n)) >= self.stop.end),
                               len(self.detok.ids))
        self.released.append(out)
        return out

    def flush(self) -> str:
        out = self.stop.flush()
        self.released.append(out)
        return out

    @property
    def stopped(self) -> str | None:
        return self.stop.stopped

    def take_logprobs(self) -> tuple[list[int], list[LogProb]]:
        """The tokens (ids, logprobs) fed since the last call, none past the one that completed a stop string: the
        next chunk reports them (a token's text may still be held back as a possible start of a stop string; it is
        in the text by the end either way)."""
        end = min(len(self.logprobs), self.tokens if self.tokens is not None else len(self.detok.ids))
        start, self.reported = self.reported, max(self.reported, end)
        return self.detok.ids[start:end], self.logprobs[start:end]


def authorized(key: str | None, headers) -> bool:
    """Whether the request's headers carry the API key (always true without one)."""
    given = headers.get("authorization", "")
    return not key or hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


def refusal(replica: Replica, key: str | None, origins: frozenset[str], scope) -> JSONResponse | None:
    """Browser pages of other sites may not drive the API (their requests carry an Origin this server does not
    list); with an API key, everything but /health needs it."""
    headers = Headers(scope=scope)
    origin = headers.get("origin")
    if origin is not None and origin not in origins:
        replica.metrics.error(403)
        return JSONResponse(ApiError(403, f"requests from the web page at {origin[:100]!r} are not allowed; list the "
                                          "origin in serve.allowed_origins to allow it", kind="permission_error").body(),
                            status_code=403)
    if scope["path"] != "/health" and not authorized(key, headers):
        replica.metrics.error(401)
        return JSONResponse(ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                                     kind="authentication_error").body(), status_code=401)
    return None


class ClientSlots:
    """The requests each client (its API key, else its address) has in flight, at most `cap` (0: no cap); `busy`,
    where given, says whether any is (`dvi.busy`: how `dvi up` holds its trainer while serving answers). Touched on
    the event loop only."""

    def __init__(self, cap: int, busy: BusyFile | None = None):
        self.cap = cap
        self.inflight: Counter[str] = Counter()
        self.busy = busy

    def take(self, client: str) -> Callable[[], None]:
        """A slot for `client` (ApiError 429 when it has `cap` in flight already), and the function that frees it:
        once, however often it is called."""
        if self.cap and self.inflight[client] >= self.cap:
            raise ApiError(429, f"{self.inflight[client]} requests of this client are already in flight "
                                f"(serve.max_inflight_per_client={self.cap}); retry when one has finished",
                           kind="rate_limit_error")
        self.inflight[client] += 1
        if self.busy:
            self.busy.set(True)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight[client] -= 1
                if not self.inflight[client]:
                    del self.inflight[client]
                if self.busy and not self.inflight:
                    self.busy.set(False)

        return release


def create_app(replica: Replica) -> Any:
    """The FastAPI application over a replica."""

    app = FastAPI(title="dvi", version="1", docs_url=None, redoc_url=None)
    key = replica.api_key
    slots = ClientSlots(replica.cfg.serve.max_inflight_per_client, BusyFile.from_env())
    app.add_middleware(_Guard, refusal=functools.partial(refusal, replica, key, frozenset(replica.cfg.serve.allowed_origins)))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        replica.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    # health and metrics take the replica's locks: plain functions, run in the threadpool, never on the event loop
    @app.get("/health")
    def health(request: Request):
        # with an API key, a caller without it learns that the replica is up, and nothing about the host
        return replica.health() if authorized(key, request.headers) else {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(replica.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": replica.model_name, "object": "model", "owned_by": "dvi"}]}

    async def complete(request: Request, chat: bool):
        media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, f"the body must be JSON (Content-Type: application/json), not {media[:80]!r}")
        client = f"key:{request.headers.get('authorization', '')}" if key else f"addr:{request.client.host if request.client else '-'}"
        release = slots.take(client)  # freed once decoding is done (a streamed answer: when its jobs finish)
        try:
            response = await respond(request, chat, release)
        except BaseException:
            release()
            raise
        if not isinstance(response, StreamingResponse):
            release()
        return response

    async def respond(request: Request, chat: bool, release: Callable[[], None]):
        raw = await read_body(request, MAX_BODY_BYTES)
        c, req = await off_loop(len(raw), prepare, replica, raw, chat, request.headers.get("x-dvi-domain"))
        job = CompletionJob(replica, request, c, req, chat)
        if not c.stream:
            return await job.answer()
        job.submit(watch=True)
        job.decoded().add_done_callback(lambda _: release())  # decoding done: the client's slot is free
        return StreamingResponse(job.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


def prepare(replica: Replica, raw: bytes, chat: bool, domain_header: str | None) -> tuple[Completion, EngineRequest]:
    """The parsed request and its engine request: JSON parsing, chat templating and tokenization, CPU work that runs
    on a worker thread, never on the event loop (`/health` and other clients answer meanwhile)."""
    c = parse_completion(raw, chat, model_name=replica.model_name, default_max_tokens=replica.defaults.max_new_tokens,
                         max_max_tokens=replica.cfg.serve.max_max_tokens, default_temperature=replica.defaults.temperature,
                         default_top_p=replica.defaults.top_p, domain_header=domain_header)
    try:
        return c, replica.request(c)
    except DviError as e:  # the engine's checks: prompt too long, ids out of the vocabulary, ...
        raise ApiError(400, str(e), "messages" if chat else "prompt") from None


def enqueue(replica: Replica, req: EngineRequest, domain: str | None, on_tokens: TokenHook | None) -> Job:
    """`req` queued on the replica; ApiError 503 when it takes none now."""
    try:
        return replica.submit(req, domain, on_tokens)
    except Unavailable as e:
        raise ApiError(503, str(e), kind="server_error") from None


async def until_done(replica: Replica, request: Request, job: Job) -> Result:
    """The job's result; a client that goes away meanwhile cancels it (it leaves the batch at the next round)."""
    future = asyncio.wrap_future(job.future)
    while True:
        done, _ = await asyncio.wait({future}, timeout=0.25)
        if done:
            break
        if await request.is_disconnected():
            replica.cancel(job, "abort")
            break
    try:
        return await future
    except DviError as e:  # the server drained it on shutdown
        raise ApiError(503, str(e), kind="server_error") from None


class CompletionJob:
    """One completion request on the replica: its parsed Completion, the engine requests of its n choices (the same
    prompt, each its own seed and request id), their replica jobs and, where their tokens are watched (streamed, or
    cut at stop strings), each choice's Output as they arrive. `answer` is the whole JSON answer, `events` a streamed
    one's server-sent events; a client that goes away cancels the choices' requests either way."""

    def __init__(self, replica: Replica, request: Request, c: Completion, req: EngineRequest, chat: bool):
        self.replica, self.request, self.c, self.chat = replica, request, c, chat
        # n choices: n engine requests of the same prompt, each its own seed (the given one + i) and request id
        self.reqs = [req] + [dataclasses.replace(req, seed=None if c.seed is None else (c.seed + i) % 2**63, request_id=uuid.uuid4().hex)
                             for i in range(1, c.n)]
        self.kind = "chat.completion" if chat else "text_completion"
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id}"
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.jobs: list[Job] = []
        self.outs: list[Output] = []  # watched: each choice's text as its tokens arrive
        self.chunks: asyncio.Queue = asyncio.Queue()  # watched: (choice, ids, logprobs) round by round; ids None: done
        self.offsets = [0] * c.n  # streamed completions: characters of token text reported so far, per choice

    def submit(self, watch: bool) -> None:
        """Queue every choice's request (all or none); `watch`: their tokens go to `chunks` round by round."""
        if watch:
            self.outs = [Output(self.replica.tokenizer, self.c) for _ in self.reqs]
        loop, chunks, jobs = self.loop, self.chunks, []
        try:
            for i, r in enumerate(self.reqs):
                hook = (lambda ids, lps, i=i: loop.call_soon_threadsafe(chunks.put_nowait, (i, ids, lps))) if watch else None
                jobs.append(enqueue(self.replica, r, self.c.domain, hook))
                if watch:
                    jobs[-1].future.add_done_callback(lambda _, i=i: loop.call_soon_threadsafe(chunks.put_nowait, (i, None, None)))
        except BaseException:
            for job in jobs:
                self.replica.cancel(job, "abort")
            raise
        self.jobs = jobs

    async def answer(self) -> dict:
        """The whole answer. With stop strings the tokens are watched: a stop string cancels its choice's request
        as soon as it shows (it leaves the batch at the next round)."""
        self.submit(watch=bool(self.c.stop))
        finished = asyncio.gather(*(until_done(self.replica, self.request, job) for job in self.jobs))  # watches for the client going away
        if not self.c.stop:
            results = await finished
            texts = await off_loop(0, self.texts, results)
        else:
            async for _ in self.deltas():
                pass
            results = await finished
            texts = ["".join(o.released) for o in self.outs]
        choices = [shapes.choice(i, t, self.chat, delta=False, finish=self.finish(i, r), stop_reason=self.stopped(i),
                                 logprobs=self.logprobs(i, r)) for i, (t, r) in enumerate(zip(texts, results))]
        return shapes.completion(self.rid, self.kind, self.created, self.replica.model_name, choices,
                                 usage=self.usage(results), dvi=self.extension(results))

    def texts(self, results: list[Result]) -> list[str]:
        """The choices' whole texts (CPU work, for a worker thread)."""
        return [self.replica.tokenizer.decode(r.token_ids, skip_special_tokens=self.c.skip_special_tokens) for r in results]

    async def deltas(self):
        """(choice, text) as the text can be released; a stop string cancels its choice's request (it leaves the
        batch at the next round)."""
        running = len(self.jobs)
        while running:
            i, ids, lps = await self.chunks.get()
            out = self.outs[i]
            if ids is None:
                running -= 1
                if tail := out.flush():
                    yield i, tail
                continue
            delta = out.feed(ids, lps)
            if out.stopped is not None:
                self.replica.cancel(self.jobs[i], "stop")
            if delta:
                yield i, delta

    def decoded(self) -> asyncio.Future:
        """Done once every choice's decoding is, however it ended."""
        return asyncio.gather(*(asyncio.wrap_future(job.future) for job in self.jobs), return_exceptions=True)

    async def events(self):
        """The server-sent events of a streamed answer: the text as it can be released, then the finish, usage and
        `dvi` field, or an error event (never an end as if complete). A client that goes away mid-stream (the
        generator is closed) stops the decoding for it."""
        try:
            if self.chat:
                yield self.event([shapes.role_delta(i) for i in range(len(self.jobs))])
            async for i, text in self.deltas():
                yield self.event([shapes.choice(i, text, self.chat, delta=True, logprobs=self.streamed_logprobs(i))])
            try:
                results = [job.future.result() for job in self.jobs]
            except Exception as e:  # shut down or failed: say so in the stream, never end it as if complete
                error = ApiError(503, str(e), kind="server_error") if isinstance(e, DviError) else \
                    ApiError(500, f"decoding failed: {e}", kind="server_error")
                yield shapes.sse(error.body())
                return
            yield self.event([shapes.choice(i, "" if not self.chat else None, self.chat, delta=True, finish=self.finish(i, r),
                                            stop_reason=self.stopped(i), logprobs=self.streamed_logprobs(i))
                              for i, r in enumerate(results)], usage=self.usage(results), dvi=self.extension(results))
            if self.c.include_usage:  # vLLM's last chunk: no choices, the usage
                yield self.event([], usage=self.usage(results))
            yield "data: [DONE]\n\n"
        finally:
            for job in self.jobs:
                self.replica.cancel(job, "abort")

    def event(self, choices: list[dict], **extra: Any) -> str:
        kind = "chat.completion.chunk" if self.chat else self.kind
        return shapes.sse(shapes.completion(self.rid, kind, self.created, self.replica.model_name, choices, **extra))

    def stopped(self, i: int) -> str | None:
        """The stop string that ended choice i (None: none did, or its tokens were not watched)."""
        return self.outs[i].stopped if self.outs else None

    def finish(self, i: int, result: Result) -> str:
        return shapes.finish_reason(result, self.stopped(i))

    def tokens(self, i: int, result: Result) -> int:
        return shapes.completion_tokens(result, self.outs[i].tokens if self.outs else None)

    def usage(self, results: list[Result]) -> dict:
        return shapes.usage(len(self.reqs[0].prompt_ids), [self.tokens(i, r) for i, r in enumerate(results)])

    def extension(self, results: list[Result]) -> dict:
        return shapes.extension([self.replica.extension(r) for r in results])

    def logprobs(self, i: int, result: Result) -> dict | None:
        """Choice i's whole logprobs object (None when not asked for)."""
        if self.c.logprobs is None:
            return None
        return shapes.choice_logprobs(self.replica.tokenizer, result, self.tokens(i, result), self.chat)

    def streamed_logprobs(self, i: int) -> dict | None:
        """The logprobs object of choice i's next chunk: its tokens not yet reported (None when none or not asked)."""
        if self.c.logprobs is None:
            return None
        ids, pairs = self.outs[i].take_logprobs()
        if not ids:
            return None
        obj = shapes.logprobs_object(self.replica.tokenizer, ids, pairs, self.chat, self.offsets[i])
        if not self.chat:
            self.offsets[i] += shapes.text_length(obj)
        return obj


class _Guard:
    """Plain ASGI middleware that answers a refused request itself (`refusal(scope)` gives the response) and
    passes the rest through untouched: unlike Starlette's BaseHTTPMiddleware it leaves `receive` alone, so a
    handler still sees its client go away (`Request.is_disconnected`)."""

    def __init__(self, app, refusal):
        self.app, self.refusal = app, refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (response := self.refusal(scope)) is not None:
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


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
