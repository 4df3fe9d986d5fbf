"""Text that every Python installation carries, mined into prompts: the bootstrap corpus of `dvi drafter bootstrap`.

No network: the raw material is the standard library's own source and docstrings (functions with a docstring, the
first sentence of each public module's docstring), the documentation topics behind `help('with')`
(`pydoc_data.topics`), and the Markdown READMEs that installed packages ship in their METADATA. `benchmarks.workloads`
builds its replayed traffic from the same miners.

The bootstrap corpus (`bootstrap_prompts`) turns them into the requests a server of an instruct model meets, in four
domains: `code` (write, explain or continue a real stdlib function), `prose` (summarize, simplify or continue a
documentation passage), `qa` (what a module or a language topic is for) and `markdown` (continue or write a README
section). Most are chat messages, some raw text to continue, as completions traffic is. Every prompt names its
source (`stdlib:json`, `topic:with`, `pypi:requests`), and the held-out split is by source: no held-out prompt shares
a module, topic or package with a training prompt, so held-out acceptance measures what the drafter learned of the
target rather than of the text. `manifest` says what a corpus holds (sources, counts per domain and split, sha256).

This module knows text and prompts; it knows nothing about tokenizers, models, records or training.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import random
import re
import sys
import sysconfig
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from dvi.errors import DviError

MAX_PROMPT_CHARS = 600  # the longest raw prompt the miners keep (a signature and docstring, two sentences)
MAX_SOURCE_CHARS = 1200  # the longest function a chat prompt quotes whole
DOMAINS = ("code", "prose", "qa", "markdown")
SPLITS = ("train", "heldout")
HELDOUT_SHARE = 0.1  # sources (not prompts) held out


# ----------------------------------------------------------------------------------------------
# the raw material


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=1)
def doc_topics() -> tuple[tuple[str, str], ...]:
    """(topic, text) of the documentation topics (`pydoc_data.topics`), sorted by topic."""
    try:
        from pydoc_data import topics
    except ImportError as e:  # some distributions strip it
        raise DviError("the documentation topics (pydoc_data) are missing from this Python: prose and question "
                       "prompts are built from them") from e
    return tuple(sorted(topics.topics.items()))


def paragraphs(body: str) -> list[str]:
    """Prose paragraphs of a topic: no code samples, grammar productions or tables; whitespace joined."""
    out = []
    for block in re.split(r"\n\s*\n", body):
        lines = block.splitlines()
        if not lines or any(l.startswith((" ", "\t", ">>>", "...")) for l in lines) or "::=" in block or "|" in block:
            continue
        text = " ".join(l.strip() for l in lines)
        if len(text) >= 160 and text[0].isupper() and text.count(" ") >= 25:
            out.append(text)
    return out


def sentences(text: str, n: int) -> str:
    """The first `n` sentences of `text`."""
    parts = re.split(r"(?<=[.!?])\s+", text)
    return " ".join(parts[:n])


@dataclass(frozen=True)
class Function:
    """A stdlib function with a docstring: `head` is its source from `def` through the docstring, then a new line at
    the body's indentation (so what follows is its code); `source` the whole function (dedented); `summary` the
    docstring's first sentence."""

    module: str
    name: str
    head: str
    source: str
    summary: str


@lru_cache(maxsize=1)
def stdlib_functions() -> tuple[Function, ...]:
    """Functions with a docstring and a body of three statements or more, from the stdlib's top-level modules, in
    file order; heads of 40 to MAX_PROMPT_CHARS characters."""
    out = []
    for f in sorted(stdlib_dir().glob("*.py")):
        src = f.read_text(errors="ignore")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("__") or len(node.body) < 3:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            head = lines[start:doc.end_lineno]
            indent = lines[doc.lineno - 1][: len(lines[doc.lineno - 1]) - len(lines[doc.lineno - 1].lstrip())]
            base = len(head[0]) - len(head[0].lstrip())
            text = "\n".join(l[base:] for l in head) + "\n" + indent[base:]
            if 40 <= len(text) <= MAX_PROMPT_CHARS:
                source = "\n".join(l[base:] for l in lines[start:node.end_lineno])
                summary = " ".join(sentences(doc.value.value.strip().split("\n\n")[0], 1).split())
                out.append(Function(f.stem, node.name, text, source, summary))
    return tuple(out)


@lru_cache(maxsize=1)
def module_summaries() -> tuple[tuple[str, str], ...]:
    """(module, first sentence of its docstring) for public stdlib modules."""
    out = []
    for f in sorted(stdlib_dir().glob("*.py")):
        if f.stem.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(errors="ignore")))
        except SyntaxError:
            continue
        if doc:
            first = " ".join(sentences(doc.split("\n\n")[0], 1).split())
            if 20 <= len(first) <= 240:
                out.append((f.stem, first))
    return tuple(out)


