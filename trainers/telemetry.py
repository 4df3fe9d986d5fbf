"""The trainer's figures for the tracker besides training's own: its process and device, and what its source saw.

- `system_metrics`: `system/*`, CPU, resident memory, the C heap (`dvi.alloc.heap_figures`), the host's memory and,
  on CUDA, the memory PyTorch holds and the device's busy share (`gpu_busy_share`, from NVML);
- `source_counts`: `stream/*`, the counts of the source's `stats` (a `DecisionConsumer`'s or a file's);
- `source_lag`: `consumer_lag`, where the source tells it.

This module reads the process, the device and the source; it does not know the trainer's loop or its counters, nor
the tracker that takes the figures.
"""

from __future__ import annotations

import psutil
import torch

from dvi.alloc import heap_figures


def system_metrics(process: psutil.Process, device: torch.device) -> dict[str, float]:
    """The trainer process's system figures for MLflow (`system/*`): CPU (percent of one core, since the last call),
    resident memory, the C heap's memory in use and free (`dvi.alloc.heap_figures`), the host's memory in use and, on
    CUDA, the memory PyTorch holds."""
    out = {"system/cpu_percent": process.cpu_percent(), "system/rss_mb": process.memory_info().rss / (1 << 20),
           "system/memory_percent": psutil.virtual_memory().percent}
    heap = heap_figures()
    if heap is not None:
        out.update({"system/heap_in_use_mb": heap["in_use"], "system/heap_free_mb": heap["free"],
                    "system/heap_mmap_mb": heap["mmap"], "system/py_blocks": heap["py_blocks"]})
    if device.type == "cuda":
        out["system/gpu_memory_allocated_mb"] = torch.cuda.memory_allocated(device) / (1 << 20)
        out["system/gpu_memory_reserved_mb"] = torch.cuda.memory_reserved(device) / (1 << 20)
        busy = gpu_busy_share(device)
        if busy is not None:
            out["system/gpu_busy_share"] = busy
    return out


def gpu_busy_share(device: torch.device) -> float | None:
    """The share of the last sample period (about a second) in which a kernel ran on `device`, from NVML; None on
    a CPU or where NVML cannot be read (no nvidia-ml-py)."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.utilization(device) / 100.0
    except Exception:  # ModuleNotFoundError (pynvml), or an NVML error: the figure is optional
        return None


def source_counts(source) -> dict[str, float]:
    """What the source saw (`stream/received`, `stream/invalid`, `stream/dead_lettered`, `stream/batches_refused`, ...
    of a DecisionConsumer; `stream/invalid` of a file)."""
    stats = getattr(source, "stats", None)
    counts = stats.to_dict() if hasattr(stats, "to_dict") else vars(stats) if stats is not None else {}
    return {f"stream/{k}": float(v) for k, v in counts.items() if isinstance(v, (int, float))}


def source_lag(source) -> dict[str, float]:
    """`consumer_lag`: what the source has yet to hand over (a consumer's messages, a file's lines), where it tells."""
    lag = source.lag() if hasattr(source, "lag") else None
    return {} if lag is None else {"consumer_lag": float(lag)}
