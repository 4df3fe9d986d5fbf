"""The OpenAI API as vLLM users bring it: the official `openai` client, stop strings (exact in streaming), vLLM's
extensions (`ignore_eos`, `min_tokens`), content parts, usage on the last chunk, fields ignored rather than refused,
and a client that goes away cancelling its request. Replicas of the tiny pair (the demo tokenizer, random weights)
behind uvicorn; the cancellation test decodes with the real demo pair, slow enough to be cut short."""

from __future__ import annotations

import http.client
import json
import time
from types import SimpleNamespace

import pytest
import requests
from openai import OpenAI
from replica_fixtures import Running, replica, service_config
from test_replica import PROMPTS

from dvi.config import DviConfig, ModelConfig, TrackingConfig
from dvi.models import load_tokenizer
from dvi.serving import openai_shapes as shapes
from dvi.serving.api import Output, StopText, parse_completion


@pytest.fixture
def running(stream_cfg, tiny_dirs, tmp_path):
    r = Running(replica(service_config(stream_cfg, tiny_dirs, tmp_path / "store", served_model_name="tiny")))
    yield r
    r.close()


def client(r: Running) -> OpenAI:
    return OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def stream_events(r: Running, path: str, body: dict) -> list[dict]:
    with requests.post(r.url + path, data=json.dumps({**body, "stream": True}), stream=True, timeout=120) as s:
        assert s.status_code == 200, s.text
        events = [line[6:] for line in s.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stop_text_releases_the_same_text_however_it_is_split():
    text = "abcXYdefXYZghi"
    for stops in [("XYZ",), ("XYZ", "fX"), ("nothing",), ("i",)]:
        want = min((text.index(s) for s in stops if s in text), default=len(text))
        for size in (1, 2, 3, 5, 100):
            st = StopText(stops)
            out = "".join(st.feed(text[i : i + size]) for i in range(0, len(text), size)) + st.flush()
            assert out == text[:want], (stops, size)
            assert (st.stopped is not None) == (want < len(text))


def test_the_official_openai_client_gets_what_it_asks_for(running):
    oa = client(running)
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    plain = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0)
    assert plain.id.startswith("cmpl-") and plain.model == "tiny" and plain.usage.completion_tokens == 40
    text = plain.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) > 0 and text.index(stop) > 0

    # a stop string ends the text before it, plain and streamed alike, and counts the tokens that made it
    cut = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert 0 < cut.usage.completion_tokens < plain.usage.completion_tokens
    chunks = list(oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0, stop=stop,
                                        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == cut.usage.completion_tokens  # vLLM's last chunk

    # vLLM's extensions: ignore_eos runs to max_tokens, min_tokens; unknown fields are ignored, not refused
    full = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0,
                                 extra_body={"ignore_eos": True, "min_tokens": 30, "frobnicate": 1}, frequency_penalty=0.0)
    assert full.usage.completion_tokens == 30 and full.choices[0].finish_reason == "length"

    # chat: content parts, the developer role, ids as OpenAI gives them
    chat = oa.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}])
    same = oa.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert chat.id.startswith("chatcmpl-") and chat.choices[0].message.content == same.choices[0].message.content
    streamed = list(oa.chat.completions.create(model="tiny", max_tokens=12, temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               messages=[{"role": "user", "content": "Say hi"}]))
    assert streamed[-1].usage.completion_tokens == 12 and streamed[-1].choices == []


def test_refusals_that_stay_and_the_chat_template_deciding_roles(running):
    for body, words in [({"prompt": "hi", "logprobs": 21}, "logprobs"), ({"prompt": "hi", "n": 17}, "n must be"),
                        ({"prompt": "hi", "stop": [""]}, "stop"), ({"prompt": "hi", "stop": ["x"] * 17}, "stop"),
                        ({"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"), ({"prompt": "hi", "min_tokens": 99, "max_tokens": 4}, "min_tokens"),
                        ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "include_usage")]:
        r = running.post("/v1/completions", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}
    r = running.post("/v1/chat/completions", image)
    assert r.status_code == 400 and "text parts" in r.json()["error"]["message"]


