"""The speculative decoding loop over Hugging Face causal LMs, for a continuously refilled batch of requests.

Each round: the drafter proposes K tokens (one cached forward each), the target verifies all of them plus
a bonus position in one forward, `dvi.speculative.rejection_sample` decides how many are accepted, and
both KV caches are rolled back to the accepted length. Rows of a batch accept different numbers of tokens;
rather than copying caches to re-align them, a rejected slot stays in the cache as a masked "hole"
(see `dvi.kv.BatchKV`) and holes are squeezed out when they grow. A request joins a running batch between rounds (its
prompt is prefilled beside the others' verification, every existing slot a hole for it) and leaves it in the
round it finishes (`Decoding`). Greedy decoding is the temperature-0 case of the same rule and returns
exactly the target's greedy tokens.

The drafter is a layer drafter (a causal LM over the target's vocabulary or part of it) or an EAGLE-3 drafter
(`dvi.eagle3`), which drafts from the target's own features: the verify forward records the target's aux hidden
states, and each position the target kept is queued for the drafter beside the token after it. What a drafter's cache
is fed and keeps is its kind's (`dvi.kv.DraftKV`, `dvi.kv.FeatureKV`): the loop asks it, and branches on no kind.

Adaptive K picks each row's K from its measured acceptance and a cost table measured on this machine
(`dvi.planner.CostTable`: verify seconds per K and batch bucket, drafter step seconds; a start-up warm-up, then moving
averages of live rounds; `dvi.planner.KController` per row); a row whose drafts keep failing decodes plainly and
probes now and then. Every tensor
of a round lives on the target's device; the random draws come from per-request CPU generators, so a seeded
request repeats on any device. There is no static KV cache and no CUDA graph here (yet): the CPU and CUDA run
the same code.

`SpeculativeEngine` is a `dvi.engine_api.Engine` and its `Decoding` a `Batch`: per-round statistics and the target's
top-k log-probs are returned as data (`Round`, `SpecStats`, `Result`, all `dvi.engine_api`'s); this module does not
know where they go (streams, MLflow, /metrics), nor about tokenization or text.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from transformers import PreTrainedModel

from dvi.config import SpecConfig
from dvi.drafter_kinds import kind_of
from dvi.eagle3 import Eagle3Drafter, aux_hidden_states
from dvi.engine_api import LogProb, Request, Result, Round, SpecStats, TimedSteps, TokenHook, check_request
from dvi.errors import DviError
from dvi.features import Captured
from dvi.kv import Accepted, BatchKV, DraftKV
from dvi.models import Drafter
from dvi.planner import CostTable, KController, Routing
from dvi.speculative import ban_tokens, expand_draft_probs, logits_to_probs, rejection_sample, sample_from


# ----------------------------------------------------------------------------------------------
# The engine.


class SpeculativeEngine:
    """Decode requests with a target and (optionally) a drafter, in a continuously refilled batch.

    `generate` decodes a list of requests, at most `max_batch` at a time: a finished row leaves at once and the
    next request joins at the following round boundary. A server drives the same `Decoding` (see `decoding()`)
    itself, adding requests as they arrive. `drafter` may be replaced at any time by `swap_drafter`; the
    switch takes effect between rounds (a round never mixes two drafters), and the new drafter starts from a
    fresh cache fed each row's sequence so far. With no drafter the engine decodes plainly (K = 0).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None,
        spec: SpecConfig,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        max_batch: int = 8,
        features_layers=None,
    ):
        """`features_layers`: the target layers whose aux hidden states each request's Result carries (`Result.features`,
        what records send to a trainer of EAGLE-3 drafters); None: an EAGLE-3 drafter's own while one drafts, else none."""
        self.target = target
        self.features_layers = None if features_layers is None else tuple(sorted(int(i) for i in features_layers))
        self.device = next(target.parameters()).device  # every tensor of a round lives here; random draws come from CPU generators
        self._drafter = drafter
        self._lock = threading.Lock()
        self._abort = threading.Event()  # set by abort(): decoding stops at the next round boundary
        self.spec = spec
        self.stop_ids = frozenset(stop_ids)
        self.max_batch = max_batch
        self.vocab_size = int(target.config.vocab_size)
        self.window = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        if drafter is not None:
            self.check_drafter(drafter)
            _to_device(drafter, self.device)
        self.costs = CostTable(spec)
        self._routing: list[tuple[Routing, list[int] | None]] = []  # per-request routing decisions (take_routing)

    # -- drafter pointer --------------------------------------------------------------------------

    @property
    def drafter(self) -> Drafter | None:
        with self._lock:
            return self._drafter

    def abort(self) -> None:
        """Stop decoding for good (shutdown): a round about to start raises DviError instead, so the decoding
        thread is out of the model's code before the process exits."""
        self._abort.set()

    def swap_drafter(self, drafter: Drafter | None) -> None:
        """Install a new drafter; decoding picks it up at the next round boundary."""
        if drafter is not None:
            self.check_drafter(drafter)
            _to_device(drafter, self.device)
        with self._lock:
            self._drafter = drafter

    def close(self) -> None:
        """Nothing to release: the models are plain modules, freed with their last reference."""

    def take_load_failures(self) -> list[tuple[str, str]]:
        """Drafters swapped in that the engine failed to load: none here (a swap replaces a pointer)."""
        return []

    def take_routing(self) -> list[tuple[Routing, list[int] | None]]:
        """The speculation routing decisions of requests (drafting off, on again, probes) since the last call; each
        request plans its own K here, so there is no engine-wide schedule (None)."""
        with self._lock:
            out, self._routing = self._routing, []
        return out

    def check_drafter(self, drafter: Drafter | Eagle3Drafter) -> None:
        """DviError unless this engine can draft with `drafter`: its vocabulary is the target's, and an EAGLE-3 drafter
        reads features the target has (its aux layers, the target's width)."""
        model, _ = draft_model(drafter)
        if int(model.config.vocab_size) != self.vocab_size:
            raise DviError(
                f"drafter {drafter.version!r} has vocabulary size {model.config.vocab_size}, "
                f"the target has {self.vocab_size}"
            )
        kind_of(drafter.kind).check_target(drafter, self.target.config)

    # -- requests ---------------------------------------------------------------------------------

    def check_request(self, r: Request) -> None:
        check_request(r, self.window, self.vocab_size)

    def decoding(self) -> Decoding:
        """An empty running batch of this engine: `add` requests, `step` rounds."""
        return Decoding(self)

    @torch.inference_mode()
    def generate(self, requests: list[Request], on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Result]:
        """Decode `requests`, at most `max_batch` at a time (a finished row's slot goes to the next request at the
        following round). `on_tokens(i, ids)`, if given, is called on the decoding thread after every round with
        the tokens request i gained in it (for streaming)."""
        for r in requests:
            self.check_request(r)
        results: list[Result | None] = [None] * len(requests)
        waiting = list(range(len(requests)))
        batch = self.decoding()
        while waiting or batch.size:
            while waiting and batch.size < self.max_batch:
                i = waiting.pop(0)
                batch.add(requests[i], key=i, on_tokens=(lambda ids, _, i=i: on_tokens(i, ids)) if on_tokens is not None else None)
            for i, result in batch.step():
                results[i] = result
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def warm_up(self, reps: int = 1, context: int = 32) -> dict:
        """Measure the cost table at batch 1 (`CostTable`): verify forwards of K + 1 tokens for K = 0..k_max and
        drafter steps, on a `context`-token sequence, `reps` times each, interleaved; the median is kept. Returns
        the table (`CostTable.to_dict`)."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(min(context, self.window - self.spec.k_max - 2))]
        tgt = BatchKV([ids[:-1]], self.device)
        tgt.forward(self.target, None, keep=1)
        drafter = self.drafter
        model, _ = draft_model(drafter) if drafter is not None else (None, None)
        dft = draft_cache_type(drafter).fresh(model, [ids[:-1]], self.device)
        if model is not None:
            dft.forward(model, None, keep=1)
        greedy = torch.zeros(1, device=self.device)
        samples: dict[int, list[float]] = {}
        for rep in range(reps + 1):  # the first pass warms the shapes up and is not kept
            for k in range(self.spec.k_max + 1):
                extra = torch.tensor([ids[-k:] if k else []], dtype=torch.long, device=self.device).view(1, k)
                tgt.pending = [[ids[-1]]]
                t0 = _now(self.device)
                logits_to_probs(tgt.forward(self.target, extra, keep=k + 1), greedy, greedy + 1)
                if rep:
                    samples.setdefault(k, []).append(_now(self.device) - t0)
                tgt.keep_last(torch.zeros(1, k + 1, dtype=torch.bool, device=self.device))
            if model is not None:
                dft.pending = [[]]
                dft.feed(0, [ids[-1]])
                t0 = _now(self.device)
                logits_to_probs(dft.forward(model, None, keep=1)[:, -1], greedy, greedy + 1)
                if rep:
                    samples.setdefault(-1, []).append(_now(self.device) - t0)
                dft.keep_last(torch.zeros(1, 1, dtype=torch.bool, device=self.device))
        for k, xs in samples.items():
            if k < 0:
                self.costs.draft[1] = statistics.median(xs)
            else:
                self.costs.verify[(1, k)] = statistics.median(xs)
        return self.costs.to_dict()

    def _draft(
        self, model, vocab_map: torch.Tensor | None, dft: BatchKV, kmax: int, temp: torch.Tensor, top_p: torch.Tensor,
        u_draft: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose kmax tokens per row with a drafter's `model` (`draft_model`). Returns draft ids [B, Kmax] (target
        ids) and q [B, Kmax, V]."""
        drafts, qs = [], []
        logits = dft.forward(model, None, keep=1)[:, -1]  # [B, Vd]
        for j in range(kmax):
            q_j = logits_to_probs(logits, temp, top_p)  # [B, Vd]
            d = sample_from(q_j, u_draft[:, j])  # [B] drafter-vocabulary ids
            if vocab_map is not None:
                d = vocab_map[d]
            drafts.append(d)
            qs.append(q_j)
            if j < kmax - 1:
                logits = dft.forward(model, d.unsqueeze(1), keep=1)[:, -1]
        q = expand_draft_probs(torch.stack(qs, 1), vocab_map, self.vocab_size)  # [B, Kmax, V]
        return torch.stack(drafts, 1), q


