"""dvi's loop inside an unmodified `vllm serve` (dvi.cli.vllm.plugin): vLLM's own OpenAI server, started as a vLLM
user starts it (`vllm serve`, as `python -m dvi.cli.vllm serve` on the CPU build, eager) with `DVI_LOOP=1` in its
environment, the real demo target, the real broker and model store, the official `openai` client.

Its clients see vLLM's API unchanged (chat, completions, streaming, `response_format`); every request leaves
DecisionRecords that validate and reproduce the answer, whose accept counts add up to vLLM's own counters; a signed
announcement swaps a better drafter in and acceptance follows it, a forged one is refused; a killed broker costs no
request. The drafters are noisy copies of the target (vLLM's draft model takes drafters of its configured shape only).
"""

from __future__ import annotations

import json
import socket
import sys
import time

import openai
import pytest
import requests
import torch
from kafka import KafkaProducer
from broker_fixtures import stream_config
from child_env import clean_env
from replica_fixtures import publish_noisy, scrape

from dvi import keys
from dvi.cli.vllm.plugin import ENABLE, NAME, OVERRIDES, PORT
from dvi.config import keys_dir
from dvi.control import DrafterPublished
from dvi.control import encode as encode_control
from dvi.models import fetch_demo_target, load_causal_lm, load_tokenizer
from dvi.procs import free_port, http_ok, spawn, wait_ready
from dvi.records import validate
from streams.broker import EmbeddedBroker
from streams.consumer import DecisionConsumer
from streams.control import send as control_send
from streams.topics import ensure_topics
from trainers.data import example_from_record

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.real_model]

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time,"]


