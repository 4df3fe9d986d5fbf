"""`dvi generate` and `dvi serve`: decoding entry points.

`generate` decodes one prompt with the configured pair and prints it (optionally logging its DecisionRecords).
`serve` on serve.engine=vllm-server (auto, where vLLM is installed) becomes vLLM's own OpenAI server with dvi's loop
as its plugin; on dvi it builds a replica's channels (the decision producer, the control channel, the MLflow
tracker: `dvi.cli.replicas`, as the plugin does) from the config, hands them to `dvi.serving.replica.Replica`, and runs
dvi's HTTP API until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import replace

import uvicorn

from dvi.cli import args as checked
from dvi.cli.vllm import server as vllm_server
from dvi.cli.output import out
from dvi.cli.replicas import replica_channels
from dvi.config import DviConfig, load_config, overrides_of
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.hardware import bound_cores, pick_dtype, pick_engine, pinned_engines, resolve_device, shared_cores
from dvi.models import encode_prompt, end_ids
from dvi.pairs import check_pair_dirs, pair_dirs, resolve_pair
from dvi.procs import default_replica_id, free_port
from dvi.records import records_from_result
from dvi.serving.api import create_app, draining_server
from dvi.serving.replica import Replica
from dvi.waiting import waiting_for
from streams.client import quiet_kafka_logs
from streams.producer import DecisionProducer


def generate(args: argparse.Namespace) -> int:
    g = checked.generate(args)
    cfg, temperature, top_p, max_new, seed = g.cfg, g.temperature, g.top_p, g.max_new_tokens, g.seed
    producer = None
    if args.log:  # connects while the models load
        quiet_kafka_logs(args.verbose)
        producer = DecisionProducer(cfg.stream)

    pair = resolve_pair(cfg.model, with_drafter=not args.no_draft)  # dvi generate decodes with dvi's engine (serve.engine: dvi serve)
    engine = SpeculativeEngine(
        pair.target, pair.drafter, cfg.serve.spec, stop_ids=end_ids(pair.target, pair.tokenizer), max_batch=cfg.serve.max_batch
    )
    if pair.drafter is not None and cfg.serve.spec.adaptive and cfg.serve.spec.cost_ratio is None and cfg.serve.spec.warmup_reps:
        engine.warm_up(cfg.serve.spec.warmup_reps)  # the cost table adaptive K plans with
    ids = encode_prompt(pair.tokenizer, args.prompt, args.raw)
    req = Request(ids, max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=seed)
    t0 = time.perf_counter()
    result = engine.generate([req])[0]
    seconds = time.perf_counter() - t0
    text = pair.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stream = _log_result(cfg, producer, result, req, pair.target_dir.name, engine.vocab_size) if producer else None
    if args.json:
        drafter_version = pair.drafter.version if pair.drafter is not None else None
        out(
            json.dumps(
                {
                    "request_id": result.request_id,
                    "text": text,
                    "token_ids": result.token_ids,
                    "prompt_tokens": len(ids),
                    "finish_reason": result.finish_reason,
                    "drafter_version": drafter_version,
                    "drafter_versions": result.drafter_versions,
                    "device": str(engine.device),
                    "dtype": str(pair.target.dtype).removeprefix("torch."),
                    "sampling": {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new, "seed": seed},
                    "stats": result.stats.to_dict(),
                    "seconds": round(seconds, 4),
                    "tokens_per_second": round(len(result.token_ids) / seconds, 3) if seconds > 0 else None,
                    **({"stream": stream} if stream is not None else {}),
                }
            )
        )
    else:
        out(text)
        st = result.stats
        print(
            f"[{len(result.token_ids)} tokens in {seconds:.2f} s, {len(result.token_ids) / seconds:.1f} tok/s; "
            f"acceptance {st.acceptance_rate:.2f}, mean accepted length {st.mean_accepted_length:.2f}, "
            f"drafter {pair.drafter.version if pair.drafter else 'none'}]",
            file=sys.stderr,
        )
        if stream is not None:
            print(f"[stream {cfg.stream.topic} at {cfg.stream.bootstrap}: {stream['sent']} sent, {stream['dropped']} dropped]", file=sys.stderr)
    return 0


def _log_result(cfg, producer: DecisionProducer, result, req: Request, target_name: str, vocab_size: int) -> dict:
    """Send the request's DecisionRecords and wait (bounded) until they are acknowledged or dropped."""
    s = cfg.stream
    records = records_from_result(
        result, replica_id=s.replica_id or default_replica_id(), target_name=target_name, vocab_size=vocab_size,
        sampling=req, **s.record_args,
    )
    for record in records:
        producer.submit(record)
    stats = producer.close(timeout_s=5.0)
    return {"sent": stats.sent, "dropped": stats.dropped}