def test_stop_strings_streamed_equal_the_plain_answer_for_many_prompts(running):
    """A stop string that spans two streamed deltas is held back, never half sent."""
    for prompt in PROMPTS[:6]:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        text = running.post("/v1/completions", body).json()["choices"][0]["text"]
        for stop in {text[3:5], text[-4:-1]} - {""}:
            plain = running.post("/v1/completions", {**body, "stop": stop}).json()
            streamed = stream_events(running, "/v1/completions", {**body, "stop": stop})
            assert plain["choices"][0]["text"] == text[: text.index(stop)]
            assert "".join(c["choices"][0]["text"] for c in streamed) == plain["choices"][0]["text"]
            assert streamed[-1]["choices"][0]["stop_reason"] == stop == plain["choices"][0]["stop_reason"]


@pytest.mark.real_model
@pytest.mark.slow
def test_a_client_that_goes_away_frees_its_row_at_the_next_round(stream_cfg, demo_target_dir, demo_drafter_dir, tmp_path):
    cfg = DviConfig(model=ModelConfig(target=str(demo_target_dir), drafter=str(demo_drafter_dir)), stream=stream_cfg,
                    serve=service_config(stream_cfg, (demo_target_dir, demo_drafter_dir), tmp_path / "store").serve,
                    tracking=TrackingConfig(enabled=False))
    r = Running(replica(cfg))
    results = []
    finish = r.service._finish
    r.service._finish = lambda job, result: (results.append(result), finish(job, result))  # what the replica answered
    try:
        body = {"prompt": "Write a long story about a dragon.", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with requests.post(r.url + "/v1/completions", data=json.dumps({**body, "stream": True}), stream=True, timeout=120) as s:
            next(line for line in s.iter_lines() if line.startswith(b"data: "))
        plain = http.client.HTTPConnection("127.0.0.1", r.port, timeout=1.0)
        plain.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        with pytest.raises(TimeoutError):  # the plain client gives up after a second, and hangs up
            plain.getresponse()
        plain.close()
        deadline = time.monotonic() + 30
        while len(results) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [x.finish_reason for x in results] == ["abort", "abort"], results
        assert all(len(x.token_ids) < 400 for x in results)
        assert not r.service._decoding  # both rows left the batch
        # the replica serves on
        after = r.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    finally:
        r.close()



def test_n_choices_are_n_seeded_requests_plain_and_streamed(running):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    many = running.post("/v1/completions", {**body, "n": 3}).json()
    assert [ch["index"] for ch in many["choices"]] == [0, 1, 2] and many["usage"]["completion_tokens"] == 36
    assert many["usage"]["prompt_tokens"] == running.post("/v1/completions", body).json()["usage"]["prompt_tokens"]
    for i in range(3):  # choice i is the request with seed 5 + i
        alone = running.post("/v1/completions", {**body, "seed": 5 + i}).json()
        assert many["choices"][i]["text"] == alone["choices"][0]["text"]
    assert len({ch["text"] for ch in many["choices"]}) > 1 and len(many["dvi"]["choices"]) == 3
    streamed = stream_events(running, "/v1/completions", {**body, "n": 3, "stream_options": {"include_usage": True}})
    for i in range(3):
        assert "".join(ch["text"] for e in streamed for ch in e["choices"] if ch["index"] == i) == many["choices"][i]["text"]
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 36
    chat = client(running).chat.completions.create(model="tiny", max_tokens=6, temperature=0, n=2,
                                                   messages=[{"role": "user", "content": "Say hi"}])
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_logprobs_as_the_openai_client_reads_them(running):
    oa = client(running)
    plain = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == plain.usage.completion_tokens == 10
    assert "".join(lp.tokens) == plain.choices[0].text and lp.text_offset[1] == len(lp.tokens[0])
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert all(abs(max(top.values()) - x) < 1e-5 for top, x in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the top one
    chat = oa.chat.completions.create(model="tiny", max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                      messages=[{"role": "user", "content": "Say hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.token == e.top_logprobs[0].token and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5 for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert oa.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].logprobs is None


def test_a_chunk_reports_the_tokens_decoded_since_the_last_and_none_past_a_stop(tiny_dirs):
    tokenizer = load_tokenizer(tiny_dirs[0])
    ids = tokenizer.encode("Hello world, the end is near and far")
    c = parse_completion(json.dumps({"prompt": "x", "stop": [" end"], "logprobs": 1}).encode(), False, model_name="m",
                         default_max_tokens=16, max_max_tokens=64, default_temperature=0.0, default_top_p=1.0)
    out = Output(tokenizer, c)
    lps = [(-float(i), [(t, -float(i))]) for i, t in enumerate(ids)]  # stand-ins: token i has log-prob -i
    reported: list[int] = []
    for start in range(0, len(ids), 3):  # rounds of 3 tokens, as accepted drafts plus one arrive
        out.feed(ids[start : start + 3], lps[start : start + 3])
        got, pairs = out.take_logprobs()
        assert [lp for lp, _ in pairs] == [-float(ids.index(t, len(reported) + j)) for j, t in enumerate(got)]
        reported += got
    assert out.stopped == " end" and reported == ids[: out.tokens] and out.tokens < len(ids)
    assert tokenizer.decode(reported).startswith("Hello world, the end") and out.take_logprobs() == ([], [])


def test_the_answer_shapes_are_openai_and_vllm_ones_without_a_server(tiny_dirs):
    tokenizer = load_tokenizer(tiny_dirs[0])
    ids = tokenizer.encode("Hello world, the end is near")[:3]
    assert len(ids) == 3
    result = SimpleNamespace(token_ids=ids, finish_reason="length",
                             rounds=[SimpleNamespace(logprobs=[(-0.5, [(ids[0], -0.5)])]), SimpleNamespace(logprobs=None),
                                     SimpleNamespace(logprobs=[(-1.0, [(ids[1], -1.0)]), (-2.0, [(ids[2], -2.0)])])])
    assert shapes.choice(0, "hi", False, delta=False, finish="length") == \
        {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    assert shapes.choice(1, None, True, delta=True) == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": None}
    assert shapes.choice(0, "x", True, delta=False, finish="stop", stop_reason="y")["message"] == {"role": "assistant", "content": "x"}
    assert shapes.finish_reason(result, " end") == "stop" and shapes.finish_reason(result, None) == "length"
    counted = [shapes.completion_tokens(result, None), shapes.completion_tokens(result, 2)]
    assert shapes.usage(4, counted) == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    lp = shapes.choice_logprobs(tokenizer, result, 2, chat=False)
    assert lp["token_logprobs"] == [-0.5, -1.0] and lp["text_offset"] == [0, len(lp["tokens"][0])]
    assert shapes.logprobs_object(tokenizer, ids[1:2], [(-1.0, [])], False, offset=7)["text_offset"] == [7]
    assert [e["logprob"] for e in shapes.choice_logprobs(tokenizer, result, 3, chat=True)["content"]] == [-0.5, -1.0, -2.0]
    assert shapes.extension([{"a": 1}]) == {"a": 1}
    assert shapes.extension([{"a": 1}, {"a": 2}]) == {"a": 1, "choices": [{"a": 1}, {"a": 2}]}
    assert shapes.sse(shapes.completion("cmpl-1", "text_completion", 0, "m", [])) == \
        'data: {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": []}\n\n'


def test_streamed_logprobs_are_the_unstreamed_ones_chunk_by_chunk(running):
    """Each chunk carries the logprobs of the tokens decoded since the previous one; joined, they are the unstreamed
    choice's, cut where a stop string cut the text."""
    oa = client(running)
    text = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0).choices[0].text
    assert len(text) > 8
    for stop in (None, [text[len(text) // 2: len(text) // 2 + 3]]):  # a stop string that may end inside a token
        args = dict(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0, logprobs=2, n=2, stop=stop)
        whole = oa.completions.create(**args)
        chunks = list(oa.completions.create(**args, stream=True))
        for choice in whole.choices:
            mine = [ch for chunk in chunks for ch in chunk.choices if ch.index == choice.index]
            parts = [ch.logprobs for ch in mine if ch.logprobs is not None]
            assert [t for p in parts for t in p.tokens] == choice.logprobs.tokens
            assert [x for p in parts for x in p.token_logprobs] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-6)
            assert [o for p in parts for o in p.text_offset] == choice.logprobs.text_offset
            tops = [t for p in parts for t in p.top_logprobs]
            assert [sorted(t) for t in tops] == [sorted(t) for t in choice.logprobs.top_logprobs]
            assert [sorted(t.values()) for t in tops] == [pytest.approx(sorted(t.values()), abs=1e-6) for t in choice.logprobs.top_logprobs]
        if stop:
            assert whole.choices[0].finish_reason == "stop" and len(whole.choices[0].logprobs.tokens) < 24
    chat_args = dict(model="tiny", max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                     messages=[{"role": "user", "content": "Say hi"}])
    whole = oa.chat.completions.create(**chat_args).choices[0].logprobs.content
    streamed = [e for chunk in oa.chat.completions.create(**chat_args, stream=True) for ch in chunk.choices
                if ch.logprobs is not None for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in whole]
    assert len(streamed) == 10
