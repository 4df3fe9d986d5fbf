"""`dvi status`: one look at the loop: what each replica serves and how well, the trainer's lag, the last publish.

It asks each replica's `/health` (default: serve.host:serve.port; `--replica URL` for others), reads the newest
version in the model store, and asks MLflow (`dvi.tracking.loop_view`) for the newest trainer run's last metrics
and the registry's aliases. Every source may be down: its line says so and the rest is still printed. This
module reads; it never changes anything.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dvi import store
from dvi.config import load_config, overrides_of
from dvi.models import read_drafter_meta
from dvi.procs import local_get
from dvi.tracking import loop_view


def replica(url: str, timeout_s: float = 3.0) -> dict:
    try:
        return {"url": url, **json.loads(local_get(url.rstrip("/") + "/health", timeout_s))}
    except (OSError, ValueError) as e:
        return {"url": url, "status": f"unreachable ({type(e).__name__}: {e})"}


def last_publish(store_root: Path) -> dict | None:
    names = store.versions(store_root)
    if not names:
        return None
    meta = read_drafter_meta(store_root / names[-1])
    return {"version": names[-1], "versions": len(names), "created": meta.get("created"), "parent": meta.get("parent"),
            "gate": meta.get("gate")}


def status(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    urls = args.replica or [f"http://{cfg.serve.host}:{cfg.serve.port}"]
    view = {"replicas": [replica(u) for u in urls], "last_publish": last_publish(store.serving_root(cfg)),
            "mlflow": loop_view(cfg.tracking) if cfg.tracking.enabled else None}
    if args.json:
        print(json.dumps(view, default=str))
        return 0
    for r in view["replicas"]:
        if r.get("status") != "ok":
            print(f"replica {r['url']}: {r.get('status')}")
            continue
        print(f"replica {r.get('replica_id')} at {r['url']}: drafter {r.get('drafter_version')}"
              f"{' (on trial)' if r.get('rollout') else ''}, acceptance {r.get('acceptance_rate', 0):.3f}, "
              f"mean accepted length {r.get('mean_accepted_length', 0):.2f}, {r.get('requests')} requests, "
              f"median {r.get('median_tokens_per_s')} tok/s, queue {r.get('queue_depth')}, "
              f"records sent/dropped {(r.get('records') or {}).get('sent')}/{(r.get('records') or {}).get('dropped')}")
    p = view["last_publish"]
    if p:
        age = f"{(time.time() - p['created']) / 60:.1f} min ago" if p.get("created") else "at an unknown time"
        gate = p.get("gate") or {}
        print(f"last publish: {p['version']} ({age}, parent {p.get('parent')}, gate {gate.get('candidate_acceptance', float('nan')):.3f} "
              f"vs {gate.get('serving_acceptance', float('nan')):.3f}); {p['versions']} versions in the store")
    else:
        print("last publish: none (the store is empty)")
    m = view["mlflow"]
    if m is None:
        print("mlflow: tracking disabled")
    elif "error" in m:
        print(f"mlflow {m['uri']}: {m['error']}")
    else:
        t = m.get("trainer")
        if t:
            print(f"trainer: run {t['run_id'][:8]} {t['status']}, consumer lag {t['consumer_lag']}, {t['step_metrics']}")
        else:
            print("trainer: no run yet")
        print(f"registry aliases: {m.get('aliases') or 'none'}")
    return 0
