"""How `dvi up` should share a small machine between serving and its trainer: request latency and the trainer's
positions a second under each way of sharing, under continuous load and under load with pauses.

Each policy runs `dvi up` on its defaults but for the policy's overrides (`benchmarks.first_publish.session`: fresh
ports and cache, the trainer logging every step), and one client sends chat requests that never repeat (the same
sequence under every policy), back to back for `--minutes` (continuous), then for `--minutes` waiting as long as each
answer took before the next (paced: the trainer has the gaps). Then plain vLLM at its best settings (the project's
peer) answers every prompt any policy sent, one after another; each request's latency is divided by plain vLLM's on the
same prompt, and the medians are reported per policy and phase, beside the trainer's positions a second and the share
of the time serving waited for the trainer's turns (`turns`: the replica's `trainer_turns`). Policies
(`--only`, separated by commas):

- `normal`: the trainer on every core at normal priority (`trainer.cpu_priority=normal`);
- `nice`: every core, nice 19 (`trainer.cpu_priority=nice`);
- `idle`: every core, Linux's SCHED_IDLE (`trainer.cpu_priority=idle`): only CPU time no other process wants;
- `pause`: every core, stopped while the server has a request in flight (`trainer.cpu_priority=pause trainer.pause_share=0`);
- `duty`: `pause`, but running `--duty-share` (0.1, the default) of the time however busy the server is, alone: the
  server waits between two steps meanwhile (`trainer.pause_share`, `dvi.busy` turns);
- `own core`: the trainer on the last core, the replica's engine on the others (`trainer.cpu_bind`,
  `serve.vllm.cpu_bind`), normal priority;
- `no trainer`: `dvi up --no-train` (what serving alone gives: the floor every policy's latency is held to).

    python -m benchmarks.sharing [--minutes 2.5] [--only idle,normal] [--duty-share 0.1] [--json PATH] [key=value overrides]

It measures; it asserts nothing. A run takes about (1.5 + 2 x minutes) minutes a policy, and the peer's answers after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.bench_vllm import write_json
from benchmarks.first_publish import Phase, peer_answers, prompts_of, report, session
from dvi.config import TrainerConfig
from dvi.hardware import bound_cores, core_list


def policies(cores: frozenset[int], duty_share: float = TrainerConfig.pause_share) -> dict[str, tuple[list[str], list[str]]]:
    """Policy name: (dvi up's flags, its overrides)."""
    last = max(cores)
    own = ([], [f"trainer.cpu_bind={last}", f"serve.vllm.cpu_bind={core_list(cores - {last})}", "trainer.cpu_priority=normal"])
    return {"normal": ([], ["trainer.cpu_priority=normal"]), "nice": ([], ["trainer.cpu_priority=nice"]),
            "idle": ([], ["trainer.cpu_priority=idle"]), "pause": ([], ["trainer.cpu_priority=pause", "trainer.pause_share=0"]),
            "duty": ([], ["trainer.cpu_priority=pause", f"trainer.pause_share={duty_share}"]),
            "own core": own, "no trainer": (["--no-train"], [])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=2.5, help="minutes of each phase (continuous, then paced)")
    p.add_argument("--only", help="policies to run, separated by commas")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--duty-share", type=float, default=TrainerConfig.pause_share, help="the duty policy's trainer.pause_share")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cores = bound_cores("auto")
    if len(cores) < 2:
        raise SystemExit("benchmarks.sharing: needs at least 2 cores (the own-core policy gives the trainer one)")
    todo = policies(cores, args.duty_share)
    if args.only:
        unknown = set(args.only.split(",")) - set(todo)
        if unknown:
            raise SystemExit(f"--only: unknown policies {sorted(unknown)}; expected some of {sorted(todo)}")
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    phases = [Phase("continuous", args.minutes), Phase("paced", args.minutes, paced=True)]
    runs = {}
    for name, (flags, overrides) in todo.items():
        print(f"sharing: {name}: dvi up {' '.join(flags + overrides)}", file=sys.stderr, flush=True)
        runs[name] = session([*overrides, *args.overrides], phases, args.max_tokens, 400, flags=flags, echo=False)
        if args.json:  # what was measured so far, should a later policy or the peer fail
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.with_suffix(".partial.json").write_text(json.dumps(runs, default=str) + "\n")
    sent = max(len(r["rows"]) for r in runs.values())
    peer_name, peer = peer_answers(args.overrides, prompts_of(sent), args.max_tokens, next(iter(runs.values()))["vllm_server"])
    rows, result = [], {}
    for name, run in runs.items():
        r = report(run, peer, peer_name)
        result[name] = r
        for phase, s in r["by_phase"].items():
            t = r["trainer"].get(phase, {})
            rows.append({"policy": name, "phase": phase, "requests": s["requests"], "latency_s": s["latency_s"],
                         "latency_vs_vllm": s["latency_vs_peer"], "acceptance": s["acceptance"],
                         "trainer_positions_per_s": t.get("positions_per_s"),
                         "serving_waited_share": (t.get("serving_waited") or {}).get("share")})
    print(f"{'policy':<11} {'phase':<11} {'requests':>8} {'latency s':>9} {'x vLLM':>7} {'acceptance':>10} {'positions/s':>11} "
          f"{'turns':>6}")
    for r in rows:
        print(f"{r['policy']:<11} {r['phase']:<11} {r['requests']:>8} {r['latency_s'] or 0:>9.2f} {r['latency_vs_vllm'] or 0:>7.3f} "
              f"{r['acceptance'] or 0:>10.3f} {r['trainer_positions_per_s'] or 0:>11.1f} {r['serving_waited_share'] or 0:>6.1%}")
    if args.json:
        write_json(args.json, {"rows": rows, "minutes": args.minutes, "max_tokens": args.max_tokens, "peer": peer_name,
                               "peer_speed": result[next(iter(result))]["peer_speed"], "overrides": args.overrides,
                               "policies": {k: " ".join(f + o) for k, (f, o) in todo.items()},
                               "runs": {k: {x: v[x] for x in ("trainer", "banner", "by_phase", "by_version", "first_publish",
                                                                "ready_s", "requests_by")} for k, v in result.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
