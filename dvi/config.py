"""Typed configuration: frozen dataclasses, validated on construction, composed by Hydra from conf/.

Entry points call `load_config(overrides)` once and pass the typed objects down; nothing below the
entry point reads raw config. Each dataclass mirrors one Hydra group in conf/. This module knows the
shape of the configuration, not what the parts do with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dvi.errors import DviError

CONF_DIR = Path(os.environ.get("DVI_CONF_DIR", Path(__file__).resolve().parent.parent / "conf"))


def _check(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise DviError(f"invalid value {key}={value!r}: expected {expected}")


@dataclass(frozen=True)
class ModelConfig:
    """Which target / drafter pair to load. Null paths mean the demo pair, fetched into the cache."""

    target: str | None = None
    drafter: str | None = None
    drafter_layers: int = 2  # demo drafter: target embeddings, first L layers, final norm, head
    drafter_vocab: int | None = None  # demo drafter: reduced head over the N most frequent tokens (None = full)
    cache_dir: str | None = None  # None: $DVI_CACHE or ~/.cache/dvi
    dtype: str = "float32"
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default

    def __post_init__(self) -> None:
        _check(self.drafter_layers >= 1, "model.drafter_layers", self.drafter_layers, "an integer >= 1")
        _check(self.drafter_vocab is None or self.drafter_vocab >= 2, "model.drafter_vocab", self.drafter_vocab, "null or >= 2")
        _check(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype", self.dtype, "float32, bfloat16 or float16")
        _check(self.threads >= 0, "model.threads", self.threads, "an integer >= 0")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation: how many tokens to draft, and when to stop drafting."""

    k: int = 4  # drafts per round when adaptive is off, and the starting K when it is on
    adaptive: bool = True
    k_min: int = 1
    k_max: int = 8
    min_speedup: float = 1.0  # below this predicted speedup a request decodes plainly
    probe_every: int = 32  # plain tokens before a switched-off request tries drafting again
    prior_acceptance: float = 0.5  # per-token acceptance assumed before any round is seen
    prior_weight: float = 4.0  # ... worth this many trials
    decay: float = 0.9  # per-round decay of the acceptance counts (recent rounds weigh more)
    cost_ratio: float | None = None  # drafter step / target step; None: measured online
    verify_slope: float = 0.12  # verifying k+1 tokens costs (1 + slope * k) target steps
    topk_logprobs: int = 8  # target top-k log-probs kept per drafted and bonus position (0 = none)

    def __post_init__(self) -> None:
        _check(self.k >= 1, "serve.spec.k", self.k, "an integer >= 1 (K < 1 drafts nothing)")
        _check(1 <= self.k_min <= self.k_max, "serve.spec.k_min/k_max", (self.k_min, self.k_max), "1 <= k_min <= k_max")
        _check(self.k_min <= self.k <= self.k_max or not self.adaptive, "serve.spec.k", self.k, "within [k_min, k_max]")
        _check(self.min_speedup > 0, "serve.spec.min_speedup", self.min_speedup, "> 0")
        _check(self.probe_every >= 1, "serve.spec.probe_every", self.probe_every, ">= 1")
        _check(0 < self.prior_acceptance < 1, "serve.spec.prior_acceptance", self.prior_acceptance, "in (0, 1)")
        _check(self.prior_weight > 0, "serve.spec.prior_weight", self.prior_weight, "> 0")
        _check(0 < self.decay <= 1, "serve.spec.decay", self.decay, "in (0, 1]")
        _check(self.cost_ratio is None or self.cost_ratio > 0, "serve.spec.cost_ratio", self.cost_ratio, "null or > 0")
        _check(self.verify_slope >= 0, "serve.spec.verify_slope", self.verify_slope, ">= 0")
        _check(self.topk_logprobs >= 0, "serve.spec.topk_logprobs", self.topk_logprobs, ">= 0")


@dataclass(frozen=True)
class SamplingConfig:
    """Default sampling parameters of a request. Temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.max_new_tokens, "serve.sampling.")


def check_sampling(temperature: float, top_p: float, max_new_tokens: int, prefix: str = "") -> None:
    import math

    _check(math.isfinite(temperature) and temperature >= 0, f"{prefix}temperature", temperature, "a finite number >= 0 (0 = greedy)")
    _check(math.isfinite(top_p) and 0 < top_p <= 1, f"{prefix}top_p", top_p, "a number in (0, 1]")
    _check(isinstance(max_new_tokens, int) and max_new_tokens >= 1, f"{prefix}max_new_tokens", max_new_tokens, "an integer >= 1")


@dataclass(frozen=True)
class ServeConfig:
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_batch: int = 8  # requests decoded together

    def __post_init__(self) -> None:
        _check(self.max_batch >= 1, "serve.max_batch", self.max_batch, "an integer >= 1")


@dataclass(frozen=True)
class DviConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


def load_config(overrides: list[str] | None = None, config_name: str = "config") -> DviConfig:
    """Compose conf/<config_name>.yaml with Hydra overrides and build the typed, validated config."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not CONF_DIR.is_dir():
        raise DviError(f"config directory {str(CONF_DIR)!r} not found; set DVI_CONF_DIR")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name=config_name, overrides=list(overrides or []))
        schema = OmegaConf.structured(DviConfig)
        _writable(schema)  # frozen dataclasses make read-only nodes; the merge needs to write them
        return OmegaConf.to_object(OmegaConf.merge(schema, raw))
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).strip().splitlines()[0]
        raise DviError(f"bad config: {msg}") from e


def _writable(node) -> None:
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