def draft_model(drafter: Drafter | Eagle3Drafter) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """What drafts for `drafter`, and the target ids of its output rows (None: all of them): a layer drafter's
    causal LM, or an EAGLE-3 drafter, bare (`dvi.swap.load_announced`) or held by a `Drafter` (`DrafterKind.draft_model`)."""
    return kind_of(drafter.kind).draft_model(drafter)


def draft_cache_type(drafter: Drafter | Eagle3Drafter | None) -> type[DraftKV]:
    """The cache `drafter`'s kind drafts with (`DrafterKind.draft_cache`); with no drafter, one that is never fed."""
    return kind_of(drafter.kind).draft_cache if drafter is not None else DraftKV


def _layers_of(states: torch.Tensor, hooked, layers) -> torch.Tensor:
    """The part of aux hidden states [..., len(hooked) x hidden] (layers `hooked`, ascending) that `layers` name, in
    ascending order: [..., len(layers) x hidden]."""
    want = sorted(set(int(i) for i in layers))
    if want == list(hooked):
        return states
    parts = states.unflatten(-1, (len(hooked), -1))
    return parts[..., [list(hooked).index(i) for i in want], :].flatten(-2)


def _to_device(drafter: Drafter | Eagle3Drafter, device: torch.device) -> None:
    """A bare EAGLE-3 drafter, loaded on the CPU, moves to the target's device (a layer drafter is loaded there)."""
    kind_of(drafter.kind).place(drafter, device)


