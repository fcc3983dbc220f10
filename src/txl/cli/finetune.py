"""``txl finetune`` and ``txl predict``."""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path

from txl.cli.common import _set_threads


def finetune(cfg=None) -> None:
    """Fine-tune the sequence-classification head on labelled texts (CSV or JSONL: text, label), starting from a
    trained language model. Long documents are read segment by segment with the memory carried; the run folder
    resumes exactly, like txl train's. Prints the run folder."""
    from txl.train.finetune import finetune as run_finetune

    print(run_finetune(cfg))


def predict(
    model: Path | None = None,
    text: str | list[str] | None = None,
    file: Path | None = None,
    threads: int | None = None,
) -> None:
    """Classify texts with a fine-tuned model: one JSON line per text (label or labels or value, and scores).

    Args:
        model: A fine-tuned run folder or checkpoint (txl finetune).
        text: A text, or a list of texts ('["a", "b"]').
        file: A file of texts: .jsonl (a "text" field per line), .csv (a text column) or plain text (one per line).
            When every row also has a label, the accuracy and F1 (or MSE) follow on stderr.
        threads: torch CPU threads.
    """
    from txl.train.finetune import predict as run_predict
    from txl.train.finetune import predict_labelled

    if model is None or (text is None) == (file is None):
        raise ValueError("txl predict needs --model RUN and one of --text or --file")
    if text is not None and (not text if isinstance(text, list) else not text.strip()):
        raise ValueError('--text: give a text, or a list of texts (\'["a", "b"]\'); it was empty')
    if file is not None and not file.is_file():
        raise ValueError(f"--file {file}: not a file (give a .jsonl, .csv or plain-text file of texts)")
    _set_threads(threads)
    summary = None
    if file is not None and file.suffix in (".jsonl", ".csv"):
        records, summary = predict_labelled(model, file)
    elif file is not None:
        lines = [(n, line) for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
        if not lines:
            raise ValueError(f"--file {file}: no texts to predict")
        records = run_predict(model, [line for _, line in lines], [f"{file}: line {n}" for n, _ in lines])
    else:
        records = run_predict(model, [text] if isinstance(text, str) else list(text))
    for record in records:
        print(_json.dumps(record, ensure_ascii=False))
    if summary is not None:  # every row had a label: how the predictions compare (as fine-tuning's validation)
        scores = ", ".join(f"{k} {v:.4f}" for k, v in summary.items())
        print(f"{file}: {scores} on {len(records):,} labelled texts", file=sys.stderr)