def serve(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    replica_id = cfg.stream.replica_id or default_replica_id(cfg.serve.port)
    cfg = replace(cfg, stream=replace(cfg.stream, replica_id=replica_id))  # one name for records, control and MLflow
    engine = pick_engine(cfg.serve.engine)
    if engine.value == "vllm-server":
        return serve_vllm_server(cfg, args)
    quiet_kafka_logs(args.verbose)
    channels = replica_channels(cfg)
    # no reference to the pair here: once a newer drafter is swapped in, the configured one can be freed
    dtype = pick_dtype(cfg.model.dtype, resolve_device(cfg.model.device).type)
    out(f"dvi serve: engine {engine}, dtype {dtype}", flush=True)
    with waiting_for(f"the model pair to load (target {cfg.model.target}, engine {engine.value})"):
        replica = Replica(cfg, resolve_pair(cfg.model, with_drafter=not args.no_draft), **channels)
    replica.start()
    server = draining_server(uvicorn.Config(create_app(replica), host=cfg.serve.host, port=cfg.serve.port, log_level="warning",
                                            timeout_graceful_shutdown=5, access_log=False,
                                            limit_concurrency=cfg.serve.max_connections), replica, cfg.serve.drain_s)
    out(f"dvi serve: http://{cfg.serve.host}:{cfg.serve.port}/v1 (model {replica.model_name}, drafter "
          f"{replica.metrics.version}, replica {replica.replica_id}{', API key required' if replica.api_key else ''}); "
          "Ctrl-C stops it", flush=True)
    # uvicorn handles SIGINT / SIGTERM (it returns once in-flight requests finish), then raises the signal again
    # for the handler it found: a no-op here, so that being stopped is a clean exit (status 0)
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        replica.close()
    out("dvi serve: stopped", flush=True)
    return 0 if server.started else 1


def serve_vllm_server(cfg: DviConfig, args: argparse.Namespace) -> int:
    """serve.engine=vllm-server (auto, where vLLM is installed): this process becomes vLLM's own OpenAI server on the
    configured pair (`dvi.cli.vllm.server`), dvi's loop in it as its plugin (`dvi.cli.vllm.plugin`): its signals, exit
    status and processes are vLLM's (a supervisor that stops or kills this process stops the server)."""
    pinned = bound_cores(cfg.serve.vllm.cpu_bind)  # a replica with cores of its own runs on them alone (dvi.cli.args.serve)
    target_dir, drafter_dir = pair_dirs(cfg.model, with_drafter=not args.no_draft)
    check_pair_dirs(target_dir, drafter_dir)  # bad paths stop here, not inside vLLM's argument checks
    dtype = pick_dtype(cfg.model.dtype, resolve_device(cfg.model.device).type)
    loop_port = free_port()
    overrides = [*overrides_of(args), f"stream.replica_id={cfg.stream.replica_id}"]
    env = vllm_server.environment(cfg, os.environ.copy(), overrides=overrides, loop_port=loop_port)
    cmd = vllm_server.command(cfg, target_dir, drafter_dir, dtype.value)
    url = f"http://{cfg.serve.host}:{cfg.serve.port}"
    out(f"dvi serve: engine {pick_engine(cfg.serve.engine)}, dtype {dtype}", flush=True)
    usable = getattr(args, "usable_cores", None) or bound_cores("auto")  # this process's cores before dvi.cli.args.serve
    clash = shared_cores(cfg.serve.vllm.cpu_bind, pinned, pinned_engines(), usable)
    if clash:
        out(f"dvi serve: warning: {clash}", flush=True)
    out(f"dvi serve: {url}/v1 once vLLM's server is up (model {cfg.serve.served_model_name or target_dir.name}, drafter "
        f"{drafter_dir.name if drafter_dir else None}, replica {cfg.stream.replica_id}; the loop's view at {url}/dvi/health); "
        "Ctrl-C stops it", flush=True)
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
    return 1  # not reached