class Server:
    """`vllm serve` with the plugin enabled, its broker (killable) and its topics."""

    def __init__(self, tmp_path):
        self.broker = EmbeddedBroker(free_port()).start()
        self.stream = stream_config(self.broker.bootstrap)
        ensure_topics(self.stream)
        self.target = fetch_demo_target()
        self.store = tmp_path / "store"
        start = publish_noisy(tmp_path / "configured", self.target, "d0000", noise=0.3, seed=0)
        self.port, self.loop_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        overrides = [f"stream.bootstrap_servers={self.stream.bootstrap}", f"stream.topic={self.stream.topic}",
                     f"stream.dlq_topic={self.stream.dlq_topic}", f"stream.control_topic={self.stream.control_topic}",
                     "stream.replica_id=plugin-test", "tracking.enabled=false", f"serve.swap.store={self.store}",
                     "serve.swap.initial=none", "serve.swap.window_tokens=96", "serve.swap.baseline_tokens=48",
                     "serve.spec.adaptive=false", "serve.spec.k=3"]
        env = clean_env(**{ENABLE: "1", OVERRIDES: json.dumps(overrides), PORT: str(self.loop_port), "VLLM_PLUGINS": NAME,
                           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
        cmd = [sys.executable, "-m", "dvi.cli.vllm", "serve", str(self.target), "--dtype", "float32",
               "--port", str(self.port), "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
               "--no-enable-prefix-caching", "--speculative-config",
               json.dumps({"method": "draft_model", "model": str(start.path), "num_speculative_tokens": 3})]
        # outside the checkout: a stale dvi.egg-info there would hide the installed entry points
        self.child = spawn("vllm", cmd, log_path=tmp_path / "vllm.log", env=env, cwd=tmp_path)
        wait_ready(self.child, lambda: http_ok(self.url + "/health"), 600, "vllm serve with dvi's plugin", interval_s=0.5)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none")

    def health(self) -> dict:
        return requests.get(self.url + "/dvi/health", timeout=10).json()

    def close(self) -> None:
        self.child.stop(grace_s=30)
        self.broker.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("vllm-plugin"))
    yield s
    s.close()


def spec_counters(url: str) -> tuple[float, float]:
    """vLLM's own (drafted, accepted) counters from its /metrics."""
    m = scrape(url)
    total = lambda name: sum(v for k, v in m.items() if k[0] == name)  # noqa: E731
    return total("vllm:spec_decode_num_draft_tokens_total"), total("vllm:spec_decode_num_accepted_tokens_total")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def test_clients_see_vllms_api_and_every_request_leaves_records_that_reproduce_it(server):
    c, model = server.client, str(server.target)
    drafted0, accepted0 = spec_counters(server.url)
    answers, domains = {}, {}  # vLLM's response id -> the token ids it answered, the domain it was tagged with
    for i, prompt in enumerate(PROMPTS):
        domain = "code" if i % 2 == 0 else "prose"
        r = c.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                 extra_body={"return_token_ids": True, "vllm_xargs": {"dvi_domain": domain}})
        assert r.choices[0].text and r.usage.completion_tokens == len(r.choices[0].token_ids)
        answers[r.id], domains[r.id] = list(r.choices[0].token_ids), domain
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name three primary colors."}], max_tokens=24,
                                     temperature=0, extra_body={"return_token_ids": True})
    assert chat.choices[0].message.content
    answers[chat.id] = list(chat.choices[0].token_ids)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three primary colors."}], max_tokens=24, temperature=0, stream=True)
        if ch.choices)
    assert streamed == chat.choices[0].message.content  # streamed as answered
    # dvi's API's request and answer fields on vLLM's server (dvi.cli.vllm.middleware): the domain tag as a header or the dvi
    # object, the answer's dvi field with the counts its records carry, a malformed tag refused
    tagged = requests.post(server.url + "/v1/chat/completions", headers={"X-DVI-Domain": "qa"}, timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "What is a prime number?"}], "max_tokens": 24, "temperature": 0,
        "return_token_ids": True}).json()
    answers[tagged["id"]], domains[tagged["id"]] = tagged["choices"][0]["token_ids"], "qa"
    both = requests.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.8, "seed": 1, "n": 2,
        "dvi": {"domain": "math"}}).json()
    refused = requests.post(server.url + "/v1/completions", headers={"X-DVI-Domain": "no spaces"}, timeout=30,
                            json={"model": model, "prompt": PROMPTS[0], "max_tokens": 4})
    assert refused.status_code == 400 and "domain tag" in refused.json()["error"]["message"], refused.text
    ext = tagged["dvi"]
    assert ext["request_id"].startswith(tagged["id"]) and ext["drafter_versions"] == ["d0000"] and ext["replica_id"] == "plugin-test"
    assert ext["stats"]["drafted"] > 0 and ext["stats"]["rounds"] > 0
    assert [f["request_id"][:2] for f in both["dvi"]["choices"]] == ["0_", "1_"]  # n = 2: a field for each choice, in order
    structured = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give a JSON object with a key a."}],
                                           max_tokens=32, temperature=0, response_format={"type": "json_object"})
    assert structured.choices[0].message.content.strip().startswith("{")  # vLLM's structured output, which dvi's API ignores

    # the loop's view, relayed on vLLM's port, and its counters in vLLM's own /metrics
    h = wait_for(lambda: (h := server.health())["records"]["sent"] >= len(answers) + 4 and h, 30, "the records to be sent")
    assert h["replica_id"] == "plugin-test" and h["drafter_version"] == "d0000" and h["engine"] == "vllm"
    metrics = scrape(server.url)
    assert metrics[("dvi_records_sent_total", ("model_name", server.target.name))] == h["records"]["sent"]
    drafted1, accepted1 = spec_counters(server.url)

    with DecisionConsumer(server.stream, group_id=None) as consumer:
        got = consumer.poll_until(h["records"]["sent"], timeout_s=30)
    assert consumer.stats.invalid == 0 and len(got) == h["records"]["sent"]
    records = [d.record for d in got]
    for rec in records:
        validate(rec, 49152)
        assert rec.replica_id == "plugin-test" and rec.target.name == server.target.name and rec.topk == 8
    for response_id, tokens in answers.items():
        mine = sorted((r for r in records if r.request_id.startswith(response_id)), key=lambda r: r.chunk_index)
        assert mine, f"no record of {response_id}"
        assert mine[-1].prefix_ids + mine[-1].generated_ids == tokens  # the records reproduce the answer
        assert {r.domain for r in mine} == {domains.get(response_id)}  # the domain from vllm_xargs, none without it
        if response_id == tagged["id"]:  # the answer's dvi field says what its records carry
            assert ext["stats"]["accepted"] == sum(x.accepted for r in mine for x in r.rounds)
            assert ext["stats"]["drafted"] == sum(x.k for r in mine for x in r.rounds)
        for rec in mine:
            for x in rec.rounds:  # greedy: the target's top choice is each accepted draft, then its own token
                assert x.topk_ids[: x.accepted, 0].tolist() == x.drafted[: x.accepted] and int(x.topk_ids[x.accepted, 0]) == x.token
    twins = {r.request_id: r.domain for r in records if both["id"] in r.request_id}  # n = 2: two requests, one tag
    assert len(twins) == 2 and set(twins.values()) == {"math"}, twins
    # greedy answers are the target's own, whatever the drafter drafted (four prompts, up to 24 tokens each)
    tokenizer, target = load_tokenizer(server.target), load_causal_lm(server.target, "target")
    for text, response_id in zip(PROMPTS, answers):  # the first answers are the completions of PROMPTS, in order
        prompt = tokenizer(text).input_ids
        with torch.no_grad():
            own = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        got = answers[response_id]
        assert got == own[: len(got)] and len(got) >= len(own) - 1, (text, got, own)  # an end token ends both
    for rec in records:  # the trainer takes them as it takes dvi's engine's
        ex = example_from_record(rec, max_seq_len=512)
        assert ex.positions == len(rec.generated_ids) and ex.topk_ids is not None
        assert (ex.accepted, ex.drafted_total) == (sum(x.accepted for x in rec.rounds), sum(x.k for x in rec.rounds))
    # every drafted and accepted token vLLM counted is in the records, and no other
    assert sum(x.k for r in records for x in r.rounds) == drafted1 - drafted0 > 0
    assert sum(x.accepted for r in records for x in r.rounds) == accepted1 - accepted0


