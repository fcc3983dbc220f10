"""Typed sections of a training run (``txl train --config X.yaml``): ``model``, ``data``, ``train``, ``eval``.

The field docstrings are the ``--help`` text. A recipe in ``configs/`` is a YAML file with these sections;
``--train.lr 1e-3`` style flags override single fields.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import yaml

from txl.data import DataConfig
from txl.modeling import TransformerXLConfig

Precision = Literal["fp32", "bf16", "fp16"]


@dataclass
class TrainConfig:
    """How to train (the ``train`` section)."""

    batch_size: int = 60
    """Global batch size: columns of the token stream, split over all processes."""
    tgt_len: int = 70
    """Segment length: tokens predicted per column per step."""
    ext_len: int = 0
    """Extended context: tokens of the previous segment fed again in front of each segment (not predicted)."""
    varlen: bool = False
    """Vary the segment length per step as the reference's --varlen does (tgt_len, sometimes half, plus noise)."""
    batch_chunk: int = 1
    """Gradient accumulation: split each process's columns into this many chunks, each with its own memory."""
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    """Optimizer (Adam as in the paper)."""
    lr: float = 0.00025
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw, L2 for adam and sgd)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW betas."""
    eps: float = 1e-8
    """Adam/AdamW epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    fused: bool | None = None
    """Use the fused optimizer kernel (None: wherever torch offers one for the device)."""
    scheduler: Literal["cosine", "inv_sqrt", "constant"] = "cosine"
    """Learning-rate schedule after the linear warm-up."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many steps."""
    eta_min: float = 0.0
    """cosine: the final learning rate."""
    decay_steps: int | None = None
    """cosine: steps from 0 to eta_min (None: max_steps, as the reference: the cosine includes the warm-up)."""
    clip: float = 0.25
    """Clip the global gradient norm to this value (0: no clipping; the norm is still checked and logged)."""
    max_steps: int = 200_000
    """Stop after this many optimizer steps."""
    max_tokens: int | None = None
    """Stop once this many training tokens (all processes) have been seen."""
    max_time: float | None = None
    """Stop after this many seconds of training (summed over resumed runs), saving a checkpoint."""
    precision: Precision = "fp32"
    """fp32; bf16 (autocast, CPU or CUDA); fp16 (autocast + GradScaler, CUDA only). Attention softmax and the
    adaptive log-softmax always run in fp32."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (the local rank's GPU if there is one, else cpu)."""
    threads: int | None = None
    """torch CPU threads per process (None: torch's default)."""
    seed: int = 1111
    """Seed for initialisation, dropout and the data order (process r uses seed + r for dropout)."""
    log_interval: int = 200
    """Write a metrics line every this many steps."""
    eval_interval: int = 4000
    """Evaluate on the valid split every this many steps (0: only at the end)."""
    eval_batch_size: int = 10
    """Batch size of the periodic evaluation (the reference hard-codes 10)."""
    eval_tgt_len: int | None = None
    """Segment length of the periodic evaluation; its memory is mem_len + tgt_len - eval_tgt_len, keeping the
    attention span of training, as the reference does (None: tgt_len)."""
    eval_max_steps: int | None = None
    """Evaluate on at most this many batches (None: the whole split)."""
    checkpoint_interval: int = 4000
    """Save a checkpoint every this many steps (0: only at the end). One is always saved when training stops."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (plus the best one by validation loss)."""
    keep_best: bool = True
    """Also keep the checkpoint with the best validation loss."""
    progress: bool | None = None
    """Show a progress bar (None: only when stderr is a terminal)."""
    tensorboard: bool = False
    """Also write TensorBoard logs to RUN/tensorboard (needs the `tb` extra)."""

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"train.{name} = {getattr(self, name)!r}: {why}")

        for name in (
            "batch_size",
            "tgt_len",
            "batch_chunk",
            "max_steps",
            "log_interval",
            "eval_batch_size",
            "keep_last",
        ):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        for name in ("ext_len", "warmup_steps", "eval_interval", "checkpoint_interval"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        if self.lr <= 0:
            bad("lr", "must be > 0")
        if self.clip < 0:
            bad("clip", "must be >= 0")
        if len(self.betas) != 2:
            bad("betas", "needs two values")
        if self.scheduler == "inv_sqrt" and self.warmup_steps == 0:
            bad("warmup_steps", "inv_sqrt needs warmup_steps > 0 (the peak is at the end of the warm-up)")
        if self.eval_tgt_len is not None and self.eval_tgt_len < 1:
            bad("eval_tgt_len", "must be >= 1")


@dataclass
class EvalConfig:
    """How the trained model is evaluated (the ``eval`` section; the defaults of ``txl eval``).

    The paper evaluates with a longer memory than in training and ``same_length``."""

    split: Literal["train", "valid", "test"] = "test"
    """Split to evaluate."""
    batch_size: int = 10
    """Columns evaluated in parallel."""
    tgt_len: int = 64
    """Segment length."""
    mem_len: int = 640
    """Memory length (usually longer than in training)."""
    clamp_len: int = -1
    """Relative distances above this share one positional embedding (-1: none)."""
    same_length: bool = True
    """Every query sees the same number (mem_len) of keys."""


@dataclass
class RunConfig:
    """All sections of a run, as saved in RUN/config.yaml and in every checkpoint (run.json)."""

    model: TransformerXLConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    run_dir: str = "runs/default"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "data": asdict(self.data),
            "train": asdict(self.train),
            "eval": asdict(self.eval),
            "run_dir": self.run_dir,
        }


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_recipe(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> RunConfig:
    """A recipe YAML (sections model/data/train/eval, run_dir) merged with nested ``overrides``, as a RunConfig.

    (``txl train --config`` parses the same files with jsonargparse; this is the library-side loader.)
    """
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    raw = _merge(raw, overrides or {})
    unknown = set(raw) - {"model", "data", "train", "eval", "run_dir"}
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}")
    try:
        return RunConfig(
            model=TransformerXLConfig(**raw.get("model", {})),
            data=DataConfig(**raw.get("data", {})),
            train=TrainConfig(**raw.get("train", {})),
            eval=EvalConfig(**raw.get("eval", {})),
            run_dir=raw.get("run_dir", "runs/default"),
        )
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
