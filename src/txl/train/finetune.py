"""Fine-tuning the sequence-classification head (``txl finetune``) and predicting with it (``txl predict``).
Design notes: docs/internals.md#txltrainfinetune."""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from txl.config import MAX_SEED, MIN_SEED, SEED_RANGE
from txl.data import Tokenizer
from txl.data.download import sha256_file
from txl.infer.evaluate import segments_from_end
from txl.kernels.backends import Backends, backends, use_backends
from txl.kernels.runtime import check_fits
from txl.model.modeling import TransformerXL, TransformerXLConfig, TransformerXLForSequenceClassification
from txl.train.checkpoint import RunLock, latest_checkpoint, resolve_model_dir, save_checkpoint, verify_checksums
from txl.train.finetune_data import (  # noqa: F401 (encode_prefix, read_split: re-exported)
    Example,
    FinetuneError,
    Task,
    _parse_label,
    _rows,
    _split_file,
    encode_prefix,
    label_names,
    read_split,
    targets,
)
from txl.train.loop import TrainingLoop, step_memory_bound
from txl.util.distributed import World
from txl.util.fileio import write_bytes
from txl.util.folders import CheckpointError, read_json
from txl.util.metrics import Reporter, truncate_metrics

FINETUNE_CONFIG = "finetune.json"


