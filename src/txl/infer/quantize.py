"""Quantized inference on the CPU: the model's Linear layers in int8, for generation, evaluation and serving.
Design notes: docs/internals.md#txlinferquantize."""

from __future__ import annotations

import warnings
from typing import get_args

import torch
from torch import nn

from txl.config import Quantization

QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


def quantize(model: nn.Module, how: str | None, device: torch.device | str = "cpu", option: str = "--quantize"):
    """``model`` (in eval mode) with its Linear layers quantized by ``how`` (one of :data:`QUANTIZATIONS`; None or
    "none": unchanged). CPU only. Returns the model (``int8`` returns a new module, as ``quantize_dynamic`` does)."""
    if how in (None, "none"):
        return model
    if how not in QUANTIZATIONS:
        raise ValueError(f"{option} {how}: must be one of {', '.join(QUANTIZATIONS)}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"{option} {how}: quantized inference runs on the CPU (use --device cpu)")
    if model.training:
        raise ValueError(f"{option} {how}: quantization is for inference: call model.eval() first")
    if how == "int8":
        with warnings.catch_warnings():  # (torch marks torch.ao's eager quantization deprecated, in favour of torchao)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ValueError(
            f"{option} {how} needs torchao: pip install 'transformer-xl[quant]' (or use {option} int8)"
        ) from None
    quantize_(model, Int8WeightOnlyConfig())
    return model
