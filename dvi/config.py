"""Typed configuration: frozen dataclasses, validated on construction, composed by Hydra from conf/.

Entry points call `load_config(overrides_of(args))` once and pass the typed objects down; nothing below the
entry point reads raw config. Each dataclass mirrors one Hydra group in conf/ and checks its own fields;
`DviConfig` checks the values that must agree across groups. This module knows the shape of the
configuration, not what the parts do with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dvi.drafter_kind_names import EAGLE3, KIND_NAMES
from dvi.errors import DviError
from dvi.hardware import CPU_PRIORITIES

_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
CORE_LIST = re.compile(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*")  # "0", "0-3,8": cores, as Linux's cpu lists

def _conf_dir() -> Path:
    """$DVI_CONF_DIR; else a checkout's conf/ beside dvi/; else the copy a wheel ships as dvi/conf."""
    if os.environ.get("DVI_CONF_DIR"):
        return Path(os.environ["DVI_CONF_DIR"])
    here = Path(__file__).resolve().parent
    checkout = here.parent / "conf"
    return checkout if (checkout / "config.yaml").is_file() else here / "conf"


CONF_DIR = _conf_dir()


def default_cache_dir() -> Path:
    """Where dvi keeps models, keys, logs and the local stores unless configured: $DVI_CACHE or ~/.cache/dvi."""
    return Path(os.environ.get("DVI_CACHE", Path.home() / ".cache" / "dvi"))


def cache_dir(model) -> Path:
    """The cache of a `ModelConfig`: `model.cache_dir`, or $DVI_CACHE (default ~/.cache/dvi)."""
    return Path(model.cache_dir).expanduser() if model.cache_dir else default_cache_dir()


SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path): vLLM's engine makes its sockets in the temporary folder


def scratch_dir() -> Path | None:
    """<cache>/tmp, made if missing: the temporary folder of dvi's processes and of everything they start (vLLM's
    sockets and distributed-init files, the logs of a broker's and MLflow's own processes), so a stack writes nothing
    outside its cache. None where that path leaves no room for a socket's name (36 characters) under it."""
    folder = default_cache_dir().expanduser() / "tmp"
    if len(os.fsencode(str(folder))) + 1 + 36 > SOCKET_PATH_MAX:
        return None
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def keys_dir(cfg: StreamConfig) -> Path:
    """The control channel's keys folder: `stream.keys_dir`, or <cache>/keys."""
    return Path(cfg.keys_dir).expanduser() if cfg.keys_dir else default_cache_dir() / "keys"


def mlflow_root(cfg: TrackingConfig) -> Path:
    """The local MLflow server's folder (database, artifacts, login): `tracking.root`, or <cache>/mlflow."""
    return Path(cfg.root).expanduser() if cfg.root else default_cache_dir() / "mlflow"


