"""Shared fixtures: tiny random-weight Llama models for fast unit tests, and the real demo pair.

The tiny models are seeded fp32 Llamas (vocab 97, hidden 32) built in memory: fast enough for hundreds of
decoding rounds per test. Their weights are drawn with a larger scale than the usual init so that the
next-token distributions are peaked: greedy argmaxes are then decisive, and batched / unbatched / cached
forwards (which differ by float rounding only) agree on them.

The real pair is SmolLM2-135M-Instruct (`dvi.models.fetch_demo_target`, cached after the first fetch)
and a 2-layer drafter built from it, cached under `<cache>/models/drafter-L2-full` like the CLI does.
Fixtures that load it are only used by tests marked `real_model`.

`DVI_TEST_DEVICE` (default cpu) puts the tiny target and drafters on another device, e.g. cuda, for the engine's
greedy and sampling tests on a GPU (`python -m benchmarks.gpu` runs them there); the rest of the suite is CPU-only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dvi.models import DRAFTER_META, Drafter

# the real embedded broker, stream configs and hand-made DecisionRecords
pytest_plugins = ["broker_fixtures"]

TINY_VOCAB = 97
TEST_DEVICE = torch.device(os.environ.get("DVI_TEST_DEVICE") or "cpu")


def tiny_llama(
    seed: int, layers: int = 2, vocab: int = TINY_VOCAB, window: int = 512, head_scale: float = 4.0
) -> LlamaForCausalLM:
    """A seeded random-weight Llama in fp32, eval mode, its output head scaled up for peaked distributions."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        initializer_range=0.25,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def noisy_copy(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A copy of `model` with Gaussian noise of relative size `noise` added to every weight."""
    copy = LlamaForCausalLM(model.config).float().eval()
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return copy


@pytest.fixture(scope="session")
def make_tiny_llama():
    """The tiny model factory, for tests that need another shape (a small context window, another vocabulary)."""
    return tiny_llama


_SET_NUM_THREADS = torch.set_num_threads
# what vLLM's CPU platform and worker (vllm/platforms/cpu.py, v1/worker/cpu_worker.py) and dvi's vLLM engine
# (dvi.cli.vllm.engine.set_vllm_env) write into the process environment, which every process a later test
# spawns would inherit: LD_PRELOAD of tcmalloc and libgomp, OpenMP and inductor thread settings, vLLM's own
VLLM_ENV_PREFIXES = ("VLLM_", "TORCHINDUCTOR_", "KMP_", "OMP_", "LD_PRELOAD", "LD_LIBRARY_PATH", "LOCAL_WORLD_SIZE",
                     "NUMEXPR_MAX_THREADS", "TRITON_", "TILELANG_", "PYTORCH_NVML_BASED_CUDA_CHECK")


@pytest.fixture(autouse=True)
def process_cpu_state():
    """What an in-process vLLM engine changes for the whole process is put back after every test: vLLM's CPU worker
    replaces `torch.set_num_threads` with a no-op once it binds its threads, and may narrow the CPU affinity that
    every process a later test spawns would inherit; vLLM's platform writes its settings into the environment."""
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    env = {k: v for k, v in os.environ.items() if k.startswith(VLLM_ENV_PREFIXES)}
    yield
    torch.set_num_threads = _SET_NUM_THREADS
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if os.sched_getaffinity(0) != affinity:
        os.sched_setaffinity(0, affinity)
    for k in [k for k in os.environ if k.startswith(VLLM_ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread; several threads spin against each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    return tiny_llama(seed=0, layers=3).to(TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target) -> Drafter:
    """A noisy copy of the target: accepts some drafts and rejects others (mixed acceptance)."""
    return Drafter(model=noisy_copy(tiny_target, seed=1, noise=0.04).to(TEST_DEVICE), version="noisy-v1")


@pytest.fixture(scope="session")
def reduced_drafter(tiny_target) -> Drafter:
    """A noisy copy whose head predicts over 64 of the 97 target ids only (like a `draft_head.safetensors`)."""
    model = noisy_copy(tiny_target, seed=3, noise=0.04)
    vocab_map = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(4))[:64].sort().values
    head = torch.nn.Linear(model.config.hidden_size, vocab_map.numel(), bias=False)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight[vocab_map])
    model.lm_head = head
    return Drafter(model=model.to(TEST_DEVICE), version="reduced-v1", vocab_map=vocab_map.to(TEST_DEVICE))


