"""Hot-swap: turning a `drafter_published` announcement into a drafter that is safe to serve, and judging it live.

`load_announced(published, ...)`, given a `dvi.control.DrafterPublished`, is the only way a running server gets new
drafter weights. Each file is read once (`dvi.store.read_verified`), and the drafter is built from exactly the bytes
that were hashed. In order, it refuses (raising `Refused` with a reason code and a message saying what and where):

- `bad_message`: the version name is not a plain name (a message without a version, a uri or a sha256 never
  gets here: `dvi.control.decode` refuses it);
- `outside_store`: the uri does not resolve to `<store root>/<version>` (symlinks and `..` resolved first);
- `pickle`: the directory holds a pickle-capable weight file (nothing here ever unpickles);
- `files`: an entry is not a regular file (a link, a folder), has a name a version does not hold, or the files
  hold more bytes than the target's weights (`max_drafter_bytes`);
- `checksum`: SHA256SUMS does not match the announced sha256, or a file does not match SHA256SUMS;
- `config`: config.json differs from the configured drafter's (or, with none, the target's) in more than the
  drafter's own fields (its layers), has more layers than the target, names code to run (`auto_map`), or sets a
  private key (`_attn_implementation` and the like pick kernels, possibly from the hub; only `_PRIVATE_METADATA`);
  an EAGLE-3 version's (speculators format, `dvi.eagle3`): its layer config is not the target's shapes in one layer,
  its verifier's architecture or hidden size is not the target's, or its aux layers or draft vocabulary do not fit
  the target (`auto_map` and private keys are refused in its layer config too);
- `shapes`: a weight in model.safetensors has another shape than the drafter's config implies, or one is missing;
- `load`: the weights or the reduced head do not load as a drafter of this target (vocabulary, repeated ids);
- `nonfinite`: a weight holds NaN or inf;
- `smoke`: a short greedy decode with the new drafter fails or produces non-finite logits.

An EAGLE-3 version passes the same checks (`check_announced`); `load_announced_eagle3` loads it as a
`dvi.eagle3.Eagle3Drafter` (d2t and t2d checked: `load`), which vLLM serves with method eagle3 (a server started with
an EAGLE-3 drafter, `dvi.serving.vllm_engine`). Each kind loads only where that kind serves: `load_announced` refuses
an EAGLE-3 version and `load_announced_eagle3` a layer drafter (`load`).

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

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dvi import eagle3, store
from dvi.control import DrafterPublished
from dvi.errors import DviError
from dvi.models import DRAFT_HEAD, Drafter, attach_head

log = logging.getLogger("dvi.swap")

SMOKE_PROMPT = [1, 2, 3, 4]  # token ids of the smoke decode: any ids in the vocabulary do
DRAFTER_OWN_FIELDS = frozenset({"num_hidden_layers", "layer_types", "max_window_layers"})  # how many layers it keeps
_METADATA_FIELDS = frozenset({"transformers_version", "torch_dtype", "dtype"})  # how it was saved, not what it is
_PRIVATE_METADATA = frozenset({"_name_or_path", "_model_name_or_path", "_commit_hash"})  # the private keys a version may set
TOKENIZER_ROOM = 64 << 20  # bytes of config and tokenizer files a version may hold beside its weights


class Refused(DviError):
    """A published drafter that will not be served; `reason` is one of the codes in the module docstring."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Checked:
    """A version that passed `check_announced`: its directory, config (the layer config of an EAGLE-3 version), its
    EAGLE-3 fields (`dvi.eagle3.eagle3_config`; None for a layer drafter) and its tensors."""

    path: Path
    config: object
    eagle: dict | None
    weights: dict[str, torch.Tensor]
    head: dict[str, torch.Tensor] | None


def resolve_in_store(uri: str, version: str, store_root: Path) -> Path:
    """The version's directory, which must be exactly <store_root>/<version> once resolved."""
    root = Path(store_root).expanduser().resolve()
    path = Path(uri.removeprefix("file://")).expanduser().resolve()
    if path != root / version:
        raise Refused("outside_store", f"drafter {version}: {uri} is not {root / version}; drafters load only from the store {root}")
    return path