def _check(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise DviError(f"invalid value {key}={value!r}: expected {expected}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# trainer.lr=auto: the learning rate from an untrained drafter, and from a trained one. Measured on a domain the shipped
# drafter was not trained on (benchmarks/results/adapt_lr-math-cpu.json, 4 minutes, about 30 steps each): 3e-4 took
# its held-out acceptance from 0.37 to 0.46 and then refused candidates that forgot the bootstrap's domains; 1e-4 to
# 0.49 within the gate's guard; 3e-5 to 0.45
LR_UNTRAINED, LR_TRAINED = 3e-4, 1e-4


def learning_rate(lr: float | int | str, untrained: bool) -> float:
    """trainer.lr as the optimizer takes it: a number as given; auto by whether the starting drafter is untrained."""
    if lr != "auto":
        return float(lr)
    return LR_UNTRAINED if untrained else LR_TRAINED


INIT_DRAFTER = "init"  # model.drafter=init: the demo pair's untrained drafter, built from the target, not the one dvi ships


@dataclass(frozen=True)
class ModelConfig:
    """Which target / drafter pair to load. Null paths mean the demo pair, fetched into the cache."""

    target: str | None = None
    drafter: str | None = None  # None: the demo drafter (for the demo target's EAGLE-3: the shipped bootstrap); "init": untrained
    drafter_kind: str = EAGLE3  # demo drafter: eagle3 (dvi.eagle3) or layers (the target's first layers and head)
    drafter_layers: int = 2  # demo layer drafter: target embeddings, first L layers, final norm, head
    drafter_vocab: int | None = None  # demo drafter: reduced head over the N most frequent tokens (None = full; eagle3: 8192)
    cache_dir: str | None = None  # None: $DVI_CACHE or ~/.cache/dvi
    device: str = "auto"  # auto (CUDA when present, else CPU), cpu, cuda or cuda:N; target and drafters go there
    dtype: str = "auto"  # auto (bfloat16 on CUDA and on CPUs with native bf16, else float32), float32, bfloat16 or float16
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default

    def __post_init__(self) -> None:
        _check(self.drafter_kind in KIND_NAMES, "model.drafter_kind", self.drafter_kind, " or ".join(KIND_NAMES))
        _check(self.drafter_layers >= 1, "model.drafter_layers", self.drafter_layers, "an integer >= 1")
        _check(self.drafter_vocab is None or self.drafter_vocab >= 2, "model.drafter_vocab", self.drafter_vocab, "null or >= 2")
        _check(_DEVICE.fullmatch(str(self.device)) is not None, "model.device", self.device, "auto, cpu, cuda or cuda:N")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype", self.dtype, "auto, float32, bfloat16 or float16")
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
    cost_ratio: float | None = None  # drafter step / target step, with the linear verify model; None: measured
    # adaptive K plans with a cost table measured on this machine (dvi.planner.CostTable): a start-up warm-up
    # (`warmup_reps` timed forwards per K, 0 = none) refreshed from live rounds. cost_ratio fixes the costs instead.
    verify_slope: float = 0.12  # linear prior (with cost_ratio set: the model): verifying k+1 tokens costs 1 + slope * k steps
    warmup_reps: int = 1
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
        _check(self.warmup_reps >= 0, "serve.spec.warmup_reps", self.warmup_reps, "an integer >= 0 (0: no start-up measurement)")
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
    _check(math.isfinite(temperature) and temperature >= 0, f"{prefix}temperature", temperature, "a finite number >= 0 (0 = greedy)")
    _check(math.isfinite(top_p) and 0 < top_p <= 1, f"{prefix}top_p", top_p, "a number in (0, 1]")
    _check(isinstance(max_new_tokens, int) and max_new_tokens >= 1, f"{prefix}max_new_tokens", max_new_tokens, "an integer >= 1")


@dataclass(frozen=True)
class SwapConfig:
    """Hot-swap of published drafters into a running server, and the live check that keeps or rolls them back."""

    enabled: bool = True  # follow drafter_published messages on stream.control_topic
    store: str | None = None  # the only directory drafters are loaded from; null: trainer.store (<cache>/store)
    # at start: "production" (the newest version live traffic kept, else the newest never rejected), "latest" (the
    # newest never rejected), "none" (the configured drafter), or a version name
    initial: str = "production"
    smoke_tokens: int = 8  # greedy tokens of a smoke decode a new drafter must survive before it is swapped in
    window_tokens: int = 2048  # drafted tokens of live traffic before a swapped-in drafter is judged
    # roll back when its acceptance is this much below the previous drafter's, both at the depth both drafted to
    # (dvi.swap.compare: an adaptive planner drafts a new drafter at another K)
    rollback_margin: float = 0.05
    baseline_tokens: int = 256  # drafted tokens the previous drafter needs for a comparison (else: kept)

    def __post_init__(self) -> None:
        _check(self.smoke_tokens >= 1, "serve.swap.smoke_tokens", self.smoke_tokens, "an integer >= 1")
        _check(self.window_tokens >= 1, "serve.swap.window_tokens", self.window_tokens, "an integer >= 1")
        _check(0 <= self.rollback_margin <= 1, "serve.swap.rollback_margin", self.rollback_margin, "in [0, 1]")
        _check(self.baseline_tokens >= 1, "serve.swap.baseline_tokens", self.baseline_tokens, "an integer >= 1")
        _check(bool(self.initial), "serve.swap.initial", self.initial, "production, latest, none or a version name")


ENGINES = ("auto", "dvi", "vllm-server")
RETIRED_ENGINES = {"vllm": "serve.engine=vllm (vLLM's engine inside dvi's own HTTP server) is retired: serve.engine=vllm-server "
                           "serves with vLLM's own OpenAI server and dvi's loop as its plugin; dvi's own API stays on serve.engine=dvi"}


@dataclass(frozen=True)
class VllmConfig:
    """vLLM as the serving engine (serve.engine=vllm-server; dvi.cli.vllm.server): what dvi passes to vLLM's server."""

    max_model_len: int = 2048  # tokens of context per request (prompt and output)
    # no CUDA graphs or torch.compile: starts in seconds instead of minutes, decodes slower (compiled is the default;
    # its caches live under <cache>/compile, so a second start reuses them)
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.85  # share of the GPU vLLM may hold (weights and KV cache); GPU only
    cpu_kv_cache_gb: int = 2  # GiB of KV cache on the CPU build (VLLM_CPU_KVCACHE_SPACE, whole GiB)
    # vLLM's prefix cache shares draft KV blocks between requests: after a hot swap they would hold the previous
    # drafter's keys and values, so it is off unless asked for (drafts, never outputs, would suffer)
    prefix_caching: bool = False
    # the CPU cores vLLM's worker pins its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND; vLLM's own server, the default
    # engine): auto, every core, one thread each (vLLM's default: the fastest for a replica alone on its machine);
    # a list such as "0" or "0-3,8": these cores only, for every process of the replica (several replicas on one
    # machine: each its own cores); nobind: unpinned. Two engines pinned to one core starve each other (dvi.hardware.shared_cores)
    cpu_bind: str = "auto"

    def __post_init__(self) -> None:
        _check(self.max_model_len >= 16, "serve.vllm.max_model_len", self.max_model_len, "an integer >= 16")
        _check(0 < self.gpu_memory_utilization <= 1, "serve.vllm.gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        _check(self.cpu_kv_cache_gb >= 1, "serve.vllm.cpu_kv_cache_gb", self.cpu_kv_cache_gb, "a whole number of GiB >= 1")
        _check(self.cpu_bind in ("auto", "nobind") or CORE_LIST.fullmatch(self.cpu_bind) is not None,
               "serve.vllm.cpu_bind", self.cpu_bind, 'auto, nobind or a list of cores such as "0" or "0-3,8"')


@dataclass(frozen=True)
class ServeConfig:
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    # auto: vLLM where it is installed, else dvi's (dvi.hardware.pick_engine); dvi: dvi's own engine (dvi.engine) behind
    # dvi's own API; vllm-server: vLLM's own OpenAI server with dvi's loop as its plugin (vLLM's API; the same records,
    # swaps and tracking)
    engine: str = "auto"
    vllm: VllmConfig = field(default_factory=VllmConfig)
    max_batch: int = 8  # requests decoded together
    # the HTTP server (dvi serve)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the model name clients send and see; null: the target's directory name
    api_key: str | None = None  # null: $DVI_API_KEY, or serve.api_key_file, or no authentication (never on argv)
    api_key_file: str | None = None  # a file holding the API key (when neither api_key nor $DVI_API_KEY is set)
    max_queue: int = 64  # requests waiting for the engine; beyond it the server answers 503
    max_max_tokens: int = 2048  # the largest max_tokens a request may ask for
    max_connections: int = 256  # open HTTP connections and requests in flight; beyond it the server answers 503
    max_inflight_per_client: int = 16  # requests one client (API key, else address) may have in flight; 0: no cap; beyond: 429
    max_prompt_tokens: int = 0  # the longest prompt taken (tokens); 0: the context window less one; beyond: 400, and a
    # prompt too long in characters for this many tokens is refused before it is tokenized
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; a request from any other is a 403
    max_domains: int = 16  # domain tags tracked by name in metrics, MLflow and the plot; further ones count as "other"
    drain_s: float = 20.0  # on SIGTERM: how long requests in flight may take to finish; the rest end with an error
    log_decisions: bool = True  # send a DecisionRecord per request to stream.topic
    metrics_every_s: float = 15.0  # serving metrics to MLflow (a run per replica)
    plot_every_s: float = 120.0  # the drift plot artifact

    def __post_init__(self) -> None:
        _check(self.max_batch >= 1, "serve.max_batch", self.max_batch, "an integer >= 1")
        if self.engine in RETIRED_ENGINES:
            raise DviError(RETIRED_ENGINES[self.engine])
        _check(self.engine in ENGINES, "serve.engine", self.engine, " or ".join(ENGINES))
        _check(bool(str(self.host).strip()), "serve.host", self.host, "a host name or address")
        _check(0 <= self.port <= 65535, "serve.port", self.port, "a TCP port in [0, 65535] (0: any free port)")
        _check(self.served_model_name is None or bool(str(self.served_model_name).strip()), "serve.served_model_name",
               self.served_model_name, "null or a non-empty name")
        _check(self.api_key is None or len(str(self.api_key)) >= 8, "serve.api_key", "***", "null or at least 8 characters")
        _check(self.max_queue >= 1, "serve.max_queue", self.max_queue, "an integer >= 1")
        _check(self.max_max_tokens >= 1, "serve.max_max_tokens", self.max_max_tokens, "an integer >= 1")
        _check(self.max_connections >= 1, "serve.max_connections", self.max_connections, "an integer >= 1")
        _check(self.max_inflight_per_client >= 0, "serve.max_inflight_per_client", self.max_inflight_per_client, "an integer >= 0")
        _check(self.max_prompt_tokens >= 0, "serve.max_prompt_tokens", self.max_prompt_tokens, "an integer >= 0 (0: the context window)")
        _check(all(isinstance(o, str) and o.startswith(("http://", "https://")) for o in self.allowed_origins),
               "serve.allowed_origins", list(self.allowed_origins), "a list of origins such as https://app.example.com")
        _check(self.max_domains >= 1, "serve.max_domains", self.max_domains, "an integer >= 1")
        _check(self.drain_s >= 0, "serve.drain_s", self.drain_s, ">= 0 seconds")
        _check(self.metrics_every_s > 0, "serve.metrics_every_s", self.metrics_every_s, "> 0 seconds")
        _check(self.plot_every_s > 0, "serve.plot_every_s", self.plot_every_s, "> 0 seconds")


# kafka-python client options that may be passed through `stream.security` (the same for every client)
SECURITY_KEYS = frozenset(
    ["security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password", "sasl_kerberos_name",
     "sasl_kerberos_service_name", "sasl_kerberos_domain_name", "ssl_cafile", "ssl_certfile", "ssl_keyfile",
     "ssl_password", "ssl_check_hostname", "ssl_crlfile", "ssl_ciphers"]
)


@dataclass(frozen=True)
class FeaturesConfig:
    """The target's features a record carries (`dvi.features`), for trainers of EAGLE-3 drafters: with them a trainer
    needs no copy of the target. Serving sends them where it drafts with an EAGLE-3 drafter (its layers)."""

    share: float = 1.0  # of requests whose records carry them (a fixed function of the request id); 0: none
    # int8 (a scale per layer and token: half the bytes of bf16, 40% gzipped, and no loss of held-out acceptance at equal
    # positions trained, benchmarks/README.md) or bf16 (the target's values as computed)
    encoding: str = "int8"
    max_tokens: int = 256  # positions a record carries at most: its last ones (the trainer trains on that window)

    def __post_init__(self) -> None:
        _check(0 <= self.share <= 1, "stream.features.share", self.share, "a share of requests in [0, 1]")
        _check(self.encoding in ("bf16", "int8"), "stream.features.encoding", self.encoding, "bf16 or int8")
        _check(self.max_tokens >= 1, "stream.features.max_tokens", self.max_tokens, "an integer >= 1")


@dataclass(frozen=True)
class StreamConfig:
    """The decision stream: where records go (Kafka), how they are batched, and what they carry."""

    bootstrap_servers: str | None = None  # null: the embedded broker on 127.0.0.1:port
    port: int = 19092  # the embedded broker's port
    storage_engine: str | None = None  # embedded broker storage, e.g. s3://tansu/ (null: in memory)
    data_dir: str | None = None  # a durable embedded broker: its data as files in this folder (a local S3 store)
    # how long a durable embedded broker keeps the decision topic's records (Kafka's retention.ms, by when a batch was
    # written); null: for ever. Tansu's S3 engine keeps every batch, and the store's memory and each fetch grow with them
    retention_hours: float | None = 168.0
    topic: str = "dvi.decisions"
    dlq_topic: str = "dvi.decisions.dlq"
    control_topic: str = "dvi.control"
    partitions: int = 4  # of the decisions topic (the dead-letter and control topics have 1)
    replication_factor: int = 1
    queue_size: int = 10000  # records buffered in memory before the producer drops
    linger_ms: int = 20
    batch_bytes: int = 262144
    compression: str = "gzip"  # Kafka batch compression, the records' one compression layer: gzip or none
    # encoded DecisionRecord size bound (producer drops, consumer dead-letters); a record's features give up their
    # oldest rows to stay within it
    max_record_bytes: int = 1048576
    chunk_rounds: int = 64  # rounds per record; longer generations are split into chunks
    topk: int = 8  # teacher top-k log-probs per position to log (0 = none; <= serve.spec.topk_logprobs)
    logprob_dtype: str = "float16"
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    schema_id: int = 0  # the id a schema registry gave the record schema (`dvi stream schema`), in every record; 0: none
    delivery_timeout_ms: int = 10000  # a record not acknowledged by then is dropped and counted
    session_timeout_ms: int = 6000  # consumer groups (group joins take about half of it)
    # the longest a group member may go between two reads: a trainer step, gate and publish on a busy CPU can take
    # minutes, and a member past this leaves its group (its next commit fails, its next read starts over from the last commit);
    # kafka-python also sends it as the group's rebalance timeout (how long a join may wait for a member still reading)
    max_poll_interval_ms: int = 1800000
    replica_id: str | None = None  # null: <hostname>-<port> (dvi serve), <hostname>-<pid> (dvi generate)
    security: dict[str, Any] = field(default_factory=dict)  # passed to every Kafka client as is
    # control messages are signed (Ed25519, dvi.keys): the trainer's key publishes, the replicas' key gives verdicts
    control_auth: bool = True
    keys_dir: str | None = None  # the signing keys' folder; null: $DVI_CACHE/keys or ~/.cache/dvi/keys (made on first use)

    def __post_init__(self) -> None:
        _check(self.bootstrap_servers is None or bool(str(self.bootstrap_servers).strip()), "stream.bootstrap_servers",
               self.bootstrap_servers, "null (the embedded broker) or host:port[,host:port...]")
        _check(1 <= self.port <= 65535, "stream.port", self.port, "a TCP port in [1, 65535]")
        for key in ("topic", "dlq_topic", "control_topic"):
            name = getattr(self, key)
            _check(bool(_TOPIC.fullmatch(name or "")), f"stream.{key}", name, "a Kafka topic name ([A-Za-z0-9._-], 1..249 chars)")
        _check(len({self.topic, self.dlq_topic, self.control_topic}) == 3, "stream.dlq_topic/control_topic",
               (self.topic, self.dlq_topic, self.control_topic), "three different topics")
        _check(self.partitions >= 1, "stream.partitions", self.partitions, "an integer >= 1")
        _check(self.replication_factor >= 1, "stream.replication_factor", self.replication_factor, "an integer >= 1")
        _check(self.queue_size >= 1, "stream.queue_size", self.queue_size, "an integer >= 1")
        _check(self.linger_ms >= 0, "stream.linger_ms", self.linger_ms, "an integer >= 0")
        _check(self.batch_bytes >= 1024, "stream.batch_bytes", self.batch_bytes, "an integer >= 1024")
        _check(self.compression in ("gzip", "none"), "stream.compression", self.compression, "gzip or none")
        _check(1024 <= self.max_record_bytes <= 64 << 20, "stream.max_record_bytes", self.max_record_bytes, "in [1 KiB, 64 MiB]")
        _check(self.chunk_rounds >= 1, "stream.chunk_rounds", self.chunk_rounds, "an integer >= 1")
        _check(self.topk >= 0, "stream.topk", self.topk, "an integer >= 0 (0 = no teacher log-probs)")
        _check(self.logprob_dtype in ("float16", "float32"), "stream.logprob_dtype", self.logprob_dtype, "float16 or float32")
        _check(type(self.schema_id) is int and 0 <= self.schema_id < 1 << 31, "stream.schema_id", self.schema_id,
               "an integer in [0, 2^31): a schema registry's id for the record schema, or 0")
        _check(self.delivery_timeout_ms >= 1000, "stream.delivery_timeout_ms", self.delivery_timeout_ms, "an integer >= 1000")
        _check(self.session_timeout_ms >= 1000, "stream.session_timeout_ms", self.session_timeout_ms, "an integer >= 1000")
        _check(self.max_poll_interval_ms >= self.session_timeout_ms, "stream.max_poll_interval_ms", self.max_poll_interval_ms,
               f"an integer >= stream.session_timeout_ms ({self.session_timeout_ms})")
        _check(self.replica_id is None or bool(str(self.replica_id).strip()), "stream.replica_id", self.replica_id, "null or a non-empty name")
        _check(self.data_dir is None or self.storage_engine is None, "stream.data_dir", self.data_dir,
               "null when stream.storage_engine is set (one place for the embedded broker's data)")
        _check(self.data_dir is None or bool(str(self.data_dir).strip()), "stream.data_dir", self.data_dir, "null or a folder")
        _check(self.retention_hours is None or (type(self.retention_hours) in (int, float) and 0 < self.retention_hours < 1e6),
               "stream.retention_hours", self.retention_hours, "null (keep every record) or a number of hours in (0, 1e6)")
        unknown = sorted(set(self.security) - SECURITY_KEYS)
        _check(not unknown, "stream.security", unknown, f"only Kafka client security options ({', '.join(sorted(SECURITY_KEYS))})")

    @property
    def retain(self) -> tuple[str, float] | None:
        """(topic, seconds): how long a durable embedded broker keeps the decision topic's records; None: for ever."""
        return None if self.retention_hours is None else (self.topic, float(self.retention_hours) * 3600.0)

    @property
    def record_args(self) -> dict[str, Any]:
        """What `dvi.records.records_from_result` takes from this config: chunking, teacher width, features."""
        f = self.features
        return {"chunk_rounds": self.chunk_rounds, "topk": self.topk, "features_share": f.share,
                "features_max_tokens": f.max_tokens, "features_encoding": f.encoding}

    @property
    def bootstrap(self) -> str:
        """Where the Kafka clients connect: the configured servers, or the embedded broker."""
        return self.bootstrap_servers or f"127.0.0.1:{self.port}"

    @property
    def embedded(self) -> bool:
        return self.bootstrap_servers is None


@dataclass(frozen=True)
class TrainerConfig:
    """The online distillation trainer (trainers/): data, objective, DeepSpeed engine, gate, checkpoints."""

    group_id: str = "dvi-trainer"  # consumer group on stream.topic
    run_dir: str | None = None  # checkpoints (with ledger and offsets); null: <cache>/trainer
    store: str | None = None  # model store of published drafters; null: <cache>/store
    # DeepSpeed
    zero_stage: int = 0
    # auto: bf16 on a GPU; bf16-mixed on a CPU with native bf16 (fp32 weights and optimizer, the forward and backward's
    # matrix products in bf16: torch.autocast); else fp32. bf16: DeepSpeed's bf16 (bf16 weights, fp32 master copy)
    precision: str = "auto"
    # auto (`learning_rate`): LR_UNTRAINED from a drafter no trainer has trained (model.drafter=init), LR_TRAINED from
    # a trained one (the shipped bootstrap drafter, a published version, another's): at 512 positions a step, a trained
    # drafter (the shipped one: 8,192 a step) is fine-tuned, not trained again (benchmarks.adapt_anchor --lrs)
    lr: float | int | str = "auto"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    finetune: str = "full"  # full or lora
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # batches and the replay buffer
    batch_tokens: int = 512  # teacher positions (generated tokens) per optimizer step
    max_seq_len: int = 512  # longer records keep their last tokens (context is truncated from the left)
    # build the next batch on a thread (pinned, copied to the GPU) while a step runs; null: on a GPU only
    batch_ahead: bool | None = None
    replay_share: float = 0.25  # share of each batch drawn from already-trained records (against forgetting)
    replay_size: int = 4096  # records kept for replay (oldest evicted)
    replay_mb: float = 512.0  # and at most this many MiB of them (oldest evicted): long records cannot fill memory
    pending_size: int = 4096  # fresh records waiting to be trained (oldest skipped, counted, when full)
    pending_mb: float = 1024.0  # and at most this many MiB of them (records with features are large)
    # fresh records waiting longer than this since they were logged are skipped (counted as expired): a waiting record
    # holds its partition's committed offset back, and must be done before the stream's retention removes it; null:
    # half of stream.retention_hours (no limit when that is null)
    pending_max_age_s: float | None = None
    replay_when_idle: bool = False  # with no fresh record waiting, keep stepping on replayed ones (offline epochs)
    version_decay: float = 0.5  # replay weight per drafter version behind the serving one
    max_version_age: int = 4  # records from drafters this many versions back (or unknown ones) are dropped
    # objective (trainers/losses.py)
    divergence: str = "fkl"  # fkl, rkl, jsd or tv
    jsd_beta: float = 0.5
    teacher: str = "auto"  # auto (logged top-k when the record has it, else the target's logits), topk, logits
    # an EAGLE-3 drafter's features (the target's aux hidden states): records (those the records carry; the trainer
    # never loads the target, records without them are skipped and counted), recompute (the trainer's copy of the
    # target computes them for every record), auto (the records' where they carry them, else recomputed where the
    # trainer has the target, which it loads only for trainer.teacher=logits; else skipped and counted)
    features: str = "auto"
    reward_max: float = 0.0  # weight of the DVI reward term after the schedule (0: pure KL)
    reward_warmup: int = 100  # steps of pure KL
    reward_ramp: int = 400  # step at which the reward weight reaches reward_max
    reward_penalty: float = 1.0
    eagle3_ttt_steps: int = 3  # an EAGLE-3 drafter's loss: drafting steps unrolled (training-time test); 1: none
    # the target's forward giving an EAGLE-3 drafter its features: auto is model.dtype's (the dtype serving runs the
    # target in: bf16 on CUDA and on CPUs with native bf16), else float32, bfloat16 or float16
    features_dtype: str = "auto"
    # gate, publish, checkpoints
    holdout_share: float = 0.1  # fresh records set aside for the gate (never trained on)
    holdout_first: int = 4  # the first prompts of each domain are all held out, this many (then holdout_share)
    holdout_size: int = 256  # most recent held-out records kept
    holdout_mb: float = 128.0  # and at most this many MiB of them
    gate_every: int = 50  # optimizer steps between gate checks
    gate_every_s: float | None = 60.0  # and a gate check this often (if a step was taken since the last); null: steps only
    # the most of the trainer's time timed gate checks may take: a check that took t seconds is followed by the next
    # timed one t / share seconds after it started at the earliest (a gate runs both drafters, and for EAGLE-3 the
    # target, over every held-out record: minutes on a small CPU once the held-out set is full)
    gate_max_share: float = 0.25
    gate_min_records: int = 4  # held-out records needed before a gate check
    min_gain: float = 0.02  # a candidate must beat the serving drafter's estimated acceptance by more than this
    # ... over all held-out records, or (true) on the records of one domain with gate_min_records of them, while over all
    # it is no lower: after traffic drifts, the new domain's few held-out records hardly move the pooled figure
    gate_by_domain: bool = True
    # the acceptance the gate estimates, as the serving engine realizes it: argmax (vLLM's EAGLE-3 and draft-model
    # proposers draft the drafter's most likely token: a greedy request accepts it when it is the target's, a sampled
    # one with the target's probability of it), sampled (dvi's engine samples drafts from the drafter: sum min(p, q));
    # auto: sampled for serve.engine=dvi, else argmax
    gate_rule: str = "auto"
    # the bootstrap's held-out slice the gate keeps beside live traffic (trainers.anchor): a candidate whose acceptance
    # on it is more than anchor_max_drop below the starting drafter's is refused. auto: the shipped drafter's slice
    # when the trainer starts from the shipped drafter; none; or a slice file (<drafter>.heldout.jsonl.gz)
    anchor: str = "auto"
    anchor_max_drop: float = 0.03
    checkpoint_every: int = 25  # optimizer steps between checkpoints (offsets are committed after each)
    # and a checkpoint this often when there is something new to commit (records done without a step: held out,
    # skipped, expired); null: by steps only
    checkpoint_every_s: float | None = 300.0
    keep_checkpoints: int = 2
    ledger_size: int = 1_000_000  # record ids remembered for deduplication
    # stopping (offline runs, tests); null: run until stopped
    max_steps: int | None = None
    max_seconds: float | None = None  # stop after this long (wall time from the start of the run)
    idle_exit_s: float | None = None  # stop after this long without a fresh record
    seed: int = 0
    log_every: int = 10
    # the CPU cores the trainer (`dvi train`, `dvi drafter distill`) runs on: auto, every core it may use; a list such as
    # "1" or "2-3": these alone, its torch threads one per core. On a machine without a GPU, a trainer beside serving
    # replicas takes whatever cores they leave it: give each its own (serve.vllm.cpu_bind for the replicas)
    cpu_bind: str = "auto"
    # the trainer's CPU priority beside serving on the same machine (dvi.hardware.lower_cpu_priority): auto, normal, nice
    # (nice 19), idle (SCHED_IDLE: only CPU time no other process wants) or pause (normal, and `dvi up` stops it while
    # the server has a request in flight but for pause_share of the time: dvi.cli.up.HoldWhileBusy). auto is pause where
    # the trainer trains on the CPU on cores the server runs on too (a machine with few cores and no GPU, as `dvi up`
    # starts both), normal where it trains on a GPU or on cores of its own (dvi.hardware.pick_cpu_priority). On a 2-core
    # CPU neither nice nor idle kept the trainer from slowing requests; paused, requests back to back took 0.87x plain
    # vLLM's latency where at normal priority they took 1.43x, and paced ones 0.81x with the trainer training as fast as
    # at normal priority (benchmarks.sharing)
    cpu_priority: str = "auto"
    # with cpu_priority pause: the share of the time the trainer runs even while a request is in flight, so that
    # continuous traffic still leaves it time to train (dvi.cli.up.DutyCycle: after (1 - share) x 10 s stopped, it
    # runs share x 10 s), alone: serving waits between two steps while it runs (dvi.busy turns); 0: only between
    # requests. Run beside serving's steps instead, a share of 0.25 gave the trainer 4-5 positions a second and cost
    # the online replica 13-25% of the same drafter's tokens a second alone (benchmarks.drift); alone, a share of 0.1
    # left requests at 0.79x plain vLLM's latency back to back and 0.76x paced, against 0.80x and 0.81x with no trainer
    # in the same run, the trainer at 96 positions a second between paced requests (benchmarks.sharing). A turn ends
    # HoldWhileBusy.IDLE_AFTER_S into it where the trainer says it has nothing to do (dvi.busy idle files)
    pause_share: float = 0.1
    # the least share of serving's busy time it claims (trainers.triggers.Claim): half of pause_share after each gate in
    # a row that refused its candidate, down to this, all of it again once a version publishes or is rolled back, on a
    # retrain request or once the stream's acceptance drops by a fifth; at least pause_share: no lower claim
    pause_share_min: float = 0.025

    def __post_init__(self) -> None:
        _check(bool(self.group_id), "trainer.group_id", self.group_id, "a consumer group name")
        _check(self.zero_stage in (0, 1, 2, 3), "trainer.zero_stage", self.zero_stage, "0, 1, 2 or 3")
        _check(self.precision in ("auto", "fp32", "bf16", "bf16-mixed"), "trainer.precision", self.precision,
               "auto, fp32, bf16 or bf16-mixed")
        _check(self.features in ("auto", "records", "recompute"), "trainer.features", self.features, "auto, records or recompute")
        _check(not (self.features == "records" and self.teacher == "logits"), "trainer.features", self.features,
               "auto or recompute with trainer.teacher=logits (the teacher's logits come from the trainer's copy of the "
               "target, which trainer.features=records never loads)")
        _check(self.gate_rule in ("auto", "argmax", "sampled"), "trainer.gate_rule", self.gate_rule, "auto, argmax or sampled")
        _check(self.pending_mb > 0, "trainer.pending_mb", self.pending_mb, "a size > 0 MiB")
        _check(self.lr == "auto" or (_number(self.lr) and self.lr > 0), "trainer.lr", self.lr, "auto or a number > 0")
        _check(self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, ">= 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.betas", self.betas, "two numbers in [0, 1)")
        _check(self.grad_clip >= 0, "trainer.grad_clip", self.grad_clip, ">= 0 (0: no clipping)")
        _check(self.finetune in ("full", "lora"), "trainer.finetune", self.finetune, "full or lora")
        _check(self.lora_r >= 1 and self.lora_alpha >= 1, "trainer.lora_r/lora_alpha", (self.lora_r, self.lora_alpha), "integers >= 1")
        _check(self.batch_tokens >= 1, "trainer.batch_tokens", self.batch_tokens, "an integer >= 1")
        _check(self.max_seq_len >= 2, "trainer.max_seq_len", self.max_seq_len, "an integer >= 2")
        _check(0 <= self.replay_share < 1, "trainer.replay_share", self.replay_share, "in [0, 1)")
        _check(self.replay_size >= 1 and self.pending_size >= 1, "trainer.replay_size/pending_size",
               (self.replay_size, self.pending_size), "integers >= 1")
        _check(0 < self.version_decay <= 1, "trainer.version_decay", self.version_decay, "in (0, 1]")
        _check(self.max_version_age >= 0, "trainer.max_version_age", self.max_version_age, "an integer >= 0")
        _check(self.divergence in ("fkl", "rkl", "jsd", "tv"), "trainer.divergence", self.divergence, "fkl, rkl, jsd or tv")
        _check(0 < self.jsd_beta < 1, "trainer.jsd_beta", self.jsd_beta, "in (0, 1)")
        _check(self.teacher in ("auto", "topk", "logits"), "trainer.teacher", self.teacher, "auto, topk or logits")
        _check(0 <= self.reward_max <= 1, "trainer.reward_max", self.reward_max, "in [0, 1]")
        _check(0 <= self.reward_warmup <= self.reward_ramp, "trainer.reward_warmup/reward_ramp",
               (self.reward_warmup, self.reward_ramp), "0 <= reward_warmup <= reward_ramp")
        _check(self.reward_penalty >= 0, "trainer.reward_penalty", self.reward_penalty, ">= 0")
        _check(self.features_dtype in ("auto", "float32", "bfloat16", "float16"), "trainer.features_dtype", self.features_dtype,
               "auto, float32, bfloat16 or float16")
        _check(self.eagle3_ttt_steps >= 1, "trainer.eagle3_ttt_steps", self.eagle3_ttt_steps, "an integer >= 1")
        _check(0 <= self.holdout_share < 1, "trainer.holdout_share", self.holdout_share, "in [0, 1)")
        _check(self.holdout_size >= 1, "trainer.holdout_size", self.holdout_size, "an integer >= 1")
        _check(self.cpu_bind == "auto" or CORE_LIST.fullmatch(self.cpu_bind) is not None, "trainer.cpu_bind", self.cpu_bind,
               'auto or a list of cores such as "1" or "2-3"')
        _check(self.cpu_priority in CPU_PRIORITIES, "trainer.cpu_priority", self.cpu_priority, ", ".join(CPU_PRIORITIES))
        _check(_number(self.pause_share) and 0 <= self.pause_share < 1, "trainer.pause_share", self.pause_share,
               "a number from 0 up to (not including) 1")
        _check(_number(self.pause_share_min) and 0 <= self.pause_share_min < 1, "trainer.pause_share_min",
               self.pause_share_min, "a number from 0 up to (not including) 1")
        _check(self.replay_mb > 0 and self.holdout_mb > 0, "trainer.replay_mb/holdout_mb", (self.replay_mb, self.holdout_mb),
               "sizes > 0 MiB")
        _check(self.gate_every >= 1, "trainer.gate_every", self.gate_every, "an integer >= 1")
        _check(self.gate_every_s is None or self.gate_every_s > 0, "trainer.gate_every_s", self.gate_every_s, "null or > 0 seconds")
        _check(0 < self.gate_max_share <= 1, "trainer.gate_max_share", self.gate_max_share, "in (0, 1]")
        _check(self.holdout_first >= 0, "trainer.holdout_first", self.holdout_first, "an integer >= 0")
        _check(bool(self.anchor), "trainer.anchor", self.anchor, "auto, none or a slice file")
        _check(0 <= self.anchor_max_drop <= 1, "trainer.anchor_max_drop", self.anchor_max_drop, "in [0, 1]")
        _check(self.gate_min_records >= 1, "trainer.gate_min_records", self.gate_min_records, "an integer >= 1")
        _check(self.checkpoint_every >= 1, "trainer.checkpoint_every", self.checkpoint_every, "an integer >= 1")
        _check(self.checkpoint_every_s is None or self.checkpoint_every_s > 0, "trainer.checkpoint_every_s",
               self.checkpoint_every_s, "null or > 0 seconds")
        _check(self.pending_max_age_s is None or self.pending_max_age_s > 0, "trainer.pending_max_age_s",
               self.pending_max_age_s, "null or > 0 seconds")
        _check(self.keep_checkpoints >= 1, "trainer.keep_checkpoints", self.keep_checkpoints, "an integer >= 1")
        _check(self.ledger_size >= 1000, "trainer.ledger_size", self.ledger_size, "an integer >= 1000")
        _check(self.max_steps is None or self.max_steps >= 1, "trainer.max_steps", self.max_steps, "null or >= 1")
        _check(self.idle_exit_s is None or self.idle_exit_s > 0, "trainer.idle_exit_s", self.idle_exit_s, "null or > 0")
        _check(self.max_seconds is None or self.max_seconds > 0, "trainer.max_seconds", self.max_seconds, "null or > 0")
        _check(self.log_every >= 1, "trainer.log_every", self.log_every, "an integer >= 1")


@dataclass(frozen=True)
class TriggerConfig:
    """When the trainer trains and publishes (conf/trigger/): continuous, threshold, schedule or manual."""

    kind: str = "continuous"
    # threshold: rolling acceptance of the stream (accepted / drafted over the last `window` records)
    acceptance_below: float | None = None
    drift_above: float | None = None  # drift score: drop of rolling acceptance below its reference, in [0, 1]
    window: int = 200  # records in the rolling window
    min_records: int = 50  # records seen before a threshold can fire
    # schedule
    every_s: float = 3600.0
    # a triggered session trains this many steps, then gates and publishes; then the trigger is re-armed
    session_steps: int = 200
    cooldown_s: float = 60.0  # after a session, the threshold trigger waits this long before firing again

    def __post_init__(self) -> None:
        _check(self.kind in ("continuous", "threshold", "schedule", "manual"), "trigger.kind", self.kind,
               "continuous, threshold, schedule or manual")
        if self.kind == "threshold":
            _check(self.acceptance_below is not None or self.drift_above is not None, "trigger.acceptance_below/drift_above",
                   (self.acceptance_below, self.drift_above), "at least one set for the threshold trigger")
        _check(self.acceptance_below is None or 0 < self.acceptance_below <= 1, "trigger.acceptance_below",
               self.acceptance_below, "null or in (0, 1]")
        _check(self.drift_above is None or 0 < self.drift_above <= 1, "trigger.drift_above", self.drift_above, "null or in (0, 1]")
        _check(self.window >= 1, "trigger.window", self.window, "an integer >= 1")
        _check(1 <= self.min_records, "trigger.min_records", self.min_records, "an integer >= 1")
        _check(self.every_s > 0, "trigger.every_s", self.every_s, "> 0 seconds")
        _check(self.session_steps >= 1, "trigger.session_steps", self.session_steps, "an integer >= 1")
        _check(self.cooldown_s >= 0, "trigger.cooldown_s", self.cooldown_s, ">= 0 seconds")


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow: where runs, metrics and the drafter registry live (conf/tracking/)."""

    uri: str | None = None  # null: the local server on 127.0.0.1:port (`dvi mlflow`, `dvi up`)
    port: int = 5000
    root: str | None = None  # local server's SQLite database and artifacts; null: <cache>/mlflow
    experiment: str = "dvi"
    registry_model: str = "dvi-drafter"
    queue_size: int = 100000  # metric points buffered while MLflow is unreachable (older ones are dropped, counted)
    retry_s: float = 5.0  # wait between attempts to reach an unreachable MLflow
    enabled: bool = True
    auth: bool = True  # the local server requires a login (MLflow's basic-auth app; see dvi.mlflow_login.local_login)

    def __post_init__(self) -> None:
        _check(self.uri is None or bool(str(self.uri).strip()), "tracking.uri", self.uri, "null (the local server) or a URI")
        _check(1 <= self.port <= 65535, "tracking.port", self.port, "a TCP port in [1, 65535]")
        _check(bool(self.experiment), "tracking.experiment", self.experiment, "a name")
        _check(bool(self.registry_model), "tracking.registry_model", self.registry_model, "a name")
        _check(self.queue_size >= 1, "tracking.queue_size", self.queue_size, "an integer >= 1")
        _check(self.retry_s > 0, "tracking.retry_s", self.retry_s, "> 0 seconds")

    @property
    def tracking_uri(self) -> str:
        return self.uri or f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class DviConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        """Checks across groups (each group checks its own fields)."""
        _check(self.stream.topk <= self.serve.spec.topk_logprobs, "stream.topk", self.stream.topk,
               f"<= serve.spec.topk_logprobs={self.serve.spec.topk_logprobs} (the stream logs the teacher log-probs the "
               "engine keeps): raise serve.spec.topk_logprobs or lower stream.topk")


SECRET_KEYS = frozenset(["security", "api_key"])  # never logged as params, never accepted on a command line


def api_key(serve: ServeConfig, env: dict[str, str] | None = None) -> str | None:
    """The key clients must send: serve.api_key, else $DVI_API_KEY (in `env`, default this process's), else the key in
    serve.api_key_file (stripped), else None (no authentication); DviError when that file cannot be read or holds
    fewer than 8 characters. Both engines' servers read it here (dvi's API, and vLLM's own as $VLLM_API_KEY)."""
    env = os.environ if env is None else env
    if serve.api_key or env.get("DVI_API_KEY"):
        return serve.api_key or env["DVI_API_KEY"]
    path = serve.api_key_file
    if not path:
        return None
    try:
        key = Path(path).expanduser().read_text().strip()
    except OSError as e:
        raise DviError(f"serve.api_key_file={path}: cannot read it ({e.strerror})") from None
    if len(key) < 8:
        raise DviError(f"serve.api_key_file={path}: the key in it has {len(key)} characters, fewer than 8")
    return key


def flat_params(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """A config as flat `group.key` -> value params (for MLflow), without credentials."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_params(value, f"{prefix}{f.name}."))
        elif f.name not in SECRET_KEYS:
            out[f"{prefix}{f.name}"] = value
    return out


def shown(cfg: Any) -> dict[str, Any]:
    """A config as nested plain data for people to read (`dvi config show`): every field, secrets masked as
    "***" (the API key, and each `stream.security` option whose name says password, secret or token)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = shown(value)
        elif f.name == "api_key":
            value = None if value is None else "***"
        elif f.name == "security":
            value = {k: "***" if any(s in k for s in ("password", "secret", "token")) else v for k, v in value.items()}
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides given on a command line (`args.overrides`); anything else left over is an error, and so
    is a secret: every user of the host can read a process's command line (/proc/<pid>/cmdline)."""
    extra = list(getattr(args, "overrides", []) or [])
    bad = [w for w in extra if "=" not in w or w.startswith("-")]
    if bad:
        raise DviError(f"unrecognized arguments: {' '.join(bad)} (config overrides look like key=value)")
    for word in extra:
        key = word.split("=", 1)[0].lstrip("+~")
        if key == "serve.api_key":
            raise DviError("serve.api_key on the command line is readable by every user of this host: set $DVI_API_KEY, "
                           "or serve.api_key_file=<a file only you can read>")
        if key.startswith("stream.security.") and any(s in key for s in ("password", "secret", "token")):
            raise DviError(f"{key} on the command line is readable by every user of this host: set "
                           "$DVI_KAFKA_SASL_PASSWORD, or keep it in a config file")
    return extra


def load_config(overrides: list[str] | None = None, config_name: str = "config") -> DviConfig:
    """Compose conf/<config_name>.yaml with Hydra overrides and build the typed, validated config."""
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
    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
