"""The `dvi` command: parses arguments, builds typed config, calls the library, prints.

Subcommands register themselves through `register(subparsers)` functions (this module's and those of
other packages, imported lazily so `dvi --help` stays fast). Trailing `key=value` words are Hydra
overrides of conf/. A `DviError` prints as one line `dvi: error: ...` with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from dvi.errors import DviError

log = logging.getLogger("dvi")

# other packages' subcommands: module paths with a `register(subparsers)` function
EXTENSIONS: list[str] = ["streams.cli", "trainers.cli", "dvi.stack", "dvi.drift"]


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides given on the command line; anything else left over is an error."""
    extra = list(getattr(args, "overrides", []) or [])
    bad = [w for w in extra if "=" not in w or w.startswith("-")]
    if bad:
        raise DviError(f"unrecognized arguments: {' '.join(bad)} (config overrides look like key=value)")
    return extra


# ----------------------------------------------------------------------------------------------
# dvi models fetch / dvi drafter init


def cmd_models_fetch(args: argparse.Namespace) -> int:
    from dvi.config import load_config
    from dvi.models import cache_dir, fetch_demo_target

    cfg = load_config(overrides_of(args))
    print(fetch_demo_target(cache_dir(cfg.model)))
    return 0


def cmd_drafter_init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dvi.config import load_config
    from dvi.models import build_drafter, cache_dir, demo_drafter_dir, fetch_demo_target

    cfg = load_config(overrides_of(args)).model
    cache = cache_dir(cfg)
    target_dir = Path(cfg.target).expanduser() if cfg.target else fetch_demo_target(cache)
    layers = args.layers if args.layers is not None else cfg.drafter_layers
    vocab = args.vocab if args.vocab is not None else cfg.drafter_vocab
    if args.vocab == 0:
        vocab = None
    out = Path(args.out) if args.out else demo_drafter_dir(cache, layers, vocab)
    print(build_drafter(target_dir, out, layers=layers, vocab=vocab))
    return 0


# ----------------------------------------------------------------------------------------------
# dvi generate


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Token ids of a prompt: through the chat template unless `raw` (or the tokenizer has none)."""
    if not prompt.strip():
        raise DviError("empty prompt: give some text to continue")
    if raw or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def cmd_generate(args: argparse.Namespace) -> int:
    from dvi.config import check_sampling, load_config
    from dvi.engine import Request, SpeculativeEngine
    from dvi.models import resolve_pair

    cfg = load_config(overrides_of(args))
    s = cfg.serve.sampling
    temperature = 0.0 if args.greedy else (args.temperature if args.temperature is not None else s.temperature)
    top_p = args.top_p if args.top_p is not None else s.top_p
    max_new = args.max_new_tokens if args.max_new_tokens is not None else s.max_new_tokens
    seed = args.seed if args.seed is not None else s.seed
    check_sampling(temperature, top_p, max_new)
    if not args.prompt.strip():
        raise DviError("empty prompt: give some text to continue")
    producer = _stream_producer(cfg, args) if args.log else None  # connects while the models load

    pair = resolve_pair(cfg.model, with_drafter=not args.no_draft)
    engine = SpeculativeEngine(
        pair.target, pair.drafter, cfg.serve.spec, stop_ids={pair.tokenizer.eos_token_id}, max_batch=cfg.serve.max_batch
    )
    ids = encode_prompt(pair.tokenizer, args.prompt, args.raw)
    req = Request(ids, max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=seed)
    t0 = time.perf_counter()
    result = engine.generate([req])[0]
    seconds = time.perf_counter() - t0
    text = pair.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stream = _log_result(cfg, producer, result, req, pair.target_dir.name, engine.vocab_size) if producer else None
    if args.json:
        drafter_version = pair.drafter.version if pair.drafter is not None else None
        print(
            json.dumps(
                {
                    "request_id": result.request_id,
                    "text": text,
                    "token_ids": result.token_ids,
                    "prompt_tokens": len(ids),
                    "finish_reason": result.finish_reason,
                    "drafter_version": drafter_version,
                    "drafter_versions": result.drafter_versions,
                    "sampling": {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new, "seed": seed},
                    "stats": result.stats.to_dict(),
                    "seconds": round(seconds, 4),
                    "tokens_per_second": round(len(result.token_ids) / seconds, 3) if seconds > 0 else None,
                    **({"stream": stream} if stream is not None else {}),
                }
            )
        )
    else:
        print(text)
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


def _stream_producer(cfg, args: argparse.Namespace):
    from streams.client import quiet_kafka_logs
    from streams.producer import DecisionProducer

    if cfg.stream.topk > cfg.serve.spec.topk_logprobs:
        raise DviError(
            f"stream.topk={cfg.stream.topk} needs serve.spec.topk_logprobs >= {cfg.stream.topk} "
            f"(it is {cfg.serve.spec.topk_logprobs}): raise it or lower stream.topk"
        )
    quiet_kafka_logs(args.verbose)
    return DecisionProducer(cfg.stream)


def _log_result(cfg, producer, result, req, target_name: str, vocab_size: int) -> dict:
    """Send the request's DecisionRecords and wait (bounded) until they are acknowledged or dropped."""
    from dvi.events import records_from_result
    from streams.producer import default_replica_id

    s = cfg.stream
    records = records_from_result(
        result, replica_id=s.replica_id or default_replica_id(), target_name=target_name, vocab_size=vocab_size,
        sampling=req, chunk_rounds=s.chunk_rounds, topk=s.topk,
    )
    for record in records:
        producer.submit(record)
    stats = producer.close(timeout_s=5.0)
    return {"sent": stats.sent, "dropped": stats.dropped}


