"""ONNX export of one Transformer-XL segment step (``txl export onnx``), checked with onnxruntime right after.
Design notes: docs/internals.md#txlinteropexport."""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from txl.model.modeling import TransformerXLLM

OPSET = 18


class ExportError(ValueError):
    """The model cannot be exported with these options, or the export does not match PyTorch; the message says why."""


class SegmentStep(nn.Module):
    """One segment on top of the memory: what ``model.onnx`` computes (see the module docstring)."""

    def __init__(self, lm: TransformerXLLM, mem_len: int, same_length: bool, clamp_len: int, last_only: bool):
        super().__init__()
        self.lm, self.mem_len, self.same_length, self.clamp_len, self.last_only = (
            lm,
            mem_len,
            same_length,
            clamp_len,
            last_only,
        )

    def forward(self, input_ids: Tensor, mems: Tensor, padding: Tensor) -> tuple[Tensor, Tensor]:
        out = self.lm.transformer(
            input_ids,
            list(mems.unbind(0)),
            mem_len=self.mem_len,
            same_length=self.same_length,
            clamp_len=self.clamp_len,
            padding=padding,
        )
        h = out.last_hidden_state[:, -1:] if self.last_only else out.last_hidden_state  # [B, T or 1, D]
        B, T, D = h.shape
        _, log_probs = self.lm.crit(h.reshape(B * T, D), None, True)  # [B*T, V]
        log_probs = log_probs.reshape(B, T, -1)
        return (log_probs[:, 0] if self.last_only else log_probs), torch.stack(out.mems)


@dataclass
class ExportReport:
    path: Path
    max_abs_diff: float
    checks: int
    opset: int

    def to_dict(self) -> dict:
        return {"onnx": str(self.path), "max_abs_diff": self.max_abs_diff, "checks": self.checks, "opset": self.opset}


def _refuse_unexportable(lm: TransformerXLLM, mem_len: int) -> None:
    cfg = lm.config
    if mem_len <= 0:  # (probes.md e05: a negative one was reported as 0)
        raise ExportError(f"mem_len = {mem_len}: the exported step carries a memory; give --mem_len > 0")
    if cfg.attn_type != 0:
        raise ExportError(
            f"attn_type {cfg.attn_type} (absolute positions, an ablation variant) cannot be exported: "
            "its positions move with the window; export an attn_type 0 (Transformer-XL) model"
        )
    if cfg.cmem_len:
        raise ExportError(
            f"cmem_len {cfg.cmem_len}: the exported step carries one memory, not a Compressive Transformer's "
            "compressed memory (not exportable yet)"
        )


def _inputs(cfg, B: int, T: int, M: int, generator: torch.Generator, pad_rows: bool) -> tuple[Tensor, Tensor, Tensor]:
    ids = torch.randint(0, cfg.n_token, (B, T), generator=generator)
    mems = torch.randn(cfg.n_layer, B, M, cfg.d_model, generator=generator)
    padding = torch.zeros(B, M + T, dtype=torch.bool)
    if pad_rows and B > 1:  # left padding of different lengths, never the last position
        for b in range(1, B):
            padding[b, : min(b * 2, M + T - 1)] = True
    return ids, mems, padding


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's notes that concern torch itself, not this model (the torchvision operators it skips, its own
    deprecated calls), kept off the user's terminal; its errors still reach them."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
            yield
    finally:
        registration.setLevel(level)


def export_onnx(
    model_dir: str | Path,
    out: str | Path,
    *,
    mem_len: int | None = None,
    same_length: bool | None = None,
    clamp_len: int | None = None,
    last_only: bool = False,
    tolerance: float = 1e-4,
) -> ExportReport:
    """Export the step of the model in ``model_dir`` to ``out`` and check it with onnxruntime on random inputs of
    several shapes against PyTorch: :class:`ExportError` when the largest difference exceeds ``tolerance``."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError:
        raise ExportError("ONNX export needs the onnx extra: pip install 'transformer-xl[onnx]'") from None
    from txl.util.folders import resolve_model_dir

    folder = resolve_model_dir(model_dir)
    lm = TransformerXLLM.from_pretrained(folder).eval()
    cfg = lm.config
    mem_len = cfg.mem_len if mem_len is None else mem_len
    same_length = cfg.same_length if same_length is None else same_length
    clamp_len = cfg.clamp_len if clamp_len is None else clamp_len
    _refuse_unexportable(lm, mem_len)
    step = SegmentStep(lm, mem_len, same_length, clamp_len, last_only).eval()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    g = torch.Generator().manual_seed(0)
    example = _inputs(cfg, 2, 3, 4, g, pad_rows=False)
    auto = torch.export.Dim.AUTO  # (the window is segment + memory: export infers how the sizes relate)
    dynamic = {"input_ids": {0: auto, 1: auto}, "mems": {1: auto, 2: auto}, "padding": {0: auto, 1: auto}}
    try:
        with torch.no_grad(), _quiet_exporter():
            program = torch.onnx.export(
                step,
                example,
                dynamo=True,
                input_names=["input_ids", "mems", "padding"],
                output_names=["log_probs", "new_mems"],
                dynamic_shapes=dynamic,
                opset_version=OPSET,
                optimize=True,
                verbose=False,
            )
    except Exception as e:  # the exporter's errors are long: the first line, and the options of this model
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        options = f"attn_type {cfg.attn_type}, same_length {same_length}, cutoffs {cfg.cutoffs}, div_val {cfg.div_val}"
        raise ExportError(f"{folder}: the ONNX exporter failed ({options}): {first}") from e
    meta = {
        "txl.mem_len": mem_len,
        "txl.n_layer": cfg.n_layer,
        "txl.d_model": cfg.d_model,
        "txl.n_token": cfg.n_token,
        "txl.last_only": int(last_only),
        "txl.same_length": int(same_length),
        "txl.clamp_len": clamp_len,
    }
    model = program.model_proto
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=json.dumps(value))
    onnx.save(model, str(out))

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    worst, checks = 0.0, 0
    shapes = [(1, 1, mem_len, False), (3, 7, 5, True), (2, 16, 1, True), (1, 5, mem_len, False), (4, 1, 9, True)]
    shapes += [(2, 6, 0, True), (1, mem_len + 3, 0, False)]  # an empty memory (the first segment)
    for B, T, M, pad_rows in shapes:
        ids, mems, padding = _inputs(cfg, B, T, M, g, pad_rows)
        with torch.no_grad():
            want = step(ids, mems, padding)
        got = session.run(None, {"input_ids": ids.numpy(), "mems": mems.numpy(), "padding": padding.numpy()})
        for w, o in zip(want, got, strict=True):
            if tuple(w.shape) != o.shape:
                raise ExportError(f"{out}: onnxruntime gives shape {o.shape}, PyTorch {tuple(w.shape)} (B={B} T={T})")
            worst = max(worst, float(np.abs(w.numpy() - o).max()))
        checks += 1
    if not worst <= tolerance:
        raise ExportError(f"{out}: onnxruntime differs from PyTorch by {worst:.3g} > {tolerance:g}")
    return ExportReport(out, worst, checks, OPSET)