def test_a_signed_better_drafter_is_swapped_in_a_worse_one_rolled_back_forged_and_stale_ones_refused_and_a_dead_broker_costs_no_request(
        server, tmp_path):
    c, model = server.client, str(server.target)

    def acceptance_of(version: str, drafted: int) -> float:
        """Decode until `version` has drafted `drafted` more tokens; its acceptance (the loop's count) over them."""
        before = server.health()["by_version"].get(version, {"drafted": 0, "accepted": 0})
        while (now := server.health()["by_version"].get(version, {"drafted": 0, "accepted": 0}))["drafted"] - before["drafted"] < drafted:
            for p in PROMPTS:
                c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
        return (now["accepted"] - before["accepted"]) / (now["drafted"] - before["drafted"])

    before = acceptance_of("d0000", 96)
    good = publish_noisy(server.store, server.target, "d0001", noise=0.02, seed=1)
    forged = publish_noisy(server.store, server.target, "d0002", noise=10.0, seed=2)
    local = keys.load(keys_dir(server.stream), sign_as=("trainer", "replica"))
    # a message anyone on the broker can write, unsigned or signed with a replica's key as if it were the trainer's
    for key in (None, keys.Keys(signing={"trainer": local.signing["replica"]})):
        raw = KafkaProducer(bootstrap_servers=server.stream.bootstrap)
        raw.send(server.stream.control_topic, encode_control(DrafterPublished(forged.version, str(forged.path), forged.sha256), key)).get(10)
        raw.close()
    wait_for(lambda: server.health()["control_refused"] == 2, 60, "the forged announcements to be refused")
    assert server.health()["drafter_version"] == "d0000"

    control_send(server.stream, DrafterPublished(good.version, str(good.path), good.sha256, parent="d0000"))  # the trainer's key
    wait_for(lambda: server.health()["drafter_version"] == "d0001", 120, "d0001 to be swapped in")
    after = acceptance_of("d0001", 96)
    assert after > before + 0.2, (before, after)
    wait_for(lambda: server.health()["rollout"] is None, 60, "d0001 to be judged")
    h = server.health()
    assert h["drafter_version"] == "d0001" and h["events"].get("promote") == 1 and "d0002" not in h["rejected"]

    # a worse drafter, signed: swapped in, judged on live traffic, rolled back to the one before; answers stay greedy
    bad = publish_noisy(server.store, server.target, "d0003", noise=10.0, seed=3)
    control_send(server.stream, DrafterPublished(bad.version, str(bad.path), bad.sha256, parent="d0001"))
    wait_for(lambda: server.health()["drafter_version"] == "d0003", 120, "d0003 to be swapped in")
    reference = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"return_token_ids": True})

    def judged():
        for p in PROMPTS:
            c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
        return (h := server.health())["rollout"] is None and h

    h = wait_for(judged, 300, "d0003 to be judged")
    assert h["drafter_version"] == "d0001" and "d0003" in h["rejected"] and h["events"].get("rollback") == 1, h["events"]
    again = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"return_token_ids": True})
    assert again.choices[0].token_ids == reference.choices[0].token_ids
    # a signed announcement of a version older than one served (a replay) is refused: a rollback is the replica's own
    control_send(server.stream, DrafterPublished(forged.version, str(forged.path), forged.sha256))
    wait_for(lambda: server.health()["events"].get("refused:stale") == 1, 60, "the replayed announcement to be refused")
    assert server.health()["drafter_version"] == "d0001"

    # the broker dies: requests are answered as before, their records wait or are dropped and counted
    server.broker.kill()
    t0 = time.monotonic()
    for p in PROMPTS:
        assert c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text
    assert time.monotonic() - t0 < 60
    server.broker.start()
    ensure_topics(server.stream)
    late = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    with DecisionConsumer(server.stream, group_id=None) as consumer:
        wait_for(lambda: any(d.record.request_id.startswith(late.id) for d in consumer.poll(1.0)), 120,
                 "a record of a request made after the broker came back")
    rec = server.health()["records"]
    assert rec["sent"] + rec["dropped"] + rec["pending"] == rec["submitted"], rec