# ----------------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt with the configured pair")
    p.add_argument("prompt", help="the prompt text (chat-templated unless --raw)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is, no chat template")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--greedy", action="store_true", help="greedy decoding (temperature 0)")
    g.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, dest="top_p", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--max-new-tokens", type=int, dest="max_new_tokens")
    p.add_argument("--seed", type=int, help="seed of the request's random draws")
    p.add_argument("--no-draft", action="store_true", help="target-only decoding, no drafter")
    p.add_argument("--log", action="store_true", help="send the request's DecisionRecords to the decision stream (stream.*)")
    p.set_defaults(func=cmd_generate)

    def cmd_serve(args: argparse.Namespace) -> int:
        from dvi.server import cmd_serve

        return cmd_serve(args)

    p = sub.add_parser("serve", help="the HTTP server: OpenAI-compatible completions, hot-swapped drafters")
    p.add_argument("--no-draft", action="store_true", help="target-only decoding (no drafter until one is published)")
    p.set_defaults(func=cmd_serve)

    def cmd_status(args: argparse.Namespace) -> int:
        from dvi.status import cmd_status

        return cmd_status(args)

    p = sub.add_parser("status", help="serving drafter and live acceptance per replica, trainer lag, last publish")
    p.add_argument("--replica", action="append", help="a replica's base URL (repeatable; default serve.host:serve.port)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)

    m = sub.add_parser("models", help="model cache")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    f = msub.add_parser("fetch", help="fetch and convert the demo target into the model cache")
    f.set_defaults(func=cmd_models_fetch)

    d = sub.add_parser("drafter", help="drafter checkpoints")
    dsub = d.add_subparsers(dest="drafter_cmd", required=True)
    i = dsub.add_parser("init", help="build a drafter from the target's first layers")
    i.add_argument("--layers", type=int, help="target layers to keep (default model.drafter_layers)")
    i.add_argument("--vocab", type=int, help="reduced head over the N most frequent tokens (0 = full vocabulary)")
    i.add_argument("--out", help="output directory (default: the demo drafter's place in the cache)")
    i.set_defaults(func=cmd_drafter_init)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="dvi", description="Draft, Verify, Improve: online drafter adaptation")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    for path in EXTENSIONS:
        importlib.import_module(path).register(sub)
    for p in sub.choices.values():
        _accept_overrides(p)
    return parser


def _accept_overrides(p: argparse.ArgumentParser) -> None:
    if p._subparsers is not None:  # a command group: its leaves take the overrides
        for action in p._subparsers._group_actions:
            for leaf in action.choices.values():
                _accept_overrides(leaf)
        return
    p.add_argument("overrides", nargs="*", help="Hydra config overrides, key=value")


def main(argv: list[str] | None = None) -> int:
    from dvi.alloc import limit_arenas

    limit_arenas()  # before any thread starts (see dvi.alloc)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.overrides = list(getattr(args, "overrides", []) or []) + unknown
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    _quiet_libraries()
    try:
        return int(args.func(args) or 0)
    except DviError as e:
        print(f"dvi: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
