"""What every serving engine shares: the request it decodes, the rounds and result it returns, and the interface the
replica drives (`Engine`, and its running batch, `Batch`).

Two engines implement it: dvi's own over Hugging Face models (`dvi.engine.SpeculativeEngine`) and vLLM's engine core
(`dvi.cli.vllm.engine.VllmEngine`), so that the replica's API, decision records, hot swaps, live judge and metrics
are one code for both. An engine verifies drafts and reports every decision as data (`Round`: drafted ids, accepted
count, the target's token and top-k log-probs; `Result`: a finished request's rounds, tokens and, where the engine
keeps them, the target's features); this module does not know how an engine decodes, nor where its results go.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from dvi.config import check_sampling
from dvi.errors import DviError

if TYPE_CHECKING:
    from dvi.eagle3 import Eagle3Drafter
    from dvi.models import Drafter
    from dvi.planner import CostTable, Routing


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: fresh entropy; an int makes a sampled run repeat exactly (with fixed K)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    logprobs: int | None = None  # the log-prob of each emitted token and this many top alternatives (Round.logprobs)
    ignore_eos: bool = False  # the engine's stop ids do not end generation (fixed-length benchmark requests)
    min_tokens: int = 0  # the stop ids cannot be generated before this many tokens (their target probability is 0)


MAX_LOGPROBS = 20  # the most alternatives a request may ask for (as OpenAI's API)


def check_request(r: Request, window: int, vocab_size: int, window_name: str = "the target's context window") -> None:
    """DviError unless an engine whose context holds `window` tokens can decode `r`."""
    if not r.prompt_ids:
        raise DviError("empty prompt: give at least one token")
    if len(r.prompt_ids) >= window:
        raise DviError(f"prompt of {len(r.prompt_ids)} tokens does not fit {window_name} of {window}")
    if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab_size:
        raise DviError(f"prompt token ids must be in [0, {vocab_size})")
    check_sampling(r.temperature, r.top_p, r.max_new_tokens)
    if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
        raise DviError(f"logprobs must be in [0, {MAX_LOGPROBS}] alternatives, got {r.logprobs}")
    if not 0 <= r.min_tokens <= r.max_new_tokens:
        raise DviError(f"min_tokens must be in [0, max_new_tokens={r.max_new_tokens}], got {r.min_tokens}")


LogProb = tuple[float, list[tuple[int, float]]]  # an emitted token's log-prob and its top alternatives (id, log-prob)
# streaming: called on the decoding thread after every round with the tokens a request gained in it, and their
# LogProbs if the request asked for them (else None)
TokenHook = Callable[[list[int], "list[LogProb] | None"], None]


@dataclass
class Round:
    """One verification decision for one request."""

    position: int  # tokens generated before this round
    k: int  # drafts that counted (0: decoded plainly)
    drafted: list[int]  # [k] drafted target ids
    accepted: int  # 0..k
    token: int  # the target's token after the accepted prefix: recovered (accepted < k) or bonus
    drafter_version: str | None
    topk_ids: torch.Tensor | None = None  # [k + 1, topk] target's top-k ids at each drafted and the bonus position
    topk_logprobs: torch.Tensor | None = None  # [k + 1, topk] their log-probs (temperature 1, unwarped)
    # for a request that asked for them: per emitted token (accepted drafts, then `token`), its log-prob and the
    # top alternatives as (id, log-prob), from the same unwarped distribution
    logprobs: list[LogProb] | None = None


@dataclass
class SpecStats:
    """Counts over rounds; mean accepted length counts the recovered / bonus token (see dvi.speculative)."""

    rounds: int = 0
    spec_rounds: int = 0  # rounds that drafted at least one token
    drafted: int = 0
    accepted: int = 0
    position_drafted: list[int] = field(default_factory=list)  # [j] rounds that drafted position j
    position_accepted: list[int] = field(default_factory=list)  # [j] rounds that accepted position j

    def add(self, k: int, n: int) -> None:
        self.rounds += 1
        self.spec_rounds += k > 0
        self.drafted += k
        self.accepted += n
        grow = k - len(self.position_drafted)
        if grow > 0:
            self.position_drafted += [0] * grow
            self.position_accepted += [0] * grow
        for j in range(k):
            self.position_drafted[j] += 1
            self.position_accepted[j] += j < n

    def merge(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.spec_rounds += other.spec_rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        for j, (d, a) in enumerate(zip(other.position_drafted, other.position_accepted)):
            if j >= len(self.position_drafted):
                self.position_drafted.append(0)
                self.position_accepted.append(0)
            self.position_drafted[j] += d
            self.position_accepted[j] += a

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per round, the recovered or bonus token included."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 6),
            "mean_accepted_length": round(self.mean_accepted_length, 6),
            "per_position_acceptance": [round(x, 6) for x in self.per_position_acceptance],
        }


@dataclass
class Result:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only (a stop token, if hit, is the last one)
    finish_reason: str  # "stop", "length", or the reason given to `Decoding.cancel` (e.g. "abort")
    drafter_versions: list[str]  # every drafter version that drafted for this request, in order
    rounds: list[Round]
    stats: SpecStats
    seconds: float
    # the target's aux hidden states (`dvi.features`) of positions features_start.. of prompt + token_ids, from the
    # forwards that verified them: [R, W], W = len(features_layers) x hidden; None where the engine kept none
    features: torch.Tensor | None = None
    features_start: int = 0
    features_layers: tuple[int, ...] = ()
    features_missing: int = 0  # positions fed before features_start that no forward gave (a prefix-cache hit)
    features_recomputed: int = 0  # rows a forward gave again (a preempted request recomputed)
    # its speed over target-only decoding, measured on its steady decoding steps (no prefill): the tokens those steps
    # emitted for it, and the tokens target-only decoding would have given it in the same seconds at the same batch
    # sizes (`dvi.planner.CostTable.target_only_tokens`); 0 and 0.0 where no step was timed against a measured rate
    timed_tokens: int = 0
    target_only_tokens: float = 0.0

    @property
    def vs_target_only(self) -> float | None:
        """Tokens per second over target-only decoding's on its timed steps (> 1: speculation paid); None: untimed."""
        return self.timed_tokens / self.target_only_tokens if self.target_only_tokens > 0 else None