def check_announced(ann: DrafterPublished, store_root: Path, target: torch.nn.Module, family=None) -> Checked:
    """The checks of the module docstring up to `shapes`, for either kind of version: its files read once and
    verified, its config and its weights, or Refused. `family`: see `load_announced` (layer drafters only)."""
    try:
        store.check_version_name(ann.version)
    except DviError as e:
        raise Refused("bad_message", str(e)) from None
    path = resolve_in_store(ann.uri, ann.version, store_root)
    if not path.is_dir():
        raise Refused("load", f"drafter {ann.version}: {path} does not exist (a store not shared with the trainer?)")
    try:
        files = store.read_verified(path, ann.sha256, max_bytes=max_drafter_bytes(target))
    except store.VersionError as e:
        raise Refused(e.kind, f"drafter {ann.version}: {e}") from None
    config, eagle = _config_of(files, family if family is not None else target.config, target.config, ann.version)
    try:
        weights = safetensors.torch.load(files[store.WEIGHTS])
        head = safetensors.torch.load(files[DRAFT_HEAD]) if DRAFT_HEAD in files and eagle is None else None
    except Exception as e:  # a missing or unreadable weights file
        raise Refused("load", f"drafter {ann.version}: its weights do not read: {type(e).__name__}: {str(e)[:300]}") from None
    if eagle is not None:
        if DRAFT_HEAD in files:
            raise Refused("files", f"drafter {ann.version}: an EAGLE-3 version holds its head in {store.WEIGHTS}, not {DRAFT_HEAD}")
        expected = eagle3.weight_shapes(config, eagle["draft_vocab_size"], len(eagle["layer_ids"]), eagle["target_hidden_size"])
        _check_shapes(expected, weights, set(), ann.version)
    else:
        tied = bool(getattr(config, "tie_word_embeddings", False))
        _check_shapes(_hf_shapes(config), weights, {"lm_head.weight"} if tied or head is not None else set(), ann.version)
    return Checked(path, config, eagle, weights, head)


def load_announced(ann: DrafterPublished, store_root: Path, target: torch.nn.Module, smoke_tokens: int = 8,
                   dtype: torch.dtype = torch.float32, family=None, device: torch.device | None = None) -> Drafter:
    """Check and load an announced layer drafter (see the module docstring). Returns it in `dtype` on `device` (None:
    the target's), or raises Refused. `family`: the config every version must match but for the drafter's own fields:
    the configured drafter's (the trainer publishes versions of it), or by default the target's (a drafter built
    from the target). `target` may hold no weights (the meta device): only its config and parameter count are read."""
    checked = check_announced(ann, store_root, target, family)
    if checked.eagle is not None:
        raise Refused("load", f"drafter {ann.version} is an EAGLE-3 drafter: a replica started with a layer drafter (vLLM's "
                              "method draft_model, or dvi's engine) serves layer drafters only; one started with an "
                              "EAGLE-3 drafter (vLLM's method eagle3, or dvi's engine) serves it")
    vocab = int(target.config.vocab_size)
    try:
        drafter = _build(checked.config, checked.weights, checked.head, vocab, ann.version, str(checked.path / DRAFT_HEAD))
    except Exception as e:  # DviError from the head's checks, or whatever transformers raises on a broken config
        raise Refused("load", f"drafter {ann.version} at {checked.path} does not load: {type(e).__name__}: {str(e)[:300]}") from None
    device = device if device is not None else next(target.parameters()).device  # the drafter serves beside the target
    drafter.model.to(device=device, dtype=dtype)
    if drafter.vocab_map is not None:
        drafter.vocab_map = drafter.vocab_map.to(device)
    _check_finite(drafter.model, ann.version)
    _smoke(drafter, smoke_tokens, vocab)
    return drafter


