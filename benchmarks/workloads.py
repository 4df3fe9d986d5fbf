"""Workloads of the benchmarks: prompts from distinct domains, built offline from real text, deterministic from a
seed. `benchmarks.drift` replays them; the soak (`benchmarks.soak`) sends them as its traffic.

Four domains, three written from the Python standard library that every installation carries and one from the
READMEs the installed packages ship (mined by `dvi.corpus`, which builds `dvi drafter bootstrap`'s corpus from the same
text), and one (`UNCOVERED`) that the bootstrap corpus has nothing of:

- `code`: the signature and docstring of a real stdlib function, sent raw; the model continues with its body;
- `prose`: the opening sentences of a paragraph from the documentation topics (`pydoc_data.topics`, the text
  behind `help('with')`), sent raw; the model continues the prose;
- `qa`: a question or instruction written from those texts (what a module is for, what a statement does,
  explain a passage), sent through the chat template; the model answers as an assistant;
- `markdown`: a section of an installed package's README (the Markdown long description in its METADATA): its
  heading and the first sentence or two under it, sent raw; the model continues the README (install commands,
  usage, code blocks), text of another register and format than the other three;
- `math` (not in the bootstrap corpus): arithmetic word problems written from templates with numbers drawn from a
  fixed seed, sent through the chat template with "solve it step by step"; the model answers with its working. The
  traffic a drafter trained on the other four has not seen: what the online loop must learn from live traffic alone.

A pool per domain is shuffled with the seed and cut into disjoint splits (`bootstrap`, `live`, `eval`), so an
offline bootstrap never sees the prompts that live traffic replays. Every prompt carries its domain tag, which
a serving replica puts into its DecisionRecords and per-domain metrics.

This module knows prompts; it knows nothing about tokenizers, models or HTTP (`Prompt.body()` is the request body an
OpenAI-compatible server takes). Nothing in dvi imports it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dvi.corpus import MAX_PROMPT_CHARS, doc_topics, module_summaries, paragraphs, readme_sections, sentences, stdlib_functions
from dvi.errors import DviError

DOMAINS = ("code", "prose", "qa", "markdown")  # what the bootstrap corpus (dvi.corpus) covers
UNCOVERED = ("math",)  # what it does not
ALL_DOMAINS = DOMAINS + UNCOVERED
SPLITS = {"bootstrap": 0.3, "live": 0.6, "eval": 0.1}  # shares of each shuffled pool, in this order


@dataclass(frozen=True)
class Prompt:
    domain: str
    text: str
    chat: bool  # True: a user message through the chat template; False: raw text to continue

    def body(self, max_tokens: int, **extra) -> dict:
        """The JSON body for /v1/chat/completions (chat) or /v1/completions (raw), tagged with the domain."""
        base = {"max_tokens": max_tokens, "temperature": 0, "dvi": {"domain": self.domain}, **extra}
        if self.chat:
            return {"messages": [{"role": "user", "content": self.text}], **base}
        return {"prompt": self.text, **base}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


# ----------------------------------------------------------------------------------------------
# the pools


def _code_pool() -> list[Prompt]:
    return [Prompt("code", f.head, chat=False) for f in stdlib_functions()]


def _prose_pool() -> list[Prompt]:
    out = []
    for _, body in doc_topics():
        for para in paragraphs(body):
            text = sentences(para, 2)
            if 80 <= len(text) <= MAX_PROMPT_CHARS:
                out.append(Prompt("prose", text, chat=False))
    return out


QA_TOPIC = ["What does the Python documentation topic '{key}' cover? Explain it briefly for a beginner.",
            "In Python, explain '{key}' in a few sentences, with one small example."]
QA_MODULE = ["What is the Python standard library module `{mod}` for? Its documentation says: \"{doc}\" "
             "Explain in your own words when you would use it.",
             "Give a short overview of Python's `{mod}` module. It is described as: \"{doc}\""]
QA_PASSAGE = ["Read this passage from the Python documentation and summarize it in one or two sentences:\n\n{text}",
              "Here is a passage from the Python reference:\n\n{text}\n\nWhat is the main point, in plain words?"]


def _qa_pool() -> list[Prompt]:
    out = []
    for i, (key, body) in enumerate(doc_topics()):
        out.append(Prompt("qa", QA_TOPIC[i % 2].format(key=key.replace("-", " ")), chat=True))
        paras = paragraphs(body)
        if paras:
            out.append(Prompt("qa", QA_PASSAGE[i % 2].format(text=sentences(paras[-1], 2)), chat=True))
    for i, (mod, doc) in enumerate(module_summaries()):
        out.append(Prompt("qa", QA_MODULE[i % 2].format(mod=mod, doc=doc), chat=True))
    return out


def _markdown_pool() -> list[Prompt]:
    return [Prompt("markdown", text, chat=False) for _, text in readme_sections() if len(text) <= MAX_PROMPT_CHARS]


MATH = ["{name} buys {a} boxes of {b} pencils and gives away {d} pencils. How many pencils are left? Solve it step by step.",
        "A train travels {a} km in {b} hours. At the same speed, how far does it travel in {e} hours? Solve it step by step.",
        "{name} saves {a} dollars a week for {b} weeks, then spends {d} dollars. How much is left? Solve it step by step.",
        "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter? Solve it step by step.",
        "A class of {a} students splits into groups of {b}. How many full groups are there, and how many students are "
        "left over? Solve it step by step.",
        "{name} reads {a} pages a day. The book has {c} pages. How many days does it take to finish it? Solve it step by step.",
        "A shop sells a shirt for {c} dollars with a {b}0% discount. What is the price after the discount? "
        "Solve it step by step.",
        "What is {a} times {b}, plus {c}? Solve it step by step.",
        "{name} is {b} years old. {name}'s mother is {a} years older. How old will the mother be in {c} years? "
        "Solve it step by step."]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mira", "Noor", "Omar",
         "Priya", "Raul", "Sara", "Tom", "Yuki"]


def _math_pool(n: int = 600) -> list[Prompt]:
    rng = random.Random("math-pool")  # the pool itself is fixed; a workload's seed only shuffles it
    out = []
    for i in range(n):
        a, b = rng.randint(3, 60), rng.randint(2, 9)  # d: less than a * b (what is given away or spent)
        values = dict(name=rng.choice(NAMES), a=a, b=b, c=rng.randint(20, 400), d=rng.randint(1, a * b - 1), e=rng.randint(2, 12))
        out.append(Prompt("math", MATH[i % len(MATH)].format(**values), chat=True))
    return out


POOLS = {"code": _code_pool, "prose": _prose_pool, "qa": _qa_pool, "markdown": _markdown_pool, "math": _math_pool}


def split_bounds(n: int, split: str) -> tuple[int, int]:
    """[start, end) of `split` in a pool of n prompts (SPLITS' shares, in order; the last split takes the rest)."""
    if split not in SPLITS:
        raise DviError(f"unknown workload split {split!r}: expected one of {', '.join(SPLITS)}")
    names, start = list(SPLITS), 0
    for name in names:
        end = n if name == names[-1] else start + round(n * SPLITS[name])
        if name == split:
            return start, end
        start = end
    raise AssertionError("unreachable")


def prompts(domain: str, split: str = "live", seed: int = 0) -> list[Prompt]:
    """The `split` of `domain`'s pool, shuffled with `seed`: the same list for the same arguments on the same Python."""
    if domain not in POOLS:
        raise DviError(f"unknown workload domain {domain!r}: expected one of {', '.join(ALL_DOMAINS)}")
    pool = list({p.text: p for p in POOLS[domain]() if len(p.text) <= MAX_PROMPT_CHARS}.values())  # each text once
    random.Random(f"{domain}:{seed}").shuffle(pool)
    start, end = split_bounds(len(pool), split)
    return pool[start:end]


def cycle(items: list[Prompt]):
    """The prompts over and over (a phase may need more requests than a split has)."""
    if not items:
        raise DviError("an empty workload cannot be replayed")
    while True:
        yield from items
