"""``txl export onnx``."""

from __future__ import annotations

from pathlib import Path


def export_onnx(
    model: str | None = None,
    out: Path | None = None,
    mem_len: int | None = None,
    same_length: bool | None = None,
    clamp_len: int | None = None,
    last_only: bool = False,
    tolerance: float = 1e-4,
    overwrite: bool = False,
) -> None:
    """Export one segment step to ONNX (dynamic batch, segment and memory lengths), checked with onnxruntime.

    The graph takes input_ids [B, T], mems [n_layer, B, M, d_model] and padding [B, M + T] (True = padding) and
    gives log_probs and new_mems; examples/onnx_generate.py generates text with it, without PyTorch. The model's
    tokenizer is copied beside it (model.onnx -> model.tokenizer.json).

    Args:
        model: A run folder (its best checkpoint), a step-N checkpoint or a model folder.
        out: The .onnx file to write.
        mem_len: Memory kept by the step (default: the model's).
        same_length: Every query attends to the same number of keys (default: the model's).
        clamp_len: Relative distances above this share one position embedding (default: the model's; -1: none).
        last_only: Output the log-probabilities of the last position only ([B, V]; what generation needs).
        tolerance: Largest |difference| from PyTorch allowed on the random-input check.
        overwrite: Replace an existing .onnx file (and its tokenizer beside it).
    """
    from txl.interop.export import export_onnx as run_export
    from txl.train.checkpoint import resolve_model_dir
    from txl.util.fileio import size_of, staged_file, write_bytes

    if model is None or out is None:
        raise ValueError("txl export onnx needs --model RUN_OR_DIR and --out FILE.onnx")
    if not tolerance >= 0:  # (probes.md e03: -1 was taken, and the export failed after its work)
        raise ValueError(f"--tolerance = {tolerance}: must be >= 0 (the largest |difference| from PyTorch allowed)")
    tok = resolve_model_dir(model) / "tokenizer.json"
    tok_out = Path(out).with_suffix(".tokenizer.json")
    if tok.is_file() and tok_out.exists() and not overwrite:  # (checked before anything is written)
        raise ValueError(
            f"--out {out}: its tokenizer would be written to {tok_out}, which exists; give a new name, or "
            "--overwrite true to replace both"
        )
    # (a failed export leaves nothing at --out)
    # (an ONNX file holds the weights once more for each layout its graph uses and the graph itself: 3.5x the
    # safetensors file for the bench models, probes.md n46)
    needed = 4 * size_of(resolve_model_dir(model) / "model.safetensors") + (1 << 20)
    with staged_file(out, overwrite=overwrite, command="txl export", needed=needed) as staged:
        report = run_export(
            model, staged, mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, last_only=last_only,
            tolerance=tolerance,
        )  # fmt: skip
        if tok.is_file():
            write_bytes(tok_out, tok.read_bytes())
    print(
        f"exported {out} (opset {report.opset}); onnxruntime vs PyTorch on {report.checks} random inputs: "
        f"max |diff| {report.max_abs_diff:.2e} (tolerance {tolerance:g})"
    )