def load_announced_eagle3(ann: DrafterPublished, store_root: Path, target: torch.nn.Module,
                          dtype: torch.dtype = torch.float32) -> eagle3.Eagle3Drafter:
    """Check and load an announced EAGLE-3 drafter on the CPU, or raise Refused. Its shared embedding is the
    target's when `target` holds weights (on the meta device it keeps its own, which vLLM never reads); a forward on
    zero features must give finite logits (`smoke`)."""
    checked = check_announced(ann, store_root, target)
    if checked.eagle is None:
        raise Refused("load", f"drafter {ann.version} is a layer drafter, not an EAGLE-3 drafter (no speculators_model_type "
                              "eagle3): a server started with an EAGLE-3 drafter (vLLM's method eagle3) serves EAGLE-3 "
                              "versions only")
    e = checked.eagle
    embed = target.get_input_embeddings().weight
    try:
        eagle3.check_vocab_maps(checked.weights["d2t"], checked.weights["t2d"])
        drafter = eagle3.Eagle3Drafter(checked.config, e["draft_vocab_size"], e["layer_ids"],
                                       None if embed.is_meta else embed.detach().cpu(), e["target_hidden_size"],
                                       e["norm_before_residual"])
        drafter.load_state_dict(checked.weights, strict=False)  # all but the shared embedding, as checked
    except Exception as err:
        raise Refused("load", f"drafter {ann.version} at {checked.path} does not load: {type(err).__name__}: {str(err)[:300]}") from None
    drafter.version = ann.version
    drafter.to(dtype).eval()
    _check_finite(drafter, ann.version)
    try:
        with torch.inference_mode():
            ids = torch.tensor([SMOKE_PROMPT])
            logits, _ = drafter(torch.zeros(1, len(SMOKE_PROMPT), checked.config.hidden_size, dtype=dtype), ids)
    except Exception as err:
        raise Refused("smoke", f"drafter {ann.version}: smoke forward failed: {type(err).__name__}: {str(err)[:300]}") from None
    if not bool(torch.isfinite(logits).all()):
        raise Refused("smoke", f"drafter {ann.version}: non-finite logits in a smoke forward")
    return drafter


def _check_finite(model: torch.nn.Module, version: str) -> None:
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise Refused("nonfinite", f"drafter {version}: non-finite weights in {bad[:3]}{' ...' if len(bad) > 3 else ''}")


def max_drafter_bytes(target: torch.nn.Module) -> int:
    """The most a version's files may hold: the target's weights in fp32, plus room for its tokenizer files."""
    return sum(p.numel() for p in target.parameters()) * 4 + TOKENIZER_ROOM


def _config_of(files: dict[str, bytes], family, target_config, version: str):
    """(config, None) of a layer drafter's version, which must equal `family` but for the drafter's own fields
    (DRAFTER_OWN_FIELDS, with no more layers than the target); (layer config, EAGLE-3 fields) of an EAGLE-3 version
    (`_eagle3_config_of`). Either must name no code to run (`auto_map`) and set no private key but metadata; else
    Refused("config"). (The private keys of the two loaded configs are not compared: transformers sets its own.)"""
    try:
        raw = json.loads(files["config.json"])
        if not isinstance(raw, dict) or not (isinstance(raw.get("model_type"), str) or eagle3.is_eagle3_config(raw)):
            raise ValueError("not a JSON object with a model_type")
    except (KeyError, ValueError) as e:
        raise Refused("config", f"drafter {version}: no readable config.json ({e})") from None
    nested = raw.get("transformer_layer_config")
    for part in (raw, nested) if isinstance(nested, dict) else (raw,):
        if "auto_map" in part:
            raise Refused("config", f"drafter {version}: its config names code to run (auto_map); drafters are plain models")
        private = sorted(k for k in part if k.startswith("_") and k not in _PRIVATE_METADATA)
        if private:  # they steer how transformers builds the model (attention kernels, hub code), not what the model is
            raise Refused("config", f"drafter {version}: its config sets private keys {private[:5]}; a version may set only "
                                    f"{sorted(_PRIVATE_METADATA)} of them")
    if eagle3.is_eagle3_config(raw):
        return _eagle3_config_of(raw, target_config, version)
    try:
        config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    except Exception as e:
        raise Refused("config", f"drafter {version}: config.json does not load: {type(e).__name__}: {str(e)[:200]}") from None
    what = "the target's" if family is target_config else "the configured drafter's"
    _same_config(config, family, DRAFTER_OWN_FIELDS, what, version)
    layers, most = config.to_dict().get("num_hidden_layers", 0), target_config.to_dict().get("num_hidden_layers", 0)
    if layers > most:
        raise Refused("config", f"drafter {version}: {layers} layers, more than the target's {most}")
    return config, None