@dataclass
class TimedSteps:
    """A request's steady decoding steps timed against target-only decoding, as its engine adds them up (the two
    `Result` fields of the same names)."""

    timed_tokens: int = 0
    target_only_tokens: float = 0.0

    def add(self, tokens: int, target_only: float | None) -> None:
        """A step emitted `tokens` for the request where target-only decoding would have given it `target_only`
        (`CostTable.target_only_tokens`; None: unmeasured at that batch size, and the step says nothing)."""
        if target_only:
            self.timed_tokens += tokens
            self.target_only_tokens += target_only


class Batch(Protocol):
    """An engine's running batch: requests join between steps (`add`), `step()` decodes one step of every request in it
    and returns the (key, Result) of those that finished; `cancel` ends one from any thread."""

    @property
    def size(self) -> int: ...

    def add(self, req: Request, key: object = None, on_tokens: TokenHook | None = None) -> None: ...

    def step(self) -> list[tuple[object, Result]]: ...

    def cancel(self, key: object, reason: str = "abort") -> bool: ...


class Engine(Protocol):
    """What the replica asks of an engine: the target it serves (its model, or a skeleton where another process holds
    the weights) on `device`, its vocabulary and context window, the cost table its K policy measures, the serving
    drafter and the checks and swap of a new one, and a running batch to decode in."""

    target: torch.nn.Module
    device: torch.device
    vocab_size: int
    window: int
    costs: CostTable

    @property
    def drafter(self) -> Drafter | Eagle3Drafter | None: ...

    def check_request(self, r: Request) -> None:
        """DviError unless this engine can decode `r`."""

    def check_drafter(self, drafter: Drafter | Eagle3Drafter) -> None:
        """DviError unless this engine can draft with `drafter`."""

    def swap_drafter(self, drafter: Drafter | Eagle3Drafter | None) -> None:
        """Install a new drafter; it drafts from the next step on (no step mixes two drafters)."""

    def take_load_failures(self) -> list[tuple[str, str]]:
        """(version, reason) of each drafter swapped in that the engine failed to load since the last call."""

    def take_routing(self) -> list[tuple[Routing, list[int] | None]]:
        """The K policy's routing decisions since the last call."""

    def decoding(self) -> Batch:
        """A running batch of this engine, which the replica's decode thread steps (an engine that another loop steps,
        `VllmEngine` inside vLLM's own server, has none)."""

    def abort(self) -> None:
        """Stop decoding for good (shutdown): the next step raises DviError."""

    def close(self) -> None:
        """Release what the engine holds."""


class FollowedEngine(Engine, Protocol):
    """An engine that another loop steps (`dvi.cli.vllm.engine.VllmEngine` inside vLLM's own server): instead of a
    running batch, it hands the replica each request that loop starts (`adopt(request, domain, arrived)` -> (key,
    token hook)) and each Result as its request finishes (`on_finish(key, result)`); the replica sets both."""

    adopt: Callable[[Request, str | None, float], tuple[object, TokenHook]] | None
    on_finish: Callable[[object, Result], None] | None