def test_a_loop_that_cannot_start_stops_vllms_server_with_the_reason(tmp_path):
    """The port of the loop's view is held by another process: the loop cannot start in the engine core, and vLLM's
    server exits with that reason in its log, where it would otherwise wait for ever on its dead engine, neither
    listening nor exiting."""
    target = fetch_demo_target()
    port, loop_port = free_port(), free_port()
    overrides = ["stream.replica_id=plugin-port-test", "tracking.enabled=false", "serve.log_decisions=false"]
    env = clean_env(**{ENABLE: "1", OVERRIDES: json.dumps(overrides), PORT: str(loop_port), "VLLM_PLUGINS": NAME,
                       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    cmd = [sys.executable, "-m", "dvi.cli.vllm", "serve", str(target), "--dtype", "float32",
           "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager", "--no-enable-prefix-caching"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", loop_port))
        holder.listen()
        child = spawn("vllm", cmd, log_path=tmp_path / "vllm.log", env=env, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 600
            while child.running and time.monotonic() < deadline:
                assert http_ok(f"http://127.0.0.1:{port}/health") is not None, "vLLM's server answered without dvi's loop"
                time.sleep(1)
            assert not child.running, f"vLLM's server still runs 600 s after its loop failed: {child.log_tail()}"
        finally:
            child.stop(grace_s=10)
    log = child.log_since_start()
    assert f"dvi's loop could not start: dvi's loop cannot serve its view on 127.0.0.1:{loop_port} ({PORT})" in log, log[-3000:]