def _emitted_logprobs(log_p: torch.Tensor, emitted: list[int], n_top: int) -> list[LogProb]:
    """log_p [J, V] of one row's round: for emitted token j, its log-prob and the `n_top` most likely (id, log-prob)."""
    j = torch.arange(len(emitted), device=log_p.device)
    chosen = log_p[j, torch.tensor(emitted, device=log_p.device)].tolist()
    top_lp, top_ids = log_p[: len(emitted)].topk(n_top, -1) if n_top else (log_p.new_zeros(len(emitted), 0),) * 2
    return [(c, list(zip(map(int, i), lp))) for c, i, lp in zip(chosen, top_ids.tolist(), top_lp.tolist())]


def _now(device: torch.device) -> float:
    """A clock read after the device's queued work (CUDA kernels run asynchronously; the CPU needs no wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class _Row:
    """One request in a running batch."""

    key: object  # the caller's handle, returned with the result
    req: Request
    on_tokens: TokenHook | None
    budget: int  # tokens it may generate (max_new_tokens, clipped by the context window)
    gen: torch.Generator
    ctrl: KController
    start: float
    out: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    versions: list[str] = field(default_factory=list)
    finish: str = ""
    cancelled: str = ""  # set by Decoding.cancel from any thread: the row leaves at the next round boundary
    captured: Captured = field(default_factory=Captured)  # the target's features of its positions (features_layers)
    timed: TimedSteps = field(default_factory=TimedSteps)  # its steady rounds against target-only decoding

    def result(self) -> Result:
        r = self.req
        rows, start, counts = self.captured.assemble(len(r.prompt_ids) + len(self.out) - 1)  # the last token: never fed
        return Result(r.request_id, list(r.prompt_ids), self.out, self.finish, self.versions, self.rounds, self.stats,
                      time.perf_counter() - self.start, rows, start, self.captured.layers,
                      counts["missing"] if self.captured.parts else 0, counts["recomputed"],
                      self.timed.timed_tokens, self.timed.target_only_tokens)


@dataclass
class _Verified:
    """What a round's verify forward gave (`Decoding._verify`)."""

    logits: torch.Tensor  # [B, Kmax + 1, V] the target's, at each drafted and the bonus position
    fed: list[list[int]]  # each row's tokens fed before its drafts
    layers: tuple[int, ...] | None = None  # the aux layers the Results carry (None: none)
    aux: torch.Tensor | None = None  # [B, Q, len(layers) x hidden] their states at every fed position, drafts included
    features: torch.Tensor | None = None  # [B, Q, hidden] the serving EAGLE-3 drafter's fused features of the same


