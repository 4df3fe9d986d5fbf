"""The vLLM-style load client against a replica: every request completes, and the usage on the last chunk counts
exactly the fixed output length that `ignore_eos` asks for (the tiny pair: this is about the protocol)."""

from __future__ import annotations

from replica_fixtures import Running, replica, service_config

from benchmarks import load_client


def test_a_vllm_style_load_client_completes_every_request_with_exact_usage(stream_cfg, tiny_dirs, tmp_path):
    r = Running(replica(service_config(stream_cfg, tiny_dirs, tmp_path / "store")))
    try:
        summary = load_client.run(r.url, requests_n=12, concurrency=4, input_len=24, output_len=20, model="target")
    finally:
        r.close()
    assert summary["problems"] == [] and summary["completed"] == 12
    assert all(o["completion_tokens"] == 20 for o in summary["outcomes"])
    assert summary["output_token_throughput"] > 0 and summary["ttft_s"]["median"] is not None
    assert summary["chunks_per_request"] < 20  # speculative rounds stream several tokens per chunk
