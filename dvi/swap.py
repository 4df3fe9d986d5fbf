"""Hot-swap: turning a `drafter_published` announcement into a drafter that is safe to serve, and judging it live.

`load_announced(published, ...)`, given a `dvi.control.DrafterPublished`, is the only way a running server gets new drafter weights. In order, it
refuses (raising `Refused` with a reason code and a message saying what and where):

- `bad_message`: the version name is not a plain name (a message without a version, a uri or a sha256 never
  gets here: `dvi.control.decode` refuses it);
- `outside_store`: the uri does not resolve to `<store root>/<version>` (symlinks and `..` resolved first);
- `pickle`: the directory holds a pickle-capable weight file (nothing here ever unpickles);
- `checksum`: SHA256SUMS does not match the announced sha256, or a file does not match SHA256SUMS;
- `load`: the checkpoint does not load as a drafter of this target (config, tokenizer, vocabulary);
- `shapes`: a weight in model.safetensors has another shape than the drafter's config implies, or one is missing;
- `nonfinite`: a weight holds NaN or inf;
- `smoke`: a short greedy decode with the new drafter fails or produces non-finite logits.

It runs on the caller's thread (the server's swap thread), never on the decoding thread; the engine's
`swap_drafter` then switches the pointer between verification rounds.

`judge(...)` is the live check after a swap, a pure function of acceptance counts: wait for `window_tokens`
drafted tokens of the new drafter, then keep it unless its acceptance is more than `rollback_margin` below
the previous drafter's on the traffic just before the swap (its latest `window_tokens` drafted tokens, not its
lifetime figure, which drifted traffic would inflate; with fewer than `baseline_tokens`, there is nothing to
compare against and the new drafter is kept).

This module knows the model store, safetensors and the engine's `Drafter`; not Kafka, HTTP or MLflow.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from dvi import store
from dvi.control import DrafterPublished
from dvi.errors import DviError
from dvi.models import DRAFT_HEAD, Drafter, load_drafter

log = logging.getLogger("dvi.swap")

SMOKE_PROMPT = [1, 2, 3, 4]  # token ids of the smoke decode: any ids in the vocabulary do


class Refused(DviError):
    """A published drafter that will not be served; `reason` is one of the codes in the module docstring."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def resolve_in_store(uri: str, version: str, store_root: Path) -> Path:
    """The version's directory, which must be exactly <store_root>/<version> once resolved."""
    root = Path(store_root).expanduser().resolve()
    path = Path(uri.removeprefix("file://")).expanduser().resolve()
    if path != root / version:
        raise Refused("outside_store", f"drafter {version}: {uri} is not {root / version}; drafters load only from the store {root}")
    return path


def load_announced(ann: DrafterPublished, store_root: Path, target: torch.nn.Module, smoke_tokens: int = 8,
                   dtype: torch.dtype = torch.float32) -> Drafter:
    """Check and load an announced drafter (see the module docstring). Returns it in `dtype` on the target's
    device, or raises Refused."""
    try:
        store.check_version_name(ann.version)
    except DviError as e:
        raise Refused("bad_message", str(e)) from None
    path = resolve_in_store(ann.uri, ann.version, store_root)
    if not path.is_dir():
        raise Refused("load", f"drafter {ann.version}: {path} does not exist (a store not shared with the trainer?)")
    pickles = sorted(f.name for f in path.iterdir() if f.name.endswith(store.PICKLE_SUFFIXES))
    if pickles:
        raise Refused("pickle", f"drafter {ann.version}: {path} holds pickle-capable files {pickles}; refusing it (safetensors only)")
    try:
        store.verify(path, ann.sha256)
    except DviError as e:
        raise Refused("checksum", f"drafter {ann.version}: {e}") from None
    vocab = int(target.config.vocab_size)
    try:
        _check_shapes(path, ann.version)
        drafter = load_drafter(path, vocab, dtype, next(target.parameters()).device)  # on the target's device
    except Refused:
        raise
    except Exception as e:  # DviError, or whatever transformers raises on a broken config
        raise Refused("load", f"drafter {ann.version} at {path} does not load: {type(e).__name__}: {str(e)[:300]}") from None
    bad = [name for name, p in drafter.model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise Refused("nonfinite", f"drafter {ann.version}: non-finite weights in {bad[:3]}{' ...' if len(bad) > 3 else ''}")
    _smoke(drafter, smoke_tokens, vocab)
    drafter.version = ann.version
    return drafter


def _check_shapes(path: Path, version: str) -> None:
    """Every parameter the config implies must come from the file with its shape, checked before anything is
    loaded (transformers fills a missing weight with random values and only warns, and its error on a wrong
    shape does not say which). The expected shapes come from the config on the meta device: no memory, no init."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    with safe_open(str(path / store.WEIGHTS), "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    optional = {"lm_head.weight"} if tied or (path / DRAFT_HEAD).exists() else set()
    missing = sorted(k for k in expected if k not in found and k not in optional)
    wrong = sorted(f"{k} {found[k]} != {expected[k]}" for k in expected if k in found and k not in optional and found[k] != expected[k])
    extra = sorted(k for k in found if k not in expected)
    if missing or wrong or extra:
        parts = [f"missing {missing[:3]}" if missing else "", f"wrong shapes {wrong[:3]}" if wrong else "",
                 f"unexpected {extra[:3]}" if extra else ""]
        raise Refused("shapes", f"drafter {version}: weights do not fit its config: {'; '.join(p for p in parts if p)}")


@torch.inference_mode()
def _smoke(drafter: Drafter, tokens: int, vocab: int) -> None:
    ids = torch.tensor([SMOKE_PROMPT], device=drafter.model.device)
    try:
        for _ in range(tokens):
            logits = drafter.model(input_ids=ids).logits[0, -1]  # [Vd]
            if not bool(torch.isfinite(logits).all()):
                raise Refused("smoke", f"drafter {drafter.version}: non-finite logits in a smoke decode")
            nxt = int(logits.argmax())
            if drafter.vocab_map is not None:
                nxt = int(drafter.vocab_map[nxt])
            if not 0 <= nxt < vocab:
                raise Refused("smoke", f"drafter {drafter.version}: smoke decode produced token {nxt} outside the vocabulary")
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], 1)
    except Refused:
        raise
    except Exception as e:
        raise Refused("smoke", f"drafter {drafter.version}: smoke decode failed: {type(e).__name__}: {str(e)[:300]}") from None


def judge(previous: tuple[int, int] | None, current: tuple[int, int], window_tokens: int, baseline_tokens: int,
          margin: float) -> str | None:
    """Keep or roll back a swapped-in drafter, from (drafted, accepted) counts: "keep", "rollback", or None
    (not enough of the new drafter's traffic yet). `previous`: the drafter it replaced (None: there was none)."""
    drafted, accepted = current
    if drafted < window_tokens:
        return None
    if previous is None or previous[0] < baseline_tokens:
        return "keep"
    return "rollback" if accepted / drafted < previous[1] / previous[0] - margin else "keep"
