"""A serving load client of the kind vLLM users benchmark with (`vllm bench serve --dataset-name random`): fixed
input and output lengths, `ignore_eos`, streaming with `stream_options.include_usage`, a fixed number of requests
at a fixed concurrency. It checks what such a client relies on (every request completes; the usage on the last
chunk counts exactly the tokens asked for; text arrives) and prints vLLM's figures: request and output-token
throughput, time to first token, inter-token latency (as vLLM's client computes it: the time after the first
token over the tokens after it; a streamed chunk may carry a whole speculative round) and end-to-end latency,
median and p99.

Prompts are token ids (the completions API takes them), drawn from `--id-range` with a seed, so the input length
is exact. It talks HTTP only: point it at `dvi serve` (or any OpenAI-compatible server).

Run: .venv/bin/python -m benchmarks.load_client --url http://127.0.0.1:8000 --requests 64 --concurrency 8 \
         --input-len 128 --output-len 64 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import requests


@dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool
    error: str = ""
    text: str = ""
    completion_tokens: int | None = None  # from the usage of the last chunk
    ttft_s: float | None = None
    chunks: int = 0  # streamed chunks that carried text
    latency_s: float = 0.0


def prompts(n: int, input_len: int, id_range: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*id_range) for _ in range(input_len)] for _ in range(n)]


def one(url: str, model: str | None, prompt: list[int], output_len: int, api_key: str | None) -> Outcome:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = Outcome(ok=False)
    t0 = time.perf_counter()
    try:
        with requests.post(url + "/v1/completions", json=body, headers=headers, stream=True, timeout=600) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            done = False
            for line in r.iter_lines(decode_unicode=True):
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
                text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if text:
                    if out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - t0
                    out.chunks += 1
                    out.text += text
            out.ok = done
            out.error = "" if done else "the stream ended without [DONE]"
    except requests.RequestException as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
    out.latency_s = time.perf_counter() - t0
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(url: str, *, requests_n: int, concurrency: int, input_len: int, output_len: int, model: str | None = None,
        id_range: tuple[int, int] = (1000, 30000), seed: int = 0, api_key: str | None = None,
        prompt_ids: list[list[int]] | None = None) -> dict:
    """Send the requests; the summary, with `problems` listing every request a vLLM-style client would trip on.
    `prompt_ids`: these prompts (token ids, taken in turn) instead of random ones of `input_len` tokens."""
    batch = [prompt_ids[i % len(prompt_ids)] for i in range(requests_n)] if prompt_ids else prompts(requests_n, input_len, id_range, seed)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda p: one(url, model, p, output_len, api_key), batch))
    wall = time.perf_counter() - t0
    problems = [f"request {i}: {o.error}" for i, o in enumerate(outcomes) if not o.ok]
    problems += [f"request {i}: usage says {o.completion_tokens} tokens, {output_len} were asked for (ignore_eos)"
                 for i, o in enumerate(outcomes) if o.ok and o.completion_tokens != output_len]
    problems += [f"request {i}: no text streamed" for i, o in enumerate(outcomes) if o.ok and not o.text]
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.completion_tokens or 0 for o in ok)
    itl = []  # (tokens - 1) gaps per request, each the time after the first token over them
    for o in ok:
        if o.completion_tokens and o.completion_tokens > 1 and o.ttft_s is not None:
            per = (o.latency_s - o.ttft_s) / (o.completion_tokens - 1)
            itl += [per] * (o.completion_tokens - 1)
    ttft, e2e = [o.ttft_s for o in ok if o.ttft_s is not None], [o.latency_s for o in ok]
    return {
        "url": url, "requests": requests_n, "concurrency": concurrency, "input_len": input_len, "output_len": output_len,
        "completed": len(ok), "failed": len(outcomes) - len(ok), "wall_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 4), "output_token_throughput": round(tokens / wall, 3),
        "ttft_s": {"median": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
        "itl_s": {"median": pct(itl, 0.5), "p99": pct(itl, 0.99)},
        "e2e_s": {"median": statistics.median(e2e) if e2e else None, "p99": pct(e2e, 0.99)},
        "chunks_per_request": round(statistics.mean(o.chunks for o in ok), 2) if ok else None,
        "problems": problems,
        "outcomes": [asdict(o) | {"text": o.text[:80]} for o in outcomes[:4]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="the model name to send (default: none, the server's)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary here too")
    a = p.parse_args(argv)
    summary = run(a.url, requests_n=a.requests, concurrency=a.concurrency, input_len=a.input_len, output_len=a.output_len,
                  model=a.model, seed=a.seed)
    print(json.dumps({k: v for k, v in summary.items() if k != "outcomes"}, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
