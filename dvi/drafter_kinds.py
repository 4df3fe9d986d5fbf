"""Drafter kinds: what differs between the kinds of drafter dvi builds, serves and trains, behind one interface.

A `DrafterKind` says, for its kind: its name (what dvi_drafter.json, `model.drafter_kind` and `Drafter.kind` say),
vLLM's speculative method for it, whether it drafts from the target's features, where the demo drafter lives and how an initial one is built from a target, how a
drafter directory loads, how an announced version's config and tensors are checked against the target and loaded
(`dvi.swap` runs the checks every kind shares, then these, raising `dvi.errors.Refused` with its reason codes), which
of the target's features it drafts from, the KV cache dvi's engine drafts with (`dvi.kv`: what it is fed and keeps of
a verified round), its greedy drafts alone (the registry's pyfunc model), and what vLLM fixes of it when it builds its
draft model. Two kinds:

- `LAYERS` (`LayersKind`): a Hugging Face causal LM made of the target's first layers (`dvi.models`), vLLM's method
  draft_model;
- `EAGLE3` (`Eagle3Kind`): one layer over the target's aux hidden states, in the speculators format (`dvi.eagle3`),
  vLLM's method eagle3.

`kind_of(name)` looks a kind up (DviError naming the known kinds for another name), `kind_of_dir(path)` gives a
drafter directory's, `kind_of_config(raw)` a version's config.json's. A further kind is one more `DrafterKind` in
`KINDS`. The implementations delegate to the modules that own each kind's maths and files.

This module knows the kinds' files, their checks and vLLM's names for them; not the store's layout (`dvi.store`),
announcements (`dvi.swap`), the decoding loop, serving or training.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dvi import eagle3
from dvi.errors import DviError, Refused
from dvi.kv import DraftKV, FeatureKV
from dvi.models import DRAFT_HEAD, EAGLE3, EAGLE3_VOCAB, LAYERS, Drafter, attach_head, build_drafter, drafter_kind, load_drafter

WEIGHTS = "model.safetensors"  # the file a version's tensors are in (`dvi.store.WEIGHTS`)
SMOKE_PROMPT = [1, 2, 3, 4]  # token ids of the smoke decode: any ids in the vocabulary do
DRAFTER_OWN_FIELDS = frozenset({"num_hidden_layers", "layer_types", "max_window_layers"})  # how many layers it keeps
METADATA_FIELDS = frozenset({"transformers_version", "torch_dtype", "dtype"})  # how it was saved, not what it is


@dataclass
class Checked:
    """A version that passed `dvi.swap.check_announced`: its kind, directory, config (the layer config of an EAGLE-3
    version), its kind's own config fields (`dvi.eagle3.eagle3_config`'s; None for a layer drafter) and tensors."""

    kind: DrafterKind
    path: Path
    config: object
    fields: dict | None
    weights: dict[str, torch.Tensor]
    head: dict[str, torch.Tensor] | None


class DrafterKind(ABC):
    """One kind of drafter (see the module docstring)."""

    name: str  # what dvi_drafter.json, model.drafter_kind and Drafter.kind say
    vllm_method: str  # vLLM's speculative method for it
    description: str  # how messages name a drafter of this kind ("a layer drafter")
    reads_features: bool  # it drafts from the target's features: what runs it alone loads the target too

    @abstractmethod
    def owns_config(self, raw: dict) -> bool:
        """Whether a config.json (parsed) is a drafter of this kind's."""

    @abstractmethod
    def demo_dir(self, cache_dir: Path, layers: int, vocab: int | None) -> Path:
        """Where the demo drafter of this kind is built in the cache."""

    @abstractmethod
    def build(self, target_dir: Path, out_dir: Path, layers: int, vocab: int | None) -> Path:
        """Build an initial drafter of this kind for the target at `target_dir` and save it at `out_dir`."""

    @abstractmethod
    def init_size(self, layers: int | None, vocab: int | None, default_layers: int, default_vocab: int | None
                  ) -> tuple[int, int | None]:
        """(layers, vocab) of an initial drafter asked for with `layers` and `vocab` (None: not given; vocab 0: the
        target's whole vocabulary), else the configured defaults; DviError for a size this kind does not take."""

    @abstractmethod
    def version_tensors(self, weights: dict[str, torch.Tensor], config: dict, vocab_map: torch.Tensor | None
                        ) -> dict[str, dict[str, torch.Tensor]]:
        """A published version's tensors by file name (WEIGHTS, and any file of this kind's own) from the student's
        `weights` (its parent's `config`; `vocab_map`, a reduced head's target ids): what `read_tensors` and vLLM
        read back."""

    @abstractmethod
    def load(self, path: str | Path, target_vocab_size: int, dtype: torch.dtype, device: torch.device | str,
             target=None, embed: torch.Tensor | None = None) -> Drafter:
        """A drafter directory of this kind as a `Drafter` (see `dvi.pairs.load_any_drafter`)."""

    @abstractmethod
    def load_served(self, path: Path, target_dir: Path, target_vocab_size: int, dtype: torch.dtype,
                    device: torch.device | str):
        """A drafter directory of this kind as a server takes it (`dvi.pairs.resolve_pair`)."""

    @abstractmethod
    def check_config(self, raw: dict, family, target_config, version: str) -> tuple[object, dict | None]:
        """(config, own fields) of a version's config.json that fits the target, or Refused("config")."""

    @abstractmethod
    def read_tensors(self, files: dict[str, bytes], config, fields: dict | None, version: str
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(weights, reduced head or None) of a version, with the shapes its config implies, or Refused."""

    @abstractmethod
    def load_version(self, checked: Checked, version: str, target: torch.nn.Module, dtype: torch.dtype,
                     device: torch.device | None, smoke_tokens: int):
        """A checked version as this kind serves it, its weights finite and a smoke run passed, or Refused."""

    @abstractmethod
    def refuse_other(self, version: str, other: DrafterKind) -> Refused:
        """The refusal of a version of kind `other` by a server of this kind."""

    @abstractmethod
    def feature_layers(self, drafter) -> tuple[int, ...] | None:
        """The target's layers whose aux hidden states `drafter` drafts from (None: it reads none)."""

    @abstractmethod
    def check_target(self, drafter, target_config) -> None:
        """DviError unless the target `target_config` describes has the features `drafter` reads."""

    @abstractmethod
    def draft_model(self, drafter) -> tuple[torch.nn.Module, torch.Tensor | None]:
        """What drafts for `drafter` (a `Drafter`, or this kind's model served bare) and the target ids of its output
        rows (None: all of them)."""

    @abstractmethod
    def place(self, drafter, device: torch.device) -> None:
        """Move `drafter` to the target's `device` where it was not loaded there."""

    @property
    @abstractmethod
    def draft_cache(self) -> type[DraftKV]:
        """The KV cache dvi's engine drafts with for this kind (`dvi.kv`): what it is fed, reads and keeps of a round."""

    @abstractmethod
    def greedy_drafts(self, drafter, ids: list[int], n: int, target: torch.nn.Module | None = None) -> list[int]:
        """`drafter`'s n greedy drafts (target ids) after the sequence `ids`, drafting alone: what it would propose to
        the target. `target`: the model whose features it reads (a kind that reads none ignores it)."""

    @abstractmethod
    def check_vllm(self, drafter, vocab_size: int) -> None:
        """DviError unless vLLM's draft model can take `drafter` for a target of `vocab_size`."""

    @abstractmethod
    def vllm_shape(self, drafter) -> dict[str, object]:
        """What vLLM fixes of `drafter` when it builds its draft model (its kind first)."""

    @abstractmethod
    def vllm_shape_text(self, drafter) -> str:
        """How a message names what of `drafter` vLLM fixes."""

    @abstractmethod
    def vllm_load_args(self, drafter) -> tuple:
        """The arguments of the worker's `dvi_load_drafter` that load `drafter`'s tensors into vLLM's draft model."""


class LayersKind(DrafterKind):
    """A layer drafter: a causal LM of the target's family (`dvi.models`), maybe with a reduced head."""

    name, vllm_method, description, reads_features = LAYERS, "draft_model", "a layer drafter", False

    def owns_config(self, raw: dict) -> bool:
        return isinstance(raw.get("model_type"), str)

    def demo_dir(self, cache_dir: Path, layers: int, vocab: int | None) -> Path:
        return cache_dir / "models" / f"drafter-L{layers}-{'v' + str(vocab) if vocab else 'full'}"

    def build(self, target_dir: Path, out_dir: Path, layers: int, vocab: int | None) -> Path:
        return build_drafter(target_dir, out_dir, layers, vocab)

    def init_size(self, layers, vocab, default_layers, default_vocab):
        return (default_layers if layers is None else layers,
                None if vocab == 0 else default_vocab if vocab is None else vocab)

    def version_tensors(self, weights, config, vocab_map):
        """Its weights with the base model's keys; a reduced head (`vocab_map` its target ids) in DRAFT_HEAD apart,
        and a head tied to the embeddings left out (the same tensor)."""
        weights, files = dict(weights), {}
        if vocab_map is not None:
            files[DRAFT_HEAD] = {"token_ids": vocab_map.detach().cpu().long().contiguous(), "weight": weights.pop("lm_head.weight")}
        elif config.get("tie_word_embeddings") and "model.embed_tokens.weight" in weights:
            weights.pop("lm_head.weight", None)
        return {WEIGHTS: weights, **files}

    def load(self, path, target_vocab_size, dtype, device, target=None, embed=None) -> Drafter:
        return load_drafter(path, target_vocab_size, dtype, device)

    def load_served(self, path, target_dir, target_vocab_size, dtype, device) -> Drafter:
        return load_drafter(path, target_vocab_size, dtype, device)

    def check_config(self, raw: dict, family, target_config, version: str) -> tuple[object, None]:
        """It must equal `family` but for the drafter's own fields (DRAFTER_OWN_FIELDS), with no more layers than the
        target."""
        try:
            config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
        except Exception as e:
            raise Refused("config", f"drafter {version}: config.json does not load: {type(e).__name__}: {str(e)[:200]}") from None
        what = "the target's" if family is target_config else "the configured drafter's"
        same_config(config, family, DRAFTER_OWN_FIELDS, what, version)
        layers, most = config.to_dict().get("num_hidden_layers", 0), target_config.to_dict().get("num_hidden_layers", 0)
        if layers > most:
            raise Refused("config", f"drafter {version}: {layers} layers, more than the target's {most}")
        return config, None

    def read_tensors(self, files, config, fields, version):
        weights, head = read_weights(files, version, DRAFT_HEAD in files)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        check_shapes(_hf_shapes(config), weights, {"lm_head.weight"} if tied or head is not None else set(), version)
        return weights, head

    def load_version(self, checked, version, target, dtype, device, smoke_tokens) -> Drafter:
        """In `dtype` on `device` (None: the target's), its smoke test a greedy decode of `smoke_tokens` tokens."""
        vocab = int(target.config.vocab_size)
        try:
            drafter = _build(checked.config, checked.weights, checked.head, vocab, version, str(checked.path / DRAFT_HEAD))
        except Exception as e:  # DviError from the head's checks, or whatever transformers raises on a broken config
            raise Refused("load", f"drafter {version} at {checked.path} does not load: {type(e).__name__}: {str(e)[:300]}") from None
        device = device if device is not None else next(target.parameters()).device  # it serves beside the target
        drafter.model.to(device=device, dtype=dtype)
        if drafter.vocab_map is not None:
            drafter.vocab_map = drafter.vocab_map.to(device)
        check_finite(drafter.model, version)
        _smoke(drafter, smoke_tokens, vocab)
        return drafter

    def refuse_other(self, version: str, other: DrafterKind) -> Refused:
        return Refused("load", f"drafter {version} is {other.description}: a replica started with a layer drafter (vLLM's "
                               "method draft_model, or dvi's engine) serves layer drafters only; one started with "
                               f"{other.description} (vLLM's method {other.vllm_method}, or dvi's engine) serves it")

    def feature_layers(self, drafter) -> None:
        return None

    def check_target(self, drafter, target_config) -> None:
        return None

    def draft_model(self, drafter) -> tuple[torch.nn.Module, torch.Tensor | None]:
        return drafter.model, drafter.vocab_map

    def place(self, drafter, device: torch.device) -> None:
        """Nothing: a layer drafter is loaded on the target's device."""

    draft_cache = DraftKV

    def greedy_drafts(self, drafter, ids, n, target=None) -> list[int]:
        new: list[int] = []
        for _ in range(n):
            choice = int(drafter.model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(int(drafter.vocab_map[choice]) if drafter.vocab_map is not None else choice)
        return new

    def check_vllm(self, drafter, vocab_size: int) -> None:
        """Over the target's whole vocabulary: vLLM's draft model has no reduced head."""
        if drafter.vocab_map is not None:
            raise DviError(f"drafter {drafter.version!r} has a reduced vocabulary head ({drafter.vocab_size} rows); "
                           "vLLM's draft model drafts over the target's whole vocabulary")
        if int(drafter.model.config.vocab_size) != vocab_size:
            raise DviError(f"drafter {drafter.version!r} has vocabulary size {drafter.model.config.vocab_size}, the target has {vocab_size}")

    def vllm_shape(self, drafter) -> dict[str, object]:
        return {"kind": self.name, **{k: tuple(v.shape) for k, v in drafter.model.state_dict().items()}}

    def vllm_shape_text(self, drafter) -> str:
        return f"{drafter.model.config.num_hidden_layers} layers and other shapes"

    def vllm_load_args(self, drafter) -> tuple:
        return ({k: v.detach().float() for k, v in drafter.model.state_dict().items()},)


class Eagle3Kind(DrafterKind):
    """An EAGLE-3 drafter (`dvi.eagle3`), served bare (an `Eagle3Drafter`) or held by a `Drafter` (its model)."""

    name, vllm_method, description, reads_features = EAGLE3, "eagle3", "an EAGLE-3 drafter", True

    def owns_config(self, raw: dict) -> bool:
        return eagle3.is_eagle3_config(raw)

    def demo_dir(self, cache_dir: Path, layers: int, vocab: int | None) -> Path:
        """Over `vocab` tokens (None: EAGLE3_VOCAB); `layers` is not its to choose."""
        return cache_dir / "models" / f"eagle3-v{vocab or EAGLE3_VOCAB}"

    def build(self, target_dir: Path, out_dir: Path, layers: int, vocab: int | None) -> Path:
        return eagle3.build_eagle3(target_dir, out_dir, vocab or EAGLE3_VOCAB)

    def init_size(self, layers, vocab, default_layers, default_vocab):
        if layers is not None:
            raise DviError("--layers is for --kind layers; an eagle3 drafter is one layer over the target's features")
        if vocab == 0:
            raise DviError("an eagle3 drafter's head covers a reduced vocabulary: give --vocab N (default 8192)")
        return default_layers, vocab or EAGLE3_VOCAB

    def version_tensors(self, weights, config, vocab_map):
        """Its own tensors, as vLLM reads them (the head's d2t and t2d among them); not the target's embedding it
        shares."""
        return {WEIGHTS: {k: v for k, v in weights.items() if not k.startswith(eagle3.SHARED_PREFIXES)}}

    def load(self, path, target_vocab_size, dtype, device, target=None, embed=None) -> Drafter:
        """Over the loaded `target` (`dvi.eagle3.load_for_target`), or sharing `embed` (the target's input embedding,
        for a process that holds no copy of the target); with neither, read as a layer drafter's directory is."""
        if target is None and embed is None:
            return load_drafter(path, target_vocab_size, dtype, device)
        if target is None:
            model = eagle3.load_eagle3(Path(path).expanduser(), dtype=dtype, embed=embed).to(device)
            if int(model.config.vocab_size) != target_vocab_size:
                raise DviError(f"eagle3 drafter at {str(path)!r} has vocabulary size {model.config.vocab_size}, not {target_vocab_size}")
            return Drafter(model=model, version=model.version, vocab_map=eagle3.target_ids(model.d2t))
        if int(target.config.vocab_size) != target_vocab_size:
            raise DviError(f"the target has vocabulary size {target.config.vocab_size}, not {target_vocab_size}")
        return eagle3.load_for_target(Path(path).expanduser(), target, dtype, device)

    def load_served(self, path, target_dir, target_vocab_size, dtype, device) -> eagle3.Eagle3Drafter:
        """The bare `Eagle3Drafter`, the target's embedding read from `target_dir`."""
        return eagle3.load_eagle3(path, target_dir, dtype).to(device)

    def check_config(self, raw: dict, family, target_config, version: str) -> tuple[object, dict]:
        """Its layer config is the target's in one layer (`dvi.eagle3.layer_config`), its verifier has the target's
        architecture, its fc reads the target's hidden size, its aux layers are the target's (0..layers) and its draft
        vocabulary is a reduced one; `family` is not its."""
        try:
            config, fields = eagle3.eagle3_config(raw)
        except DviError as e:
            raise Refused("config", f"drafter {version}: {e}") from None
        same_config(config, eagle3.layer_config(target_config), frozenset(), "the target's in one layer", version)
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

    def read_tensors(self, files, config, fields, version):
        """Its head is in its weights (no draft_head.safetensors: Refused("files"))."""
        weights, _ = read_weights(files, version, False)
        if DRAFT_HEAD in files:
            raise Refused("files", f"drafter {version}: an EAGLE-3 version holds its head in {WEIGHTS}, not {DRAFT_HEAD}")
        expected = eagle3.weight_shapes(config, fields["draft_vocab_size"], len(fields["layer_ids"]), fields["target_hidden_size"])
        check_shapes(expected, weights, set(), version)
        return weights, None

    def load_version(self, checked, version, target, dtype, device, smoke_tokens) -> eagle3.Eagle3Drafter:
        """A bare `Eagle3Drafter` on the CPU, whatever `device` (dvi's engine moves it beside the target, vLLM copies its
        tensors). Its shared embedding is the target's when `target` holds weights (on the meta device it keeps its
        own, which vLLM never reads); its smoke test a forward on zero features, which must give finite logits."""
        e = checked.fields
        embed = target.get_input_embeddings().weight
        try:
            eagle3.check_vocab_maps(checked.weights["d2t"], checked.weights["t2d"])
            drafter = eagle3.Eagle3Drafter(checked.config, e["draft_vocab_size"], e["layer_ids"],
                                           None if embed.is_meta else embed.detach().cpu(), e["target_hidden_size"],
                                           e["norm_before_residual"])
            drafter.load_state_dict(checked.weights, strict=False)  # all but the shared embedding, as checked
        except Exception as err:
            raise Refused("load", f"drafter {version} at {checked.path} does not load: {type(err).__name__}: {str(err)[:300]}") from None
        drafter.version = version
        drafter.to(dtype).eval()
        check_finite(drafter, version)
        try:
            with torch.inference_mode():
                ids = torch.tensor([SMOKE_PROMPT])
                logits, _ = drafter(torch.zeros(1, len(SMOKE_PROMPT), checked.config.hidden_size, dtype=dtype), ids)
        except Exception as err:
            raise Refused("smoke", f"drafter {version}: smoke forward failed: {type(err).__name__}: {str(err)[:300]}") from None
        if not bool(torch.isfinite(logits).all()):
            raise Refused("smoke", f"drafter {version}: non-finite logits in a smoke forward")
        return drafter

    def refuse_other(self, version: str, other: DrafterKind) -> Refused:
        return Refused("load", f"drafter {version} is {other.description}, not an EAGLE-3 drafter (no speculators_model_type "
                               "eagle3): a server started with an EAGLE-3 drafter (vLLM's method eagle3) serves EAGLE-3 "
                               "versions only")

    def feature_layers(self, drafter) -> tuple[int, ...]:
        return tuple(_eagle(drafter).layer_ids)

    def check_target(self, drafter, target_config) -> None:
        """Its aux layers are the target's and its fc reads the target's width."""
        model, tc = _eagle(drafter), target_config
        if model.target_hidden_size != tc.hidden_size or not all(0 <= i <= tc.num_hidden_layers for i in model.layer_ids):
            raise DviError(f"EAGLE-3 drafter {drafter.version!r} reads aux layers {list(model.layer_ids)} of width "
                           f"{model.target_hidden_size}; the target has layers 0..{tc.num_hidden_layers} of width {tc.hidden_size}")

    def draft_model(self, drafter) -> tuple[torch.nn.Module, torch.Tensor | None]:
        if isinstance(drafter, Drafter):
            return drafter.model, drafter.vocab_map
        return drafter, eagle3.target_ids(drafter.d2t)

    def place(self, drafter, device: torch.device) -> None:
        """A bare `Eagle3Drafter`, loaded on the CPU (`load_version`), moves to the target's device."""
        if not isinstance(drafter, Drafter) and drafter.fc.weight.device != device:
            drafter.to(device)

    draft_cache = FeatureKV

    def greedy_drafts(self, drafter, ids, n, target=None) -> list[int]:
        if target is None:
            raise DviError("an EAGLE-3 drafter drafts from its target's features: give the target")
        return eagle3.greedy_drafts(_eagle(drafter), target, ids, n)

    def check_vllm(self, drafter, vocab_size: int) -> None:
        """For this vocabulary (vLLM maps its reduced head with its d2t)."""
        vocab = int(_eagle(drafter).config.vocab_size)
        if vocab != vocab_size:
            raise DviError(f"EAGLE-3 drafter {drafter.version!r} is for a vocabulary of {vocab}, the target has {vocab_size}")

    def vllm_shape(self, drafter) -> dict[str, object]:
        """Its tensors' shapes, which target layers feed it and where its norm sits."""
        e = _eagle(drafter)
        return {"kind": self.name, "layer_ids": tuple(e.layer_ids), "norm_before_residual": e.norm_before_residual,
                **{k: tuple(v.shape) for k, v in e.weights().items()}}

    def vllm_shape_text(self, drafter) -> str:
        e = _eagle(drafter)
        return f"aux layers {list(e.layer_ids)}, a draft vocabulary of {e.draft_vocab_size} or other shapes"

    def vllm_load_args(self, drafter) -> tuple:
        """Its checkpoint tensors (`Eagle3Drafter.weights`: vLLM's eagle3 `load_weights` names; d2t stays int64, the
        embedding is the target's), flagged as an EAGLE-3 drafter's."""
        return ({k: v.float() if v.is_floating_point() else v for k, v in _eagle(drafter).weights().items()}, True)


KINDS: dict[str, DrafterKind] = {k.name: k for k in (Eagle3Kind(), LayersKind())}  # layers last: any causal LM's config is its


def kind_of(name: str) -> DrafterKind:
    """The kind called `name`; DviError naming the known kinds for another name."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise DviError(f"unknown drafter kind {name!r}: dvi knows {', '.join(sorted(KINDS))}") from None


def kind_of_dir(path: str | Path) -> DrafterKind:
    """The kind of the drafter directory at `path` (`dvi.models.drafter_kind`)."""
    return kind_of(drafter_kind(path))


def kind_of_config(raw: dict) -> DrafterKind | None:
    """The kind whose config.json `raw` is (None: no kind's)."""
    return next((k for k in KINDS.values() if k.owns_config(raw)), None)


def _eagle(drafter) -> eagle3.Eagle3Drafter:
    """The EAGLE-3 drafter itself, served bare or held by a `Drafter` (its model)."""
    return drafter.model if isinstance(drafter, Drafter) else drafter


# ----------------------------------------------------------------------------------------------
# Checks of a version's config and tensors that the kinds share.


def same_config(config, family, own: frozenset, what: str, version: str) -> None:
    """Refused("config") unless `config` equals `family` but for the fields of `own`, metadata and private keys."""
    mine, theirs = config.to_dict(), family.to_dict()
    differ = sorted(k for k in set(mine) | set(theirs)
                    if k not in own and k not in METADATA_FIELDS and not k.startswith("_") and mine.get(k) != theirs.get(k))
    if differ:
        raise Refused("config", f"drafter {version}: its config differs from {what} in {differ[:5]} "
                                f"(a version may differ only in {sorted(own)})")


def read_weights(files: dict[str, bytes], version: str, head: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(weights, the reduced head where `head`) read from a version's files, or Refused("load")."""
    try:
        return (safetensors.torch.load(files[WEIGHTS]), safetensors.torch.load(files[DRAFT_HEAD]) if head else None)
    except Exception as e:  # a missing or unreadable weights file
        raise Refused("load", f"drafter {version}: its weights do not read: {type(e).__name__}: {str(e)[:300]}") from None


def check_shapes(expected: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor], optional: set[str],
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


def check_finite(model: torch.nn.Module, version: str) -> None:
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise Refused("nonfinite", f"drafter {version}: non-finite weights in {bad[:3]}{' ...' if len(bad) > 3 else ''}")


# ----------------------------------------------------------------------------------------------
# A layer drafter's version.


def _hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter of the causal LM `config` describes, from the meta device (no memory, no init)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}


def _build(config, weights: dict[str, torch.Tensor], head: dict[str, torch.Tensor] | None, vocab: int, version: str,
           head_where: str) -> Drafter:
    """The drafter made of exactly these (checked) tensors. No random initialisation first (half the time of a
    swap on the CPU): every parameter is overwritten, as `check_shapes` made sure."""
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