def _same_config(config, family, own: frozenset, what: str, version: str) -> None:
    """Refused("config") unless `config` equals `family` but for the fields of `own`, metadata and private keys."""
    mine, theirs = config.to_dict(), family.to_dict()
    differ = sorted(k for k in set(mine) | set(theirs)
                    if k not in own and k not in _METADATA_FIELDS and not k.startswith("_") and mine.get(k) != theirs.get(k))
    if differ:
        raise Refused("config", f"drafter {version}: its config differs from {what} in {differ[:5]} "
                                f"(a version may differ only in {sorted(own)})")


def _eagle3_config_of(raw: dict, target_config, version: str):
    """(layer config, EAGLE-3 fields) of a speculators-format config that fits the target: its layer config is the
    target's in one layer (`dvi.eagle3.layer_config`), its verifier has the target's architecture, its fc reads the
    target's hidden size, its aux layers are the target's (0..layers) and its draft vocabulary is a reduced one."""
    try:
        config, fields = eagle3.eagle3_config(raw)
    except DviError as e:
        raise Refused("config", f"drafter {version}: {e}") from None
    _same_config(config, eagle3.layer_config(target_config), frozenset(), "the target's in one layer", version)
    verifier = raw["speculators_config"]["verifier"]
    archs, want = verifier.get("architectures") if isinstance(verifier, dict) else None, target_config.architectures
    hidden, layers, vocab = target_config.hidden_size, target_config.num_hidden_layers, target_config.vocab_size
    problems = [f"its verifier is a {archs}, the target a {want}" if archs and want and list(archs) != list(want) else "",
                f"target_hidden_size {fields['target_hidden_size']}, the target's is {hidden}"
                if fields["target_hidden_size"] != hidden else "",
                f"aux layers {fields['layer_ids']} outside the target's 0..{layers}"
                if not all(0 <= i <= layers for i in fields["layer_ids"]) else "",
                f"draft_vocab_size {fields['draft_vocab_size']} not in 1..{vocab - 1}"
                if not 0 < fields["draft_vocab_size"] < vocab else ""]
    if any(problems):
        raise Refused("config", f"drafter {version}: an EAGLE-3 drafter that does not fit the target: "
                                f"{'; '.join(p for p in problems if p)}")
    return config, fields


def _hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter of the causal LM `config` describes, from the meta device (no memory, no init)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}


def _check_shapes(expected: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor], optional: set[str],
                  version: str) -> None:
    """Every tensor `expected` names (but the `optional` ones) must come from the weights with its shape, and no
    other, checked before anything is loaded (a missing weight would keep its random init, and torch's error on a
    wrong shape does not say which)."""
    found = {k: tuple(v.shape) for k, v in weights.items()}
    missing = sorted(k for k in expected if k not in found and k not in optional)
    wrong = sorted(f"{k} {found[k]} != {expected[k]}" for k in expected if k in found and k not in optional and found[k] != expected[k])
    extra = sorted(k for k in found if k not in expected)
    if missing or wrong or extra:
        parts = [f"missing {missing[:3]}" if missing else "", f"wrong shapes {wrong[:3]}" if wrong else "",
                 f"unexpected {extra[:3]}" if extra else ""]
        raise Refused("shapes", f"drafter {version}: weights do not fit its config: {'; '.join(p for p in parts if p)}")


def _build(config, weights: dict[str, torch.Tensor], head: dict[str, torch.Tensor] | None, vocab: int, version: str,
           head_where: str) -> Drafter:
    """The drafter made of exactly these (checked) tensors. No random initialisation first (half the time of a
    swap on the CPU): every parameter is overwritten, as `_check_shapes` made sure."""
    with _no_init():
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=False)  # what may be absent (a tied or reduced head) was checked above
    model.tie_weights()
    vocab_map = attach_head(model, head, vocab, head_where) if head is not None else None
    return Drafter(model=model.eval(), version=version, vocab_map=vocab_map)


def _no_init():
    """transformers' context that skips weight initialisation (5.x: transformers.initialization), or a no-op."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


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
    (not enough of the new drafter's traffic yet). `previous`: the drafter it replaced (None: there was none). A
    trial that accepted nothing is rolled back whatever came before: a drafter live traffic never accepts is no
    drafter to promote."""
    drafted, accepted = current
    if drafted < window_tokens:
        return None
    if accepted == 0:
        return "rollback"
    if previous is None or previous[0] < baseline_tokens:
        return "keep"
    return "rollback" if accepted / drafted < previous[1] / previous[0] - margin else "keep"
