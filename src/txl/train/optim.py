"""Optimizers and learning-rate schedules of the reference ``train.py``, as pure functions of the step."""

from __future__ import annotations

import math

import torch

from txl.config import TrainConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """Adam (the paper), AdamW or SGD; fused where torch has a fused kernel for ``device`` (CPU and CUDA)."""
    fused = cfg.fused if cfg.fused is not None else device.type in ("cpu", "cuda")
    if cfg.optimizer in ("adam", "adamw"):
        cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
        return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (1-based: the first update is step 1), as the reference sets it.

    Warm-up (cosine, constant): ``lr * step / warmup_steps`` while ``step < warmup_steps``. cosine: then
    ``eta_min + (lr - eta_min) * (1 + cos(pi * step / decay_steps)) / 2``, over the whole run as the reference
    does (the warm-up included). inv_sqrt: ``lr * step / warmup^1.5`` up to the warm-up, then ``lr / sqrt(step)``
    (peak ``lr / sqrt(warmup)``).
    """
    if cfg.scheduler == "inv_sqrt":
        w = cfg.warmup_steps
        return cfg.lr * (step / w**1.5 if step <= w else 1.0 / math.sqrt(step))
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.scheduler == "constant":
        return cfg.lr
    total = cfg.decay_steps or cfg.max_steps
    t = min(step, total)
    return cfg.eta_min + (cfg.lr - cfg.eta_min) * (1 + math.cos(math.pi * t / total)) / 2


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
