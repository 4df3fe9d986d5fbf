"""The DeepSpeed engine of the distillation trainer, built from `TrainerConfig`.

This module owns the process group (`init_distributed`) and the collectives the trainer's ranks agree through
(`all_gathered`, `on_every_rank`, `from_rank0`), the DeepSpeed config (`ds_config`, a pure function of the trainer
config), the engine with its client AdamW (`build_engine`), LoRA (`apply_lora`) and the plain
weights a published drafter is made of (`merged_state_dict`). It knows nothing about records, losses, Kafka
or checkpoints on disk (trainers/checkpoint.py): callers pass a model in and get an engine back.

Plain `python` runs as a world of one (gloo on CPU); under the `deepspeed` launcher (use `--no_local_rank`,
Hydra rejects `--local_rank`) the launcher's environment is used as is. The optimizer is a client
`torch.optim.AdamW` rather than DeepSpeed's own (fused where the drafter is on a GPU), so no run compiles an Adam
op; the only op DeepSpeed compiles on a CPU is its shared-memory comm op, once per cache, kept under
$TORCH_EXTENSIONS_DIR (default <cache>/torch_extensions). With bf16, DeepSpeed keeps fp32 master weights that the
AdamW steps (its bf16 wrapper); bf16-mixed (a CPU with native bf16) is an fp32 engine whose caller runs the forward under
`torch.autocast`, the matrix products in bf16 and the weights, gradients and optimizer in fp32.
"""

from __future__ import annotations

import contextlib
import logging
import os

import deepspeed
import torch
from deepspeed import DeepSpeedEngine

from dvi.config import TrainerConfig, default_cache_dir, learning_rate
from dvi.errors import DviError
from dvi.hardware import pick_precision
from dvi.procs import HOST, free_port

log = logging.getLogger("dvi.trainers.ds")

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE")


def init_distributed() -> tuple[int, int]:
    """Join (or, under plain `python`, create) the process group once; returns (rank, world size)."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    if not all(os.environ.get(key) for key in _LAUNCHER_ENV):  # unset or empty (a parent's values blanked out)
        # A world of one: DeepSpeed otherwise falls back to MPI discovery (and asks for mpi4py).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR=HOST, MASTER_PORT=str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    # DeepSpeed compiles its comm op on first use (about 30-100 s on 2 cores): keep the build where later runs on this
    # cache find it, inside dvi's cache (nothing written outside it)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_cache_dir() / "torch_extensions"))
    deepspeed.init_distributed()
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def all_gathered(obj: dict, world: int) -> list[dict]:
    """Every rank's `obj`, in rank order (in a world of one, `obj` alone)."""
    if world == 1:
        return [obj]
    out = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def on_every_rank(flag: bool, world: int) -> bool:
    """True on every rank when `flag` is true on every rank."""
    if world == 1:
        return flag
    t = torch.tensor([0.0 if flag else 1.0])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t[0] == 0)


def from_rank0(value, world: int):
    """Rank 0's `value` on every rank (a decision only rank 0 takes)."""
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def resolve_precision(cfg: TrainerConfig, device_type: str | None = None) -> str:
    """The precision to train in (`dvi.hardware.pick_precision`): auto is bf16 on a GPU, bf16-mixed on a CPU with
    native bf16, else fp32. bf16-mixed is fp32 to DeepSpeed: the trainer runs its forward under `torch.autocast`."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.precision == "bf16" and device_type != "cuda":
        log.warning("trainer.precision=bf16 without a GPU: bf16 weights train slowly on a CPU; use bf16-mixed (or auto)")
    return pick_precision(cfg.precision, device_type).value


def ds_config(cfg: TrainerConfig, precision: str | None = None) -> dict:
    """The DeepSpeed config (`precision`: resolved, default `resolve_precision(cfg)`).

    The caller builds whole batches, so DeepSpeed sees one micro-batch per optimizer step.
    """
    precision = precision or resolve_precision(cfg)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        "gradient_clipping": cfg.grad_clip,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_engine(
    model: torch.nn.Module, cfg: TrainerConfig, params: list[torch.nn.Parameter] | None = None
) -> DeepSpeedEngine:
    """A DeepSpeed engine over `model` with AdamW on `params` (default: the parameters that require grad), at
    `cfg.lr`; auto as for an untrained model (the trainer resolves it by its starting drafter before)."""
    init_distributed()
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    if not params:
        raise DviError("the drafter has no trainable parameters (trainer.finetune and trainer.lora_targets froze all)")
    # on a GPU, the fused kernel: one launch per step for all parameters, not several per tensor
    fused = all(p.device.type == "cuda" for p in params)
    optimizer = torch.optim.AdamW(params, lr=learning_rate(cfg.lr, untrained=True), betas=tuple(cfg.betas),
                                  weight_decay=cfg.weight_decay, fused=fused or None)
    config = ds_config(cfg, resolve_precision(cfg, params[0].device.type))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def set_lr(engine: DeepSpeedEngine, lr: float) -> None:
    """The learning rate of every parameter group of `engine`'s optimizer (DeepSpeed's bf16 wrapper forwards its
    client optimizer's groups) from the next step on."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def apply_lora(model: torch.nn.Module, cfg: TrainerConfig) -> torch.nn.Module:
    """Wrap `model` in LoRA adapters (only they train) when trainer.finetune is lora; else return it as is."""
    if cfg.finetune != "lora":
        return model
    # lazy: LoRA is optional (trainer.finetune=lora), and importing peft adds about 2 s to every trainer start
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_targets), lora_dropout=0.0)
    try:
        return get_peft_model(model, lora)
    except ValueError as e:  # peft's "Target modules {...} not found in the base model"
        raise DviError(f"trainer.lora_targets={list(cfg.lora_targets)} do not fit the drafter: {e}") from e


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Plain weights with the base model's keys: unwrapped from DeepSpeed, LoRA merged in, detached copies.

    `model`: the engine, or the module it trains (or a part of it). The model is not modified (adapters stay
    separate for further training). Under ZeRO-3 this gathers the partitioned parameters: every rank must call it.
    """
    module = model.module if isinstance(model, DeepSpeedEngine) else model
    with _gathered(module), torch.no_grad():
        return _merged(module)


def _gathered(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]  # ZeRO-3 marks the parameters it owns
    return deepspeed.zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext()


def _merged(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # lazy, as in apply_lora
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, PeftModel):
        return {key: value.detach().clone() for key, value in module.state_dict().items()}
    base = module.get_base_model()
    deltas = {
        name: layer.get_delta_weight(layer.active_adapters[0])
        for name, layer in base.named_modules()
        if isinstance(layer, LoraLayer) and layer.active_adapters
    }
    out = {}
    for key, value in base.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if ".lora_" in f".{owner}":
            continue  # the adapters themselves (lora_A, lora_B, ...)
        if owner.endswith(".base_layer"):  # a wrapped layer: base_layer.weight is the frozen original
            owner = owner.removesuffix(".base_layer")
            if leaf == "weight" and owner in deltas:
                value = value + deltas[owner].to(value.dtype)
            key = f"{owner}.{leaf}"
        out[key] = value.detach().clone()
    return out