@lru_cache(maxsize=1)
def readme_sections() -> tuple[tuple[str, str], ...]:
    """(distribution, "## heading" + the first sentences under it) from the Markdown READMEs of the installed
    packages, in the order of their names."""
    out = []
    dists = sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
    for dist in dists:
        if "markdown" not in (dist.metadata.get("Description-Content-Type") or "").lower():
            continue
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        for m in re.finditer(r"(?m)^(#{2,3} [^\n]{3,80})\n\n([A-Z][^\n]{60,})", body):
            text = f"{m.group(1).strip()}\n\n{sentences(m.group(2).strip(), 2)}"
            if "<" not in text and "](" not in text:  # no HTML, no links: prose the model can continue
                out.append((dist.metadata["Name"], text))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# the bootstrap corpus


@dataclass(frozen=True)
class CorpusPrompt:
    """One request of the bootstrap corpus: a chat message (`chat`) or raw text to continue, from `source`."""

    id: str  # sha256 of domain, chat and text, 16 hex digits: stable across runs and machines
    domain: str
    source: str
    split: str
    chat: bool
    text: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CorpusPrompt:
        try:
            p = cls(**{k: d[k] for k in ("id", "domain", "source", "split", "chat", "text")})
        except (KeyError, TypeError) as e:
            raise DviError(f"a corpus line is not a prompt ({e}): {str(d)[:120]}") from None
        if p.domain not in DOMAINS or p.split not in SPLITS or not isinstance(p.text, str) or not p.text:
            raise DviError(f"corpus prompt {p.id}: domain, split or text out of range ({p.domain}, {p.split})")
        return p


def source_rank(source: str) -> float:
    """Where a source falls in [0, 1), by the sha256 of its name: the same on every machine."""
    return int.from_bytes(hashlib.sha256(source.encode()).digest()[:8], "big") / 2**64


def heldout_sources(prompts_per_source: dict[str, int], share: float = HELDOUT_SHARE) -> set[str]:
    """The held-out sources: in each family (`stdlib`, `topic`, `pypi`: the part of the name before ':'), sources in
    `source_rank` order until they hold `share` of the family's prompts. Whole sources, so a family whose prompts
    crowd into a few sources still gets its share."""
    out: set[str] = set()
    families: dict[str, list[str]] = {}
    for source in prompts_per_source:
        families.setdefault(source.split(":", 1)[0], []).append(source)
    for members in families.values():
        want, held = share * sum(prompts_per_source[s] for s in members), 0
        for source in sorted(members, key=source_rank):
            if held >= want:
                break
            out.add(source)
            held += prompts_per_source[source]
    return out


CODE_CHAT = ["Write a Python function `{name}` ({module} module style): {summary}",
             "Explain what this Python function does, step by step:\n\n```python\n{source}\n```",
             "Review this Python function: what could go wrong, and how would you test it?\n\n```python\n{source}\n```"]
PROSE_CHAT = ["Summarize this passage in two sentences:\n\n{text}",
              "Rewrite this paragraph in simpler words for a beginner:\n\n{text}",
              "Here is a passage from the Python reference:\n\n{text}\n\nWhat is the main point, in plain words?"]
QA_TOPIC = ["What does the Python documentation topic '{key}' cover? Explain it briefly for a beginner.",
            "In Python, explain '{key}' in a few sentences, with one small example."]
QA_MODULE = ["What is the Python standard library module `{mod}` for? Its documentation says: \"{doc}\" "
             "Explain in your own words when you would use it.",
             "Give a short overview of Python's `{mod}` module, with a small usage example. It is described as: \"{doc}\""]
MARKDOWN_CHAT = ["Write the next part of the README of the Python package {dist}, after this section:\n\n{text}"]


def _raw_prompts() -> list[tuple[str, str, bool, str]]:
    """(domain, source, chat, text) of every prompt the miners give, in a fixed order."""
    out: list[tuple[str, str, bool, str]] = []
    for i, f in enumerate(stdlib_functions()):
        source = f"stdlib:{f.module}"
        out.append(("code", source, False, f.head))
        if f.summary and len(f.summary) >= 20:
            out.append(("code", source, True, CODE_CHAT[0].format(name=f.name, module=f.module, summary=f.summary)))
        if len(f.source) <= MAX_SOURCE_CHARS:
            out.append(("code", source, True, CODE_CHAT[1 + i % 2].format(source=f.source)))
    for i, (key, body) in enumerate(doc_topics()):
        source = f"topic:{key}"
        out.append(("qa", source, True, QA_TOPIC[i % 2].format(key=key.replace("-", " "))))
        for j, para in enumerate(paragraphs(body)):
            text = sentences(para, 2)
            if 80 <= len(text) <= MAX_PROMPT_CHARS:
                out.append(("prose", source, False, text))
                out.append(("prose", source, True, PROSE_CHAT[(i + j) % len(PROSE_CHAT)].format(text=sentences(para, 4))))
    for i, (mod, doc) in enumerate(module_summaries()):
        out.append(("qa", f"stdlib:{mod}", True, QA_MODULE[i % 2].format(mod=mod, doc=doc)))
    for dist, text in readme_sections():
        if len(text) <= MAX_PROMPT_CHARS:
            source = f"pypi:{dist.lower()}"
            out.append(("markdown", source, False, text))
            out.append(("markdown", source, True, MARKDOWN_CHAT[0].format(dist=dist, text=text)))
    return out