@pytest.fixture(scope="session")
def random_drafter() -> Drafter:
    """An unrelated random model with the target's vocabulary: its drafts are almost never accepted."""
    return Drafter(model=tiny_llama(seed=2, layers=2).to(TEST_DEVICE), version="random-v1")


@pytest.fixture(scope="session")
def self_drafter(tiny_target) -> Drafter:
    """The target drafting for itself: every draft is accepted."""
    return Drafter(model=tiny_target, version="self")


# ----------------------------------------------------------------------------------------------
# The real demo pair (tests marked real_model).

REAL_MODEL_FIXTURES = {"demo_target_dir", "demo_drafter_dir", "demo_eagle3_dir", "demo_bootstrap_dir", "demo_pair"}


def pytest_collection_modifyitems(config, items):
    """A test that uses the real pair is a real_model test, marked or not: `-m "not real_model"` skips it."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def demo_target_dir() -> Path:
    from dvi.models import fetch_demo_target

    return fetch_demo_target()


@pytest.fixture(scope="session")
def demo_drafter_dir(demo_target_dir) -> Path:
    from dvi.models import build_drafter, default_cache_dir

    out = default_cache_dir() / "models" / "drafter-L2-full"
    if not (out / DRAFTER_META).exists():  # built once per machine, like the CLI's demo drafter
        build_drafter(demo_target_dir, out, layers=2)
    return out


@pytest.fixture(scope="session")
def demo_eagle3_dir(demo_target_dir) -> Path:
    """The default demo drafter: an EAGLE-3 drafter built from the target as `dvi up` builds it (`pair_dirs`)."""
    from dvi.config import ModelConfig
    from dvi.pairs import pair_dirs

    return pair_dirs(ModelConfig(target=str(demo_target_dir), drafter_kind="eagle3"))[1]  # built once per machine


@pytest.fixture(scope="session")
def demo_bootstrap_dir(demo_target_dir) -> Path:
    """The demo pair's default drafter: the bootstrap drafter dvi ships, installed as `dvi up` installs it."""
    from dvi.drafters import installed_bootstrap
    from dvi.models import default_cache_dir

    return installed_bootstrap(default_cache_dir(), demo_target_dir)


@pytest.fixture(scope="session")
def demo_pair(demo_target_dir, demo_drafter_dir):
    """(target model, tokenizer, drafter) of the real demo pair, fp32."""
    from dvi.models import load_causal_lm, load_drafter, load_tokenizer

    target = load_causal_lm(demo_target_dir, "target")
    tokenizer = load_tokenizer(demo_target_dir, "target")
    drafter = load_drafter(demo_drafter_dir, int(target.config.vocab_size))
    return target, tokenizer, drafter


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, demo_target_dir) -> tuple[Path, Path]:
    """(target dir, drafter dir): a tiny random Llama with the demo tokenizer (vocabulary 49,152) saved as a
    checkpoint, and a drafter built from its first layer; for tests about bookkeeping rather than learning."""
    from transformers import AutoTokenizer

    from dvi.models import build_drafter

    root = tmp_path_factory.mktemp("tiny-pair")
    target = tiny_llama(seed=0, layers=2, vocab=49152)
    target.save_pretrained(root / "target")
    AutoTokenizer.from_pretrained(demo_target_dir).save_pretrained(root / "target")
    build_drafter(root / "target", root / "drafter", layers=1)
    return root / "target", root / "drafter"


# ----------------------------------------------------------------------------------------------
# DeepSpeed (the trainer and fault tests): one process group per process, so one per session.


@pytest.fixture(scope="session")
def ds_world() -> tuple[int, int]:
    """(rank, world size) after `trainers.ds.init_distributed()`: a world of one over gloo in a plain pytest run.

    It leaves RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in this process's environment: a test that starts
    a trainer subprocess must drop or blank them, or the child takes them for a launcher's and joins this
    process's rendezvous port.
    """
    from trainers.ds import init_distributed

    return init_distributed()
