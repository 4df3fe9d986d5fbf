"""The JSON of OpenAI-compatible completion answers, as pure functions of what decoding gave.

A completion object (the whole answer, or one server-sent event's chunk), its choice objects (a message or text, or
a streamed delta; `stop_reason` as vLLM gives it), the usage (the prompt counted once, however many choices),
finish reasons (a stop string says "stop"), OpenAI's logprobs objects (completions' token lists with their
`text_offset`, chat's `content` entries) and the `dvi` extension field over n choices. It knows these shapes and a
tokenizer's `decode`; it does not know HTTP, how a request was parsed, how its tokens were decoded, or where a stop
string cut its text (dvi.serving.api hands in the cut).
"""

from __future__ import annotations

import json
from typing import Any

from dvi.engine_api import LogProb, Result


def completion(rid: str, kind: str, created: int, model: str, choices: list[dict], **extra: Any) -> dict:
    """A completion object (`kind`: its "object", e.g. "text_completion" or "chat.completion.chunk")."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **extra}


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj`."""
    return f"data: {json.dumps(obj)}\n\n"


def choice(index: int, text: str | None, chat: bool, *, delta: bool, finish: str | None = None,
           stop_reason: str | None = None, logprobs: dict | None = None) -> dict:
    """Choice `index` of an answer (`delta`: of a streamed chunk, where a chat text of None is an empty delta); a
    finished choice says its `stop_reason` (vLLM's: the stop string that ended it, else None)."""
    ch: dict = {"index": index}
    if chat:
        ch["delta" if delta else "message"] = ({"content": text} if text is not None else {}) if delta else \
            {"role": "assistant", "content": text}
    else:
        ch["text"] = text or ""
    ch.update(logprobs=logprobs, finish_reason=finish)
    if finish is not None:
        ch["stop_reason"] = stop_reason
    return ch


def role_delta(index: int) -> dict:
    """A streamed chat's first delta of choice `index`: the assistant's role, no text yet."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def completion_tokens(result: Result, cut: int | None) -> int:
    """The tokens a choice counts: `cut` where a stop string ended it (through the token that completed it, as vLLM
    counts them), else every token decoded."""
    return cut if cut is not None else len(result.token_ids)


def usage(prompt_tokens: int, completion: list[int]) -> dict:
    """The usage of an answer whose choices counted `completion` tokens: the prompt counts once, as OpenAI and vLLM
    count it."""
    total = sum(completion)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": total, "total_tokens": prompt_tokens + total}


def finish_reason(result: Result, stopped: str | None) -> str:
    """Why a choice ended: "stop" where a stop string (`stopped`) ended it, else the engine's reason."""
    return "stop" if stopped is not None else result.finish_reason


def logprobs_object(tokenizer, ids: list[int], pairs: list[LogProb], chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object for these tokens: completions' token lists (`text_offset` counted from `offset`), or
    chat's `content` entries."""
    text = [tokenizer.decode([t]) for t in ids]
    alts = [[(tokenizer.decode([a]), lp) for a, lp in top] for _, top in pairs]
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": x, "bytes": list(a.encode())} for a, x in top]}
                            for t, (lp, _), top in zip(text, pairs, alts)]}
    offsets = [offset + sum(len(t) for t in text[:i]) for i in range(len(text))]
    return {"tokens": text, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": [dict(top) for top in alts],
            "text_offset": offsets}


def choice_logprobs(tokenizer, result: Result, tokens: int, chat: bool) -> dict:
    """A whole choice's logprobs object: its first `tokens` tokens'."""
    pairs = [lp for r in result.rounds for lp in (r.logprobs or [])]
    return logprobs_object(tokenizer, result.token_ids[:tokens], pairs[:tokens], chat)


def text_length(obj: dict) -> int:
    """The characters of token text a completions logprobs object reports (the next one's `text_offset` starts there)."""
    return sum(len(t) for t in obj["tokens"])


def extension(fields: list[dict]) -> dict:
    """The answer's `dvi` field from its choices' own (`Replica.extension`): the first's, and with n > 1 every
    choice's under "choices"."""
    return fields[0] if len(fields) == 1 else {**fields[0], "choices": fields}