def prompt_id(domain: str, chat: bool, text: str) -> str:
    return hashlib.sha256(json.dumps([domain, chat, text]).encode()).hexdigest()[:16]


def bootstrap_prompts(n: int | None = None, seed: int = 0, heldout_share: float = HELDOUT_SHARE,
                      shares: dict[str, float] | None = None) -> list[CorpusPrompt]:
    """The bootstrap corpus: every mined prompt once, each with its source's split, shuffled with `seed`; with `n`, at
    most n of them, domains in `shares` (default: equal) where the pool allows, the held-out split in proportion."""
    raw = {prompt_id(d, chat, text): (d, source, chat, text) for d, source, chat, text in reversed(_raw_prompts())}
    held = heldout_sources(Counter(source for _, source, _, _ in raw.values()), heldout_share)
    seen = {pid: CorpusPrompt(pid, d, source, "heldout" if source in held else "train", chat, text)
            for pid, (d, source, chat, text) in raw.items()}
    every = sorted(seen.values(), key=lambda p: p.id)
    random.Random(f"bootstrap:{seed}").shuffle(every)
    if n is None or n >= len(every):
        return every
    shares = shares or {d: 1.0 for d in DOMAINS}
    total = sum(shares.values())
    by_domain = {d: [p for p in every if p.domain == d] for d in DOMAINS}
    want = {d: int(n * shares.get(d, 0.0) / total) for d in DOMAINS}
    short = sum(max(0, want[d] - len(by_domain[d])) for d in DOMAINS)  # a small pool's shortfall goes to the others
    for d in sorted(DOMAINS, key=lambda d: len(by_domain[d]) - want[d], reverse=True):
        extra = min(short, len(by_domain[d]) - want[d])
        if extra > 0:
            want[d], short = want[d] + extra, short - extra
    keep = {p.id for d in DOMAINS for p in by_domain[d][: want[d]]}
    return [p for p in every if p.id in keep]


def write_corpus(prompts: list[CorpusPrompt], path: Path) -> dict:
    """The prompts as JSON lines at `path`; returns their manifest."""
    path.write_text("".join(json.dumps(p.to_dict(), sort_keys=True) + "\n" for p in prompts))
    return manifest(prompts, path)


def read_corpus(path: Path) -> list[CorpusPrompt]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(CorpusPrompt.from_dict(json.loads(line)))
            except (json.JSONDecodeError, DviError) as e:
                raise DviError(f"{path}:{n}: {e}") from None
    return out


def manifest(prompts: list[CorpusPrompt], path: Path | None = None) -> dict:
    """What a corpus holds: prompts per domain and split, sources per split, the sha256 of the prompts file (and of each
    source's prompts), and the Python it was mined from."""
    counts = Counter((p.domain, p.split) for p in prompts)
    sources: dict[str, dict] = {}
    for p in sorted(prompts, key=lambda p: p.id):
        s = sources.setdefault(p.source, {"split": p.split, "prompts": 0, "sha": hashlib.sha256()})
        s["prompts"] += 1
        s["sha"].update(p.id.encode())
    return {
        "prompts": len(prompts),
        "by_domain": {d: {s: counts[(d, s)] for s in SPLITS} for d in DOMAINS},
        "chat_share": round(sum(p.chat for p in prompts) / max(1, len(prompts)), 3),
        "sources": {s: sum(1 for v in sources.values() if v["split"] == s) for s in SPLITS},
        "heldout_sources": sorted(k for k, v in sources.items() if v["split"] == "heldout"),
        "source_sha256": {k: {"prompts": v["prompts"], "sha256": v["sha"].hexdigest()[:16]} for k, v in sorted(sources.items())},
        "file_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None,
        "mined_from": {"python": sys.version.split()[0], "stdlib": str(stdlib_dir()),
                       "distributions_with_readmes": len({d for d, _ in readme_sections()})},
    }
