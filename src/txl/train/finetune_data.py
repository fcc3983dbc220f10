"""The labelled data of ``txl finetune``: CSV or JSONL rows (text, label) read, checked (each error names the file
and line) and encoded; the labels' names and the targets' tensor."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from txl.data import Tokenizer

Task = Literal["single", "multi", "regression"]


class FinetuneError(ValueError):
    """Bad fine-tuning data or configuration; the message names the file and line."""


@dataclass
class Example:
    ids: list[int]
    label: Any
    where: str  # "file: line N"


def _rows(path: Path, columns: tuple[str, ...] = ("text", "label")) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of a CSV (a header with ``columns``) or JSONL file."""
    rows = []
    try:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8-sig") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line, object_pairs_hook=_unique_keys)
                    except json.JSONDecodeError as e:
                        raise FinetuneError(f"{path}: line {n}: not a JSON object ({e.msg})") from None
                    except _DuplicateKey as e:  # (probes.md fl: the last one silently won)
                        raise FinetuneError(f"{path}: line {n}: the key {e.args[0]!r} is given twice") from None
                    if not isinstance(row, dict):
                        raise FinetuneError(f"{path}: line {n}: not a JSON object")
                    rows.append((n, row))
        else:
            with path.open(encoding="utf-8-sig", newline="") as f:
                reader = csv.DictReader(f)
                missing = set(columns) - set(reader.fieldnames or [])
                if missing:
                    raise FinetuneError(
                        f"{path}: line 1: the header has no {' and no '.join(sorted(missing))} column "
                        f"(it needs {' and '.join(columns)}, has {reader.fieldnames})"
                    )
                width = len(reader.fieldnames)
                for row in reader:
                    extra, short = row.get(None), None in row.values()
                    if extra or short:  # (probes.md f12: extra fields were dropped silently)
                        count = width + len(extra or []) - sum(v is None for v in row.values())
                        raise FinetuneError(
                            f"{path}: line {reader.line_num}: {count} fields, the header has {width} "
                            "(a text with commas must be in double quotes)"
                        )
                    rows.append((reader.line_num, row))
    except UnicodeDecodeError as e:
        raise FinetuneError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return rows


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _split_file(folder: Path, split: str) -> Path | None:
    found = [folder / f"{split}.{ext}" for ext in ("csv", "jsonl") if (folder / f"{split}.{ext}").is_file()]
    if len(found) > 1:
        raise FinetuneError(f"{folder}: both {found[0].name} and {found[1].name}; keep one")
    return found[0] if found else None


def _parse_label(raw: Any, task: Task, where: str, csv_file: bool) -> Any:
    if raw is None or (isinstance(raw, str) and not raw.strip()) or raw == []:
        raise FinetuneError(f"{where}: no label")
    if task == "regression":
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise FinetuneError(f"{where}: label {raw!r} is not a number (task regression)") from None
        if not math.isfinite(value):
            raise FinetuneError(f"{where}: label {raw!r} is not a finite number")
        return value
    if task == "multi":
        names = raw.split("|") if csv_file and isinstance(raw, str) else raw
        if isinstance(names, str) or not isinstance(names, list) or not all(isinstance(x, str | int) for x in names):
            raise FinetuneError(f"{where}: label {raw!r}: task multi needs a list of class names")
        return sorted({_class_name(str(x)) for x in names})
    if isinstance(raw, list | dict | float) and not (isinstance(raw, float) and raw.is_integer()):
        raise FinetuneError(f"{where}: label {raw!r}: task single needs one class name")
    return _class_name(str(int(raw) if isinstance(raw, float) else raw))


_INTEGRAL = re.compile(r"[+-]?\d+\.0*")


def _class_name(name: str) -> str:
    """A class name as written, except a whole number written with a decimal point ("1.0", as pandas writes an
    integer column that had a gap): the number ("1"), so that "1" and "1.0" are one class (probes.md fc), as JSON's
    1 and 1.0 already are."""
    name = name.strip()
    return str(int(float(name))) if _INTEGRAL.fullmatch(name) else name


PREFIX_MARGIN = 16
"""Tokens past the kept ones that a prefix of a text must encode to before its cut is trusted not to reach them."""


def encode_prefix(tokenizer: Tokenizer, text: str, n: int) -> list[int]:
    """``tokenizer.encode(text)[:n]``, encoding only as much of ``text`` as that needs (probes.md fbig: a 110 MB
    text was encoded whole, 2.5 GB, before the cut): a prefix of up to 8n characters ending at a space, doubled until
    it gives ``PREFIX_MARGIN`` tokens more than kept (characters, bytes and words are read left to right, so the
    tokens before the cut are the whole text's)."""
    size = max(8 * n, 1024)
    while size < len(text):
        cut = max(text.rfind(" ", 0, size), text.rfind("\n", 0, size))  # (at a space: no word is cut in two)
        if cut > 0:
            ids = tokenizer.encode(text[:cut])
            if len(ids) >= n + PREFIX_MARGIN:
                return ids[:n]
        size *= 2
    return tokenizer.encode(text)[:n]


def read_split(path: Path, task: Task, tokenizer, max_tokens: int) -> list[Example]:
    """Rows of one file as token ids and parsed labels; any bad row is an error naming file and line."""
    examples = []
    for n, row in _rows(path):
        where = f"{path}: line {n}"
        for key in ("text", "label"):
            if key not in row:
                raise FinetuneError(f"{where}: no {key!r} field (each row needs text and label)")
        text = row["text"]
        if not isinstance(text, str):  # (probes.md fg: a number was reported as an empty text)
            raise FinetuneError(f"{where}: the text must be a string, not {type(text).__name__} ({text!r:.40})")
        if not text.strip():
            raise FinetuneError(f"{where}: empty text")
        label = _parse_label(row["label"], task, where, path.suffix == ".csv")
        try:
            ids = encode_prefix(tokenizer, text, max_tokens)
        except ValueError as e:
            raise FinetuneError(f"{where}: {e}") from None
        if not ids:
            raise FinetuneError(f"{where}: the text encodes to no tokens")
        examples.append(Example(ids, label, where))
    if not examples:
        raise FinetuneError(f"{path}: no rows")
    return examples


def label_names(train: list[Example], task: Task) -> list[str]:
    if task == "regression":
        return []
    names = sorted({n for e in train for n in (e.label if task == "multi" else [e.label])})
    if task == "single" and len(names) < 2:
        raise FinetuneError(f"the training data has {len(names)} class ({names}); single-label needs at least 2")
    return names


def targets(examples: list[Example], task: Task, names: list[str]) -> torch.Tensor:
    """Labels as the loss wants them; a class missing from train is an error naming the row."""
    index = {n: i for i, n in enumerate(names)}

    def idx(name: str, e: Example) -> int:
        if name not in index:
            raise FinetuneError(f"{e.where}: label {name!r} does not occur in the training data ({len(names)} classes)")
        return index[name]

    if task == "regression":
        return torch.tensor([e.label for e in examples], dtype=torch.float32)
    if task == "single":
        return torch.tensor([idx(e.label, e) for e in examples], dtype=torch.long)
    out = torch.zeros(len(examples), len(names))
    for row, e in enumerate(examples):
        for name in e.label:
            out[row, idx(name, e)] = 1.0
    return out