class Decoding:
    """A running batch of one engine: rows join between rounds (`add`), `step()` runs one round and returns the
    rows that finished in it, whose slots are free at once. Used from one thread (the decoding thread), except
    `cancel`, which any thread may call."""

    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        self.rows: list[_Row] = []
        self.tgt = BatchKV([], engine.device)
        self._use(engine.drafter, [])

    def _use(self, drafter: Drafter | Eagle3Drafter | None, rows: list[_Row]) -> None:
        """Draft with `drafter` from the next round, from a fresh cache of its kind resumed on each of `rows`' sequence
        so far (`DraftKV.resume`: what the target has fed of each is known)."""
        self.drafter = drafter
        self.model, self.vocab_map = draft_model(drafter) if drafter is not None else (None, None)
        seqs = [r.req.prompt_ids + r.out for r in rows]
        seen = [len(seq) - len(self.tgt.pending[b]) for b, seq in enumerate(seqs)]  # tokens the target has fed
        self.dft: DraftKV = draft_cache_type(drafter).resume(self.model, self.engine.target, seqs, seen, self.engine.device)

    @property
    def size(self) -> int:
        return len(self.rows)

    def add(self, req: Request, key: object = None, on_tokens: TokenHook | None = None) -> None:
        """Join the batch; the request is prefilled in the next round, beside the others' verification."""
        e = self.engine
        e.check_request(req)
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        budget = min(req.max_new_tokens, e.window - len(req.prompt_ids))
        self.rows.append(_Row(key, req, on_tokens, budget, torch.Generator().manual_seed(seed), KController(e.spec), time.perf_counter()))
        self.tgt.add_rows([req.prompt_ids])
        self.dft.add_rows([req.prompt_ids])  # a cache of target features: nothing to feed until the target has seen it

    def cancel(self, key: object, reason: str = "abort") -> bool:
        """End the row of `key` at the next round boundary (a client went away, a stop string was seen): `step`
        returns its result so far with finish reason `reason`. False if no row has that key (finished or unknown)."""
        for r in list(self.rows):  # a snapshot: the decoding thread replaces the list, never mutates it
            if r.key is key or r.key == key:
                r.cancelled = reason
                return True
        return False

    def _leave(self, keep: list[int]) -> None:
        """Keep only the rows `keep`: the others' slots are free for the next round."""
        self.rows = [self.rows[b] for b in keep]
        if self.rows:
            self.tgt.select(keep)
            self.dft.select(keep)
        else:
            self.tgt = BatchKV([], self.engine.device)
            self._use(self.drafter, [])  # empty caches of the same drafter

    def _take_cancelled(self) -> list[tuple[object, Result]]:
        gone = [b for b, r in enumerate(self.rows) if r.cancelled]
        if not gone:
            return []
        out = []
        for b in gone:
            r = self.rows[b]
            r.finish = r.cancelled
            out.append((r.key, r.result()))
        self._leave([b for b, r in enumerate(self.rows) if not r.cancelled])
        return out

    @torch.inference_mode()
    def step(self) -> list[tuple[object, Result]]:
        """One round for every row: plan, draft, verify, accept, roll back, emit. Returns (key, result) of the rows that
        finished (cancelled rows first: they leave before the round)."""
        cancelled = self._take_cancelled()
        e, rows = self.engine, self.rows
        if not rows:
            return cancelled
        if e._abort.is_set():
            raise DviError("decoding was aborted: the server is shutting down")
        current = e.drafter  # one drafter for the whole round
        if current is not self.drafter:  # hot-swapped: the new drafter starts from a fresh cache
            self._use(current, rows)
        batch, device = len(rows), e.device
        ks = self._plan()
        kmax = max(ks)
        temp = torch.tensor([r.req.temperature for r in rows], dtype=torch.float32, device=device)  # [B]
        top_p = torch.tensor([r.req.top_p for r in rows], dtype=torch.float32, device=device)  # [B]
        u_draft, u_accept, u_sample = self._draws(ks, kmax)
        # a round whose rows feed only their last token is a representative cost (a prefill is not)
        steady_tgt = max(len(p) for p in self.tgt.pending) == 1
        steady_dft = self.dft.steady(e.spec.k_max)

        timing = e.spec.cost_ratio is None  # fixed costs: nothing to measure
        t0 = _now(device) if timing else 0.0
        draft_ids = torch.zeros(batch, 0, dtype=torch.long, device=device)  # [B, Kmax]
        q = torch.zeros(batch, 0, e.vocab_size, device=device)  # [B, Kmax, V]
        if kmax:
            draft_ids, q = e._draft(self.model, self.vocab_map, self.dft, kmax, temp, top_p, u_draft)
        t1 = _now(device) if timing else 0.0
        verified = self._verify(draft_ids, kmax)
        n, token, log_p, top = self._accept(verified.logits, draft_ids, q, ks, temp, top_p, u_accept, u_sample)
        n_list, token_list = n.tolist(), token.tolist()  # the round's one read of the accepted counts
        if timing:
            t2 = time.perf_counter()  # after the .tolist() above: the device is done
            if steady_tgt:
                e.costs.observe_verify(batch, kmax, t2 - t1)
            if kmax and steady_dft:
                e.costs.observe_draft(batch, kmax, t1 - t0)
            if steady_tgt and (not kmax or steady_dft):  # a decoding round's yield (`CostTable.speed_vs_target_only`)
                e.costs.observe_rate(batch, kmax > 0, sum(n_list) + batch, t2 - t0)
                share = e.costs.target_only_tokens(batch, t2 - t0)  # each row's, against target-only decoding
                for row, accepted in zip(rows, n_list):
                    row.timed.add(accepted + 1, share)
        drafted = draft_ids.tolist()
        self._roll_back(verified, draft_ids, drafted, n, n_list, token_list)
        return cancelled + self._emit(ks, drafted, n_list, token_list, log_p, top)

    def _plan(self) -> list[int]:
        """Each row's K for this round, by its own `KController` and the engine's cost table, never past its budget; 0
        for a row its drafter's cache cannot draft for yet (`DraftKV.ready`: an EAGLE-3 drafter's, before its prefill). The routing decisions
        the rows took are queued for the engine (`take_routing`)."""
        e, batch = self.engine, len(self.rows)
        c, verify_cost = e.costs.plan(batch)
        measured = e.costs.measured
        ks, routed = [], []
        for b, r in enumerate(self.rows):
            ready = self.drafter is not None and self.dft.ready(b)
            k = r.ctrl.next_k(len(r.out), c, verify_cost, measured) if ready else 0
            ks.append(max(0, min(k, r.budget - len(r.out) - 1)))  # never draft past the budget
            if self.drafter is not None and r.ctrl.routed is not None:
                routed.append((replace(r.ctrl.routed, batch=batch), None))
        if routed:
            with e._lock:
                e._routing.extend(routed)
        return ks

    def _draws(self, ks: list[int], kmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's uniforms on the engine's device: (drafting [B, Kmax], accepting [B, Kmax], the final sample [B]).
        Each row draws 2 k + 1 from its own generator, however long the other rows draft, so a seeded request samples
        the same tokens alone or in any batch; drafts past its k use u = 0 (ignored)."""
        batch = len(self.rows)
        u_draft, u_accept, u_sample = torch.zeros(batch, kmax), torch.zeros(batch, kmax), torch.zeros(batch)
        for b, (r, kb) in enumerate(zip(self.rows, ks)):
            u = torch.rand(2 * kb + 1, generator=r.gen)
            u_draft[b, :kb], u_accept[b, :kb], u_sample[b] = u[:kb], u[kb : 2 * kb], u[-1]
        return tuple(u.to(self.engine.device) for u in (u_draft, u_accept, u_sample))

    def _verify(self, draft_ids: torch.Tensor, kmax: int) -> _Verified:
        """The target's forward over each row's pending tokens and its drafts, keeping the logits of the last Kmax + 1
        positions, and the aux hidden states of every fed position that the drafter's cache (`DraftKV.reads`) and the
        Results' features (`features_layers`; by default the drafter's) read."""
        e, reads = self.engine, self.dft.reads
        fed = [list(p) for p in self.tgt.pending]  # the tokens this forward feeds before the drafts
        layers = e.features_layers if e.features_layers is not None else (reads or None)
        hooked = sorted(set(layers or ()) | set(reads))
        if not hooked:
            return _Verified(self.tgt.forward(e.target, draft_ids, keep=kmax + 1), fed)  # [B, Kmax + 1, V]
        with aux_hidden_states(e.target, hooked) as aux:
            logits = self.tgt.forward(e.target, draft_ids, keep=kmax + 1)
            hooked_states = aux()  # [B, Q, len(hooked) x hidden]: each fed position's, drafts included
        return _Verified(logits, fed, layers,
                         aux=_layers_of(hooked_states, hooked, layers) if layers is not None else None,
                         features=self.dft.fuse(_layers_of(hooked_states, hooked, reads)) if reads else None)

    def _accept(self, logits: torch.Tensor, draft_ids: torch.Tensor, q: torch.Tensor, ks: list[int], temp: torch.Tensor,
                top_p: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor):
        """The rejection sampler over the target's distributions (stop tokens banned before a row's `min_tokens`):
        (accepted counts [B], the token after each row's accepted prefix [B], the target's log-probs [B, Kmax + 1, V] where
        the records or a request want them else None, their (top-k log-probs, ids) where the records want them else None)."""
        e, rows = self.engine, self.rows
        early = [min(r.req.min_tokens, r.budget) - len(r.out) for r in rows]  # positions of this round before min_tokens
        warped = logits if max(early) <= 0 or not e.stop_ids else ban_tokens(logits, sorted(e.stop_ids), early)
        p = logits_to_probs(warped, temp, top_p)  # [B, Kmax + 1, V]
        k_row = torch.tensor(ks, device=e.device)  # [B]
        n, token = rejection_sample(draft_ids, q, p, k_row, u_accept, u_sample)  # [B], [B]
        log_p = top = None
        if e.spec.topk_logprobs or any(r.req.logprobs is not None for r in rows):
            log_p = torch.log_softmax(logits.float(), -1)  # [B, Kmax + 1, V]
        if e.spec.topk_logprobs:
            top = log_p.topk(e.spec.topk_logprobs, -1)  # ([B, Kmax + 1, topk] log-probs, ids)
        return n, token, log_p, top

    def _roll_back(self, v: _Verified, draft_ids: torch.Tensor, drafted: list[list[int]], n: torch.Tensor, n_list: list[int],
                   token_list: list[int]) -> None:
        """Both caches back to each row's accepted prefix (the rejected drafts become holes), the token after it pending
        for the next round; each row's kept positions' features captured for its Result."""
        j = torch.arange(1, draft_ids.shape[1] + 1, device=self.engine.device)
        self.tgt.keep_last(j.unsqueeze(0) <= n.unsqueeze(1))  # slots of d_1..d_Kmax
        self.tgt.pending = [[t] for t in token_list]
        width = max(len(f) for f in v.fed)
        if v.layers is not None:  # each row's kept positions: the tokens it fed, then its accepted drafts
            for b, r in enumerate(self.rows):
                first = len(r.req.prompt_ids) + len(r.out) - len(v.fed[b])
                r.captured.add(first, v.aux[b, width - len(v.fed[b]) : width + n_list[b]].clone(), v.layers)
        self.dft.roll_back(Accepted(drafted, n, n_list, token_list, v.fed, v.features))

    def _emit(self, ks: list[int], drafted: list[list[int]], n_list: list[int], token_list: list[int],
              log_p: torch.Tensor | None, top) -> list[tuple[object, Result]]:
        """Each row's Round, its tokens (up to a stop token or its budget) streamed to its hook, and its K controller
        told; the rows that finished leave, their (key, Result) returned."""
        e, drafter = self.engine, self.drafter
        finished, keep = [], []
        for b, r in enumerate(self.rows):
            nb, kb = n_list[b], ks[b]
            version = drafter.version if drafter is not None and kb else None
            if version and (not r.versions or r.versions[-1] != version):
                r.versions.append(version)
            r.rounds.append(
                Round(
                    position=len(r.out),
                    k=kb,
                    drafted=drafted[b][:kb],
                    accepted=nb,
                    token=token_list[b],
                    drafter_version=version,
                    topk_ids=top[1][b, : kb + 1].clone() if top is not None else None,
                    topk_logprobs=top[0][b, : kb + 1].clone() if top is not None else None,
                    logprobs=_emitted_logprobs(log_p[b], drafted[b][:nb] + [token_list[b]], r.req.logprobs)
                    if r.req.logprobs is not None else None,
                )
            )
            r.stats.add(kb, nb)
            r.ctrl.observe(kb, nb)
            before = len(r.out)
            stops = () if r.req.ignore_eos else e.stop_ids
            for t in drafted[b][:nb] + [token_list[b]]:
                r.out.append(t)
                if t in stops:
                    r.finish = "stop"
                    break
                if len(r.out) >= r.budget:
                    r.finish = "length"
                    break
            if r.on_tokens is not None and len(r.out) > before:
                emitted = r.rounds[-1].logprobs
                r.on_tokens(r.out[before:], None if emitted is None else emitted[: len(r.out) - before])
            if r.finish:
                finished.append((r.key, r.result()))
            else:
                keep.append(b)
        if len(keep) < len(self.rows):  # finished rows leave now: their slots are free for the next round
            self._leave(keep)
        self.tgt.compact()
        self.dft.compact()
        return finished