@dataclass
class FinetuneConfig:
    """How to fine-tune (the options of ``txl finetune``)."""

    model: str
    """The pretrained language model (or a fine-tuned classifier, whose body starts a new one): a run folder, a
    checkpoint or a model folder (its tokenizer reads the text)."""
    data: str
    """Folder with train.csv/.jsonl and valid.csv/.jsonl (rows: text, label)."""
    run_dir: str = "runs/finetune"
    """Run folder (metrics.jsonl, checkpoints/step-N/); an existing one is resumed."""
    task: Task = "single"
    """single (one class per text), multi (a set of classes), regression (a number)."""
    tgt_len: int = 128
    """Segment length: a document is read this many tokens at a time."""
    mem_len: int | None = None
    """Memory carried between segments (None: the model's mem_len, as in its training: fine-tuning trains)."""
    clamp_len: int | None = None
    """Relative distances beyond this are treated as this one (None: the model's; -1: no clamping). Documents far
    longer than the language model's training window read better with its training span here."""
    memory: bool = True
    """Carry the memory across segments (false: only the last segment is read, the fixed-context baseline)."""
    grad_segments: int = 1
    """The gradient reaches the last this many segments of each document (through the memory between them)."""
    max_tokens: int = 4096
    """Documents longer than this are cut to their first max_tokens tokens."""
    batch_size: int = 8
    """Documents per step."""
    lr: float = 2.5e-4
    """Learning rate (AdamW, linear warm-up then constant)."""
    head_lr: float = 1e-3
    """Learning rate of the new classification head."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Linear warm-up."""
    max_steps: int = 200
    """Optimizer steps."""
    max_time: float | None = None
    """Stop (validate, save) after this many seconds of training steps (None: no limit); a rerun resumes."""
    clip: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping; the norm is still checked and logged)."""
    dropout: float | None = None
    """Dropout while fine-tuning (None: the model's)."""
    eval_interval: int = 50
    """Evaluate on valid every this many steps (and at the end)."""
    checkpoint_interval: int = 50
    """Save a checkpoint every this many steps (and at the end)."""
    keep_last: int = 2
    """Checkpoints kept (plus the best by validation loss)."""
    seed: int = 1111
    """Seed of the head's initialisation, dropout and the data order (64 bits: -2**63 to 2**63 - 1)."""
    threads: int | None = None
    """torch CPU threads (None: torch's default)."""
    from_scratch: bool = False
    """Start from random weights of the model's configuration instead of its trained weights."""
    fast_paths: dict[str, Any] | None = None
    """Changes to the fast-path policy for this run, as txl train's ``train.fast_paths`` (``txl.Backends``' fields,
    docs/speed.md), e.g. {native_attention: false}; the log says which policy ran. None: the default policy."""

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise FinetuneError(f"--{name} = {getattr(self, name)!r}: {why}")

        for name in ("tgt_len", "grad_segments", "max_tokens", "batch_size", "max_steps", "eval_interval"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        for name in ("checkpoint_interval", "keep_last"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.threads is not None and self.threads < 1:
            bad("threads", "must be >= 1 (or left out: torch's default)")
        for name in ("warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        if not MIN_SEED <= self.seed <= MAX_SEED:
            bad("seed", SEED_RANGE)
        if self.mem_len is not None and self.mem_len < 0:
            bad("mem_len", "must be >= 0")
        if self.clamp_len is not None and self.clamp_len != -1 and self.clamp_len <= 0:
            bad("clamp_len", "must be -1 (no clamping) or > 0")
        if self.clip < 0:
            bad("clip", "must be >= 0")
        if self.max_time is not None and self.max_time <= 0:
            bad("max_time", "must be > 0")
        if self.lr <= 0 or self.head_lr <= 0:
            bad("lr", "learning rates must be > 0")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            bad("dropout", "must be in [0, 1)")
        if self.task not in ("single", "multi", "regression"):
            bad("task", "must be single, multi or regression")
        if Backends.why_not(self.fast_paths):  # (a mapping of Backends' fields, each of its type)
            bad("fast_paths", Backends.why_not(self.fast_paths))


def batch_ids(docs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad documents to the longest: ids [B, L] and padding [B, L] (True = padding). :func:`document_logits`
    reads them in segments counted from the end, so padding fills only what the longest leaves of its first one."""
    length = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), length, dtype=torch.long)
    pad = torch.ones(len(docs), length, dtype=torch.bool)
    for i, d in enumerate(docs):
        ids[i, length - len(d) :] = torch.tensor(d)
        pad[i, length - len(d) :] = False
    return ids, pad


# ---------------------------------------------------------------------------------------------------------------
# The model over long documents
# ---------------------------------------------------------------------------------------------------------------


def document_logits(
    model: TransformerXLForSequenceClassification,
    ids: torch.Tensor,
    pad: torch.Tensor,
    *,
    tgt_len: int,
    mem_len: int,
    memory: bool = True,
    grad_segments: int = 1,
) -> torch.Tensor:
    """Logits [B, num_labels] of left-padded documents ``ids`` [B, L], read segment by segment with a memory of
    ``mem_len`` (or, without ``memory``, only the last segment). The segments are counted from the end: each is
    ``tgt_len`` positions but the first, which takes what is left (padding before the documents' tokens is never
    attended to and keeps their distances, so a row reads what it would read padded to whole segments, in fewer
    positions)."""
    segments = segments_from_end(ids.shape[1], tgt_len)
    n = len(segments)
    first = 0 if memory else n - 1
    grad = torch.is_grad_enabled()
    mems, mem_pad, out = None, None, None
    for s in range(first, n):
        seg, seg_pad = ids[:, segments[s]], pad[:, segments[s]]
        window_pad = seg_pad if mems is None else torch.cat([mem_pad, seg_pad], dim=1)  # [B, M + T]
        with_grad = grad and s >= n - grad_segments
        with torch.set_grad_enabled(with_grad):
            out = model.transformer(
                seg, mems, mem_len=mem_len, padding=window_pad, detach_mems=not (with_grad and s < n - 1)
            )
        mems = out.mems
        if mems is not None:
            mem_pad = window_pad[:, window_pad.shape[1] - mems[0].shape[1] :]
    return model.score(out.last_hidden_state[:, -1])  # the last position is real in every row (left padding)


def loss_fn(logits: torch.Tensor, y: torch.Tensor, task: Task) -> torch.Tensor:
    if task == "single":
        return F.cross_entropy(logits, y)
    if task == "multi":
        return F.binary_cross_entropy_with_logits(logits, y)
    return F.mse_loss(logits.squeeze(-1), y)


def metrics(logits: torch.Tensor, y: torch.Tensor, task: Task) -> dict[str, float]:
    """accuracy and macro-F1 (single), exact-match accuracy and micro-F1 (multi), MSE (regression)."""
    if task == "regression":
        return {"mse": float(F.mse_loss(logits.squeeze(-1), y))}
    if task == "single":
        pred = logits.argmax(-1)
        f1s = []
        for c in range(logits.shape[1]):
            tp = float(((pred == c) & (y == c)).sum())
            fp, fn = float(((pred == c) & (y != c)).sum()), float(((pred != c) & (y == c)).sum())
            if tp + fp + fn:
                f1s.append(2 * tp / (2 * tp + fp + fn))
        return {"accuracy": float((pred == y).float().mean()), "f1": float(np.mean(f1s)) if f1s else 0.0}
    pred = (logits > 0).float()
    tp, fp, fn = float((pred * y).sum()), float((pred * (1 - y)).sum()), float(((1 - pred) * y).sum())
    return {
        "accuracy": float((pred == y).all(-1).float().mean()),
        "f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0,
    }


@torch.no_grad()
def predict_logits(model, docs: list[list[int]], cfg: FinetuneConfig, mem_len: int, batch_size: int = 16):
    model.eval()
    out = []
    for i in range(0, len(docs), batch_size):
        ids, pad = batch_ids(docs[i : i + batch_size])
        out.append(document_logits(model, ids, pad, tgt_len=cfg.tgt_len, mem_len=mem_len, memory=cfg.memory))
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


def finetune(cfg: FinetuneConfig) -> Path:
    """Fine-tune (or resume) and return the run folder, which is locked for the run (as ``txl train`` locks its
    own: a second command on the same folder stops with one line)."""
    cfg.validate()
    lock = RunLock(Path(cfg.run_dir), "txl finetune")
    try:
        with use_backends(**Backends.changes(cfg.fast_paths or {})):  # (fast_paths: this run's policy)
            loop = Finetuner(cfg)
            if not loop.finished:
                loop.fit()
        result = loop.run_dir
    except BaseException:
        lock.release(restore=True)  # (the lock file as it was; no folder if the run made it and never began)
        raise
    lock.release()
    return result


RESUME_FIXED = ("task", "from_scratch", "tgt_len", "mem_len", "clamp_len", "memory", "grad_segments", "max_tokens",
                "batch_size", "dropout", "weight_decay", "seed")  # fmt: skip
"""Settings a resumed fine-tuning run must keep: they decide its model, its data order or what its optimizer state
means (max_steps, the intervals, keep_last, threads and the learning rates may change)."""


def _resumable(checkpoint: Path, cfg: FinetuneConfig, data_sha256: dict[str, str | None]) -> dict[str, Any]:
    """The checkpoint's fine-tuning record, once it is known to fit ``cfg`` and its data (nothing is written
    before: a refused resume leaves the run folder as it was)."""
    record = checkpoint / FINETUNE_CONFIG
    if not record.is_file():
        raise FinetuneError(
            f"{checkpoint}: no {FINETUNE_CONFIG} (a checkpoint of another command than txl finetune); choose another "
            "--run_dir"
        )
    saved = _record(record)
    changed = [f"{k}: run {saved[k]!r}, now {getattr(cfg, k)!r}" for k in RESUME_FIXED
               if k in saved and saved[k] != getattr(cfg, k)]  # fmt: skip
    if changed:
        raise FinetuneError(
            f"{checkpoint}: resuming needs the run's settings ({'; '.join(changed)}); give them as before, or choose "
            "another --run_dir"
        )
    for split, digest in (saved.get("data_sha256") or {}).items():  # (None: a run from before it was recorded)
        if digest != data_sha256.get(split):
            raise FinetuneError(
                f"{checkpoint}: the run was fine-tuned on another {split} file than {cfg.data}'s; resume with its "
                "data, or choose another --run_dir"
            )
    return saved


def _read_data(cfg: FinetuneConfig, tokenizer: Tokenizer) -> tuple[list[Example], list[Example], dict]:
    """The training and validation documents (every tenth training row held out without a valid file), and the
    files' sha256 (a resumed run checks them)."""
    folder = Path(cfg.data)
    train_file = _split_file(folder, "train")
    if train_file is None:
        raise FinetuneError(f"{folder}: no train.csv or train.jsonl")
    train = read_split(train_file, cfg.task, tokenizer, cfg.max_tokens)
    valid_file = _split_file(folder, "valid")
    if valid_file is None:  # every tenth row held out
        if len(train) < 10:
            raise FinetuneError(
                f"{train_file}: {len(train)} rows are too few to hold out every tenth for validation; "
                "add a valid.csv or valid.jsonl"
            )
        valid, train = train[::10], [e for i, e in enumerate(train) if i % 10]
    else:
        valid = read_split(valid_file, cfg.task, tokenizer, cfg.max_tokens)
    return train, valid, {"train": sha256_file(train_file), "valid": sha256_file(valid_file) if valid_file else None}


def _classifier(
    cfg: FinetuneConfig, source: Path, resume: Path | None, num_labels: int
) -> TransformerXLForSequenceClassification:
    """The classifier: the checkpoint being resumed, else a new head on the language model's body (or on random
    weights, ``from_scratch``)."""
    if resume is not None:
        model = TransformerXLForSequenceClassification.from_pretrained(resume)
        verify_checksums(resume)  # (a file that reads but was damaged: one error naming it)
        return model
    fields = TransformerXLConfig.__dataclass_fields__
    saved = json.loads((source / "config.json").read_text())
    lm_cfg = TransformerXLConfig.from_dict({k: v for k, v in saved.items() if k in fields})
    lm_cfg.num_labels = num_labels
    if cfg.dropout is not None:
        lm_cfg.dropout = cfg.dropout
    if cfg.clamp_len is not None:
        lm_cfg.clamp_len = cfg.clamp_len  # (saved with the classifier: predict reads the same way)
    model = TransformerXLForSequenceClassification(lm_cfg)
    if not cfg.from_scratch:  # the body of a language model (or of another fine-tuned classifier)
        model.transformer.load_state_dict(TransformerXL.from_pretrained(source).state_dict())
    return model


class Finetuner(TrainingLoop):
    """``txl finetune``: the classification head (and the body) trained on labelled documents, read segment by
    segment with the memory carried, on the loop ``txl train`` runs (:class:`~txl.train.loop.TrainingLoop`: clipping,
    the non-finite checks, SIGTERM/Ctrl-C saving, max_time, the final validation and save)."""

    def __init__(self, cfg: FinetuneConfig):
        cfg.validate()
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.world = World()
        self.finished = False  # (a resumed run that had already reached max_steps: nothing is done or written)
        self.run_dir = run_dir = Path(cfg.run_dir)
        resume = latest_checkpoint(run_dir) if run_dir.exists() else None
        source = resume or resolve_model_dir(cfg.model)
        self.tok_file = source / "tokenizer.json"
        if not self.tok_file.is_file():
            raise FinetuneError(f"{source}: no tokenizer.json to read the texts with")
        n_token = TransformerXLForSequenceClassification.load_config(source).n_token
        tokenizer = Tokenizer.load(self.tok_file).for_model(n_token, self.tok_file)
        train, valid, data_sha256 = _read_data(cfg, tokenizer)
        names = _resumable(resume, cfg, data_sha256)["labels"] if resume is not None else label_names(train, cfg.task)
        self.train, self.valid = train, valid
        self.y_train, self.y_valid = targets(train, cfg.task, names), targets(valid, cfg.task, names)
        num_labels = len(names) if cfg.task != "regression" else 1

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        model = _classifier(cfg, source, resume, num_labels)
        self.model = model
        # Fine-tuning trains: it reads as training did (the model's config.json), not with the evaluation settings
        # that the commands reading text with a trained model use (txl.infer.evaluate.reading_settings).
        self.mem_len = model.config.mem_len if cfg.mem_len is None else cfg.mem_len
        head = list(model.score.parameters())
        body = [p for n, p in model.named_parameters() if not n.startswith("score.")]
        self.params = body + head
        self.optimizer = torch.optim.AdamW(
            [{"params": body, "lr": cfg.lr}, {"params": head, "lr": cfg.head_lr}], weight_decay=cfg.weight_decay
        )
        self.base_lrs = [cfg.lr, cfg.head_lr]
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.start_loop()
        self.max_steps, self.max_time, self.clip = cfg.max_steps, cfg.max_time, cfg.clip
        self.eval_interval, self.checkpoint_interval = cfg.eval_interval, cfg.checkpoint_interval
        self.retry_hint = (
            "the weights were not updated; run the same command again (it resumes from the last checkpoint) "
            "with a lower --lr"
        )
        self.resume_hint = "run the same command again (it resumes from the last checkpoint)"
        self.epoch = self.position = 0
        if resume is not None:
            state = torch.load(resume / "train_state-rank0.pt", map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
            self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
            best = state["best"]
            self.best_valid = None if best["step"] is None else best["loss"]
            self.best_step = best["step"]
            self.elapsed = state.get("elapsed", 0.0)
            self.last_saved = self.step
            torch.set_rng_state(state["rng"]["torch"])
            self.finished = self.step >= cfg.max_steps
            if self.finished:  # (probes.md n03, n04: the record rewritten with options never used, a row again)
                print(f"{run_dir}: finished at step {self.step} (max_steps {cfg.max_steps}): nothing to do")
                return
            truncate_metrics(run_dir, self.step)
        seg = min(cfg.tgt_len, max(len(e.ids) for e in train + valid))  # (no segment is longer than a document)
        check_fits(  # (before anything is written: an allocation that cannot be made fails deep in the first step)
            step_memory_bound(model.config, cfg.batch_size, seg, self.mem_len, 4),
            f"a fine-tuning step of {cfg.batch_size:,} documents x segments of {seg:,} with a memory of "
            f"{self.mem_len:,}", "give a smaller --tgt_len, --batch_size or --mem_len",
        )  # fmt: skip
        run_dir.mkdir(parents=True, exist_ok=True)
        self.record = asdict(cfg) | {
            "labels": names,
            "num_labels": num_labels,
            "mem_len_used": self.mem_len,
            "data_sha256": data_sha256,
        }
        write_bytes(run_dir / FINETUNE_CONFIG, (json.dumps(self.record, indent=1) + "\n").encode())
        self.reporter = Reporter(run_dir, enabled=True, progress=False, tensorboard=False, total=cfg.max_steps)
        self.say(
            f"fine-tuning {sum(p.numel() for p in model.parameters()):,} parameters ({cfg.task}, {num_labels} "
            f"outputs) on {len(train)} documents ({len(valid)} valid); segments of {cfg.tgt_len}, memory "
            f"{self.mem_len if cfg.memory else 0}"
        )
        self.say(f"runtime: {backends().describe()}")
        self.perm = self.order(self.epoch)

    def order(self, epoch: int) -> list[int]:
        """The data order of ``epoch`` (a function of the seed: resumable exactly)."""
        return np.random.default_rng([self.cfg.seed % 2**64, epoch]).permutation(len(self.train)).tolist()

    def progress(self) -> dict[str, Any]:
        """Before a step: the data order's epoch and position, and the random state (for :meth:`rewind`)."""
        return {"epoch": self.epoch, "position": self.position, "perm": self.perm, "rng": torch.get_rng_state()}

    def rewind(self, progress: dict[str, Any]) -> None:
        self.epoch, self.position, self.perm = progress["epoch"], progress["position"], progress["perm"]
        torch.set_rng_state(progress["rng"])

    def train_one(self) -> tuple[float, float]:
        cfg, model = self.cfg, self.model
        model.train()
        if self.position >= len(self.perm):
            self.epoch, self.position = self.epoch + 1, 0
            self.perm = self.order(self.epoch)
        rows = self.perm[self.position : self.position + cfg.batch_size]
        self.position += len(rows)
        scale = min(1.0, (self.step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = lr * scale
        ids, pad = batch_ids([self.train[i].ids for i in rows])
        logits = document_logits(
            model, ids, pad, tgt_len=cfg.tgt_len, mem_len=self.mem_len, memory=cfg.memory,
            grad_segments=cfg.grad_segments,
        )  # fmt: skip
        loss = loss_fn(logits, self.y_train[rows], cfg.task)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._last = (logits.detach(), rows)
        return self.update(loss.detach(), f"step {self.step + 1:,} (epoch {self.epoch}, lr {scale * cfg.lr:.3g})")

    def after_step(self, loss: float, norm: float, seconds: float) -> None:
        logits, rows = self._last
        row = {"step": self.step, "split": "train", "loss": loss, "grad_norm": norm}
        self.reporter.row(row | metrics(logits, self.y_train[rows], self.cfg.task))
        self.reporter.advance(1)

    def validate(self) -> float:
        logits = predict_logits(self.model, [e.ids for e in self.valid], self.cfg, self.mem_len)
        result = {"loss": float(loss_fn(logits, self.y_valid, self.cfg.task))} | metrics(
            logits, self.y_valid, self.cfg.task
        )
        self.reporter.row({"step": self.step, "split": "valid"} | result)
        self.say(f"step {self.step}: valid " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result["loss"]

    def save(self) -> Path:
        best = {"loss": math.inf if self.best_valid is None else self.best_valid, "step": self.best_step}
        state = {
            "step": self.step, "epoch": self.epoch, "position": self.position, "best": best,
            "optimizer": self.optimizer.state_dict(), "rng": {"torch": torch.get_rng_state()}, "world_size": 1,
            "elapsed": self.elapsed,
        }  # fmt: skip
        valid = self.last_valid if self.last_eval_step == self.step else None
        try:
            path = save_checkpoint(
                self.world, self.run_dir, self.step, model=self.model, state=state, tokenizer_file=self.tok_file,
                run_config=self.record, metadata={"step": self.step, "valid_loss": valid, "best_step": self.best_step},
                keep_last=self.cfg.keep_last, keep_steps={self.best_step} if self.best_step is not None else set(),
                config_name=FINETUNE_CONFIG,
            )  # fmt: skip
        except OSError as e:  # (as txl train: one line, the last complete checkpoint kept)
            raise self.checkpoint_error(e) from None
        self.last_saved = self.step
        return path


def _record(path: Path) -> dict[str, Any]:
    """A run's finetune.json, or one error naming the file (probes.md fr1: a damaged one was a bare JSON error)."""
    try:
        return read_json(path)
    except CheckpointError as e:
        raise FinetuneError(
            f"{e}; the fine-tuning record of this run is damaged: restore it, or choose another run"
        ) from None


def load_classifier(path: str | Path) -> tuple[TransformerXLForSequenceClassification, Any, FinetuneConfig, dict]:
    """A fine-tuned run or checkpoint: (model, tokenizer, its configuration, finetune.json)."""
    folder = resolve_model_dir(path)
    if not (folder / FINETUNE_CONFIG).is_file():
        raise FinetuneError(f"{folder}: not a fine-tuned classifier (no {FINETUNE_CONFIG}); use txl finetune first")
    record = _record(folder / FINETUNE_CONFIG)
    fields = {k: v for k, v in record.items() if k in FinetuneConfig.__dataclass_fields__}
    model = TransformerXLForSequenceClassification.from_pretrained(folder).eval()
    tok_file = folder / "tokenizer.json"
    return model, Tokenizer.load(tok_file).for_model(model.config.n_token, tok_file), FinetuneConfig(**fields), record


def predict(path: str | Path, texts: list[str], where: list[str] | None = None) -> list[dict[str, Any]]:
    """Predictions of a fine-tuned classifier for raw texts: label (or labels, or value) and scores.

    ``where`` names each text in errors (e.g. "file: line 3"; default "text N")."""
    return _predictions(*_classify(path, texts, where))


def predict_labelled(path: str | Path, file: str | Path) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    """Predictions for the texts of a CSV (a text column) or JSONL file ("text" fields), and, when every row has a
    label too, the metrics of fine-tuning's validation on them (accuracy and F1, or MSE)."""
    file = Path(file)
    rows = _rows(file, columns=("text",))
    if not rows:  # (probes.md pr3)
        raise FinetuneError(f"{file}: no texts to predict")
    where = [f"{file}: line {n}" for n, _ in rows]
    for (_, row), at in zip(rows, where, strict=True):
        if not isinstance(row.get("text"), str) or not row["text"].strip():
            raise FinetuneError(f"{at}: no text")
    cfg, logits, names = _classify(path, [row["text"] for _, row in rows], where)
    labelled = all(row.get("label") not in (None, "") for _, row in rows)
    if not labelled:
        return _predictions(cfg, logits, names), None
    examples = [
        Example([], _parse_label(row["label"], cfg.task, at, file.suffix == ".csv"), at)
        for (_, row), at in zip(rows, where, strict=True)
    ]
    return _predictions(cfg, logits, names), metrics(logits, targets(examples, cfg.task, names), cfg.task)


def _classify(path, texts: list[str], where: list[str] | None) -> tuple[FinetuneConfig, torch.Tensor, list[str]]:
    if not texts:  # (probes.md pr3: an empty file was torch.cat's error)
        raise FinetuneError(f"{where[0] if where else 'texts'}: no texts to predict")
    model, tok, cfg, record = load_classifier(path)
    docs = []
    for i, t in enumerate(texts):
        at = where[i] if where else f"text {i + 1}"
        try:
            ids = encode_prefix(tok, t, cfg.max_tokens)
        except ValueError as e:
            raise FinetuneError(f"{at}: {e}") from None
        if not ids:
            raise FinetuneError(f"{at}: encodes to no tokens")
        docs.append(ids)
    return cfg, predict_logits(model, docs, cfg, record["mem_len_used"]), record["labels"]


def _predictions(cfg: FinetuneConfig, logits: torch.Tensor, names: list[str]) -> list[dict[str, Any]]:
    out = []
    for row in logits:
        if cfg.task == "regression":
            out.append({"value": float(row[0])})
        elif cfg.task == "single":
            p = row.softmax(-1)
            out.append({"label": names[int(p.argmax())], "scores": dict(zip(names, map(float, p), strict=True))})
        else:
            p = row.sigmoid()
            out.append({"labels": [n for n, x in zip(names, p, strict=True) if x > 0.5],
                        "scores": dict(zip(names, map(float, p), strict=True))})  # fmt: skip
    return out
