"""The training loop: segment-level recurrence over an ordered stream, with exact resume.
Design notes: docs/internals.md#txltraintrainer."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.nn.parallel import DistributedDataParallel

from txl.config import RunConfig, TrainConfig
from txl.data import OrderedIterator, SentenceStreamIterator, prepare_corpus
from txl.data.download import sha256_file
from txl.infer.evaluate import autocast, evaluate, metric_name, metric_value
from txl.kernels import native
from txl.kernels.backends import Backends, backends, use_backends
from txl.kernels.dropout import MASKS, default_masks, use_masks
from txl.kernels.runtime import (
    ALLOCATOR_NOTE,
    CheckedRoute,
    check_fits,
    choose_fp32_matmul,
    configure_allocator,
    effective_precision,
)
from txl.model.modeling import TransformerXLConfig, TransformerXLLM
from txl.model.pretrained import CheckpointError, load_weights, read_json, read_safetensors
from txl.train.checkpoint import (
    RUN_CONFIG,
    RunLock,
    latest_checkpoint,
    load_states,
    naming_an_earlier_checkpoint,
    read_metadata,
    resolve_model_dir,
    save_checkpoint,
    supersede_later_checkpoints,
    verify_checksums,
)
from txl.train.loop import TrainingError, TrainingLoop, step_memory_bound  # noqa: F401  (TrainingError: re-exported)
from txl.train.optim import build_optimizer, lr_at, set_lr
from txl.util.distributed import World, all_reduce_sum, barrier, init_world, shutdown
from txl.util.fileio import check_space, write_bytes
from txl.util.metrics import Reporter, truncate_metrics

# Fields that may change between a checkpoint and the run resuming it (the reference's --restart does the same).
RESUMABLE_CHANGES = {"dropout", "dropatt"}
SCHEDULE = ("lr", "scheduler", "warmup_steps", "eta_min", "decay_steps", "max_steps")  # what lr_at reads


def mem_len_at(done: int, tc: TrainConfig, mem_len: int) -> int:
    """The memory of the step after ``done`` steps: ``train.mem_len_schedule``'s from that step on, else mem_len."""
    if tc.mem_len_schedule is None:
        return mem_len
    return [m for s, m in tc.mem_len_schedule if s <= done][-1]


def scored_positions(seg_len: int, loss_fraction: float) -> int:
    """How many of a segment's last positions ``train.loss_fraction`` scores (at least one, rounded half up)."""
    return max(1, min(seg_len, int(seg_len * loss_fraction + 0.5)))


@dataclass
class TrainResult:
    step: int
    tokens: int
    stop_reason: str
    checkpoint: Path | None
    valid_loss: float | None
    best_valid_loss: float | None


def _rng_state(device: torch.device, host: bool = True) -> dict[str, Any]:
    """The random generators' states: torch's (and the GPU's), and with ``host`` numpy's and Python's."""
    state = {"torch": torch.get_rng_state()}
    if host:
        np_state = np.random.get_state()
        state["numpy"] = [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]]
        state["python"] = list(random.getstate())
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def regroup_mems(states: list[dict[str, Any]], world: World, n_chunks: int) -> list[list[torch.Tensor] | None]:
    """This process's chunk memories from the memories of all processes and chunks of a checkpoint.

    Rows are ordered rank by rank, chunk by chunk, so the global memory can be re-split for another number of
    processes or chunks (the same global batch).
    """
    saved = [m for s in states for m in s["mems"]]
    if any(m is None for m in saved):
        return [None] * n_chunks
    layers = len(saved[0])
    rows = [torch.cat([m[layer] for m in saved], dim=0) for layer in range(layers)]  # [B_global, M, D] each
    per_rank = rows[0].shape[0] // world.size
    mine = [r[world.rank * per_rank : (world.rank + 1) * per_rank] for r in rows]
    return [list(chunk) for chunk in zip(*(m.chunk(n_chunks, dim=0) for m in mine), strict=True)]


class Trainer(TrainingLoop):
    """Train ``cfg`` in ``cfg.run_dir``; ``resume`` is ``auto`` (latest checkpoint if any), ``none`` or a path."""

    def __init__(self, cfg: RunConfig, resume: str = "auto", *, world: World | None = None):
        self.cfg, self.tc = cfg, cfg.train
        self.world = world or init_world(cfg.train.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.run_dir = Path(cfg.run_dir)
        self.lock = self._lock_run_dir()
        self.reporter: Reporter | None = None
        try:
            self._setup(resume)
        except BaseException:
            self.close(failed=True)
            raise

    def _setup(self, resume: str) -> None:
        cfg, tc, w = self.cfg, self.tc, self.world
        if tc.precision == "fp16" and w.device.type != "cuda":
            raise ValueError("train.precision = 'fp16' needs CUDA (GradScaler); on CPU use bf16")
        per_rank = tc.batch_size // w.size
        if tc.batch_size % w.size or per_rank % tc.batch_chunk:
            raise ValueError(
                f"train.batch_size = {tc.batch_size} must split evenly over {w.size} process(es) and then into "
                f"train.batch_chunk = {tc.batch_chunk} chunks"
            )
        if tc.eval_batch_size % w.size:
            raise ValueError(f"train.eval_batch_size = {tc.eval_batch_size} must split evenly over {w.size} processes")
        self.checkpoint_to_load = self._find_resume(resume)
        with naming_an_earlier_checkpoint(self.checkpoint_to_load):
            start = read_metadata(self.checkpoint_to_load)["step"] if self.checkpoint_to_load else -1
        # Nothing in the run folder changes until the checkpoint, the config and the data are known to fit: the
        # log is held, and the later checkpoints and metrics rows are set aside only after the checkpoint loaded.
        self.reporter = Reporter(
            self.run_dir, enabled=w.is_main, progress=tc.progress, tensorboard=tc.tensorboard, total=tc.max_steps,
            hold=True,
        )  # fmt: skip
        self.say = self.reporter.say
        self.precision, note = effective_precision(w.device, tc.precision)
        if note:
            self.say(f"note: train.precision = {tc.precision}: {note}" if tc.precision == "auto" else
                     f"note: train.precision = bf16, but {note}")  # fmt: skip
        self._runtime()

        # Data: process 0 tokenizes (or checks the cache) first; the others then find it ready.
        corpus = prepare_corpus(cfg.data, log=self.say) if w.is_main else None
        barrier(w)
        self.corpus = corpus or prepare_corpus(cfg.data, log=lambda _: None)
        self.tokenizer_file = self.corpus.path / "tokenizer.json"
        self.metric = metric_name(self.corpus.tokenizer.kind)
        cfg.model = self._model_config(cfg.model, self.corpus.tokenizer.vocab_size)

        with torch.device("meta"):  # (the model's size known before it is built: a one-line error, not a crash)
            n = sum(p.numel() for p in TransformerXLLM(cfg.model).parameters())
        if w.device.type == "cpu":
            check_fits(
                16 * n, f"a model of {n:,} parameters (fp32 weights, gradients and Adam's two moments)",
                "make it smaller (model.d_model, n_layer, d_inner, n_token)",
            )  # fmt: skip
        m = cfg.model
        train = self.corpus.splits["train"]
        kw = dict(seed=tc.seed, rank=w.rank, world_size=w.size, device=w.device)
        if isinstance(train, list):
            self.train_iter = SentenceStreamIterator(train, tc.batch_size, tc.tgt_len, **kw)
        else:
            self.train_iter = OrderedIterator(
                train, tc.batch_size, tc.tgt_len, ext_len=tc.ext_len, varlen=tc.varlen, **kw
            )
        self._check_splits_fit()
        mems = (m.n_layer + 1) * m.mem_len * tc.batch_size * m.d_model
        check_space(  # (a checkpoint: fp32 weights, Adam's two moments, the memories; a re-save keeps the old one)
            self.run_dir, 4 * (3 * n + mems), f"a checkpoint of {n:,} parameters",
            "free space, or choose a --run_dir on a disk with more",
        )  # fmt: skip
        torch.manual_seed(tc.seed)
        self.model = TransformerXLLM(cfg.model).to(w.device)
        self.net = self.model
        if w.distributed:
            ids = [w.device.index] if w.device.type == "cuda" else None
            # Tail clusters of the adaptive softmax without a target in a batch get no gradient.
            unused = len(cfg.model.cutoffs) > 0
            self.net = DistributedDataParallel(self.model, device_ids=ids, find_unused_parameters=unused)
        torch.manual_seed(tc.seed + w.rank)  # dropout: different masks on different processes
        self.params = list(self.model.parameters())  # tied tensors once
        self.optimizer = build_optimizer(self.params, tc, w.device)
        self.scaler = torch.amp.GradScaler(w.device.type, enabled=tc.precision == "fp16")
        self.mems: list[list[torch.Tensor] | None] = [None] * tc.batch_chunk
        self.start_loop()
        self.max_steps, self.max_time, self.clip, self.keep_best = tc.max_steps, tc.max_time, tc.clip, tc.keep_best
        self.eval_interval, self.checkpoint_interval = tc.eval_interval, tc.checkpoint_interval
        self.retry_hint = (
            "the weights were not updated; resume from the last checkpoint with --resume auto, e.g. with a lower "
            "--train.lr"
        )
        self.tokens = 0
        self.acc = {"loss": 0.0, "steps": 0, "tokens": 0, "time": 0.0}
        self._epoch = 0
        self._batch_tokens, self._recon = 0, None  # (recon: a float, the mean over processes)
        if self.checkpoint_to_load is not None:
            self._check_resumable(self.checkpoint_to_load)
            with naming_an_earlier_checkpoint(self.checkpoint_to_load):
                self._load(self.checkpoint_to_load)
        superseded = []
        if w.is_main:  # rows (and checkpoints) after the checkpoint belong to a continuation this run replaces
            truncate_metrics(self.run_dir, start)
            if start >= 0:
                superseded = supersede_later_checkpoints(self.run_dir, start)
            self.reporter.commit()
        if superseded:
            self.say(
                f"going on from step {start:,}: the later checkpoints of this run "
                f"({', '.join(p.name.split('.')[0] for p in superseded)}) were moved to {superseded[0].parent}"
            )
        if w.is_main:
            write_bytes(self.run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode())

    # -- setup ------------------------------------------------------------------------------------------------

    def _check_splits_fit(self) -> None:
        """Before anything is written: the validation split fills the periodic evaluation's columns (it would
        fail at the first validation, after the steps before it), and on the CPU one training step's activations
        fit in the free memory (an allocation that cannot be made fails deep inside the first step)."""
        tc, m, w = self.tc, self.cfg.model, self.world
        valid = self.corpus.splits["valid"]
        if not isinstance(valid, list) and len(valid) // tc.eval_batch_size < 2:
            raise ValueError(
                f"train.eval_batch_size = {tc.eval_batch_size}: the valid split's {len(valid):,} tokens cannot fill "
                f"{tc.eval_batch_size} columns of at least 2 tokens (one input and one target); give a smaller "
                "train.eval_batch_size"
            )
        if w.device.type != "cpu":
            return
        seg = self.train_iter.max_seq_len  # (a column of the stream bounds a segment)
        rows = tc.batch_size // w.size // tc.batch_chunk
        half = self.precision in ("bf16", "fp16")
        check_fits(
            step_memory_bound(m, rows, seg + tc.ext_len, m.mem_len, 2 if half else 4),
            f"a training step of {rows:,} rows x {seg:,} positions with mem_len {m.mem_len:,}",
            "give a smaller train.tgt_len, train.batch_size or model.mem_len, or split the batch (train.batch_chunk)",
        )  # fmt: skip

    def _configure_cpu(self) -> None:
        """malloc settings, and whether fp32 GEMMs may take oneDNN's route (txl.kernels.runtime; opt-in with
        train.fp32_route): measured by process 0 of a new run and given to the others; a resumed run keeps its
        checkpoint's choice, since the two paths round differently (the speed check is noisy, and a choice made
        again could differ from the one the interrupted run made). Under the route every kind of product is checked
        exact before it is routed (:class:`CheckedRoute`, entered by :meth:`fit`)."""
        w = self.world
        if configure_allocator():
            self.say(f"runtime: {ALLOCATOR_NOTE}")
        self.say(f"runtime: {native.status()}")  # (dropout and evaluation run slower without them)
        self.say(f"runtime: {backends().describe()}")
        if not torch.backends.mkldnn.is_available():
            return
        earlier = read_metadata(self.checkpoint_to_load).get("fp32_route") if self.checkpoint_to_load else None
        if earlier is None and not self.tc.fp32_route:
            self.fp32_route = False
            return
        choice = choose_fp32_matmul(earlier=earlier) if w.is_main or earlier is not None else None
        if earlier is None and w.distributed:  # one choice for every process: process 0's
            chosen = all_reduce_sum(w, float(choice.enabled) if choice else 0.0)[0] > 0
            choice = choice or choose_fp32_matmul(earlier=chosen)
        self.fp32_route = choice.enabled
        self.say(f"runtime: {choice.describe()}")

    def _runtime(self) -> None:
        """The process's settings for this run (each said in the log): the CPU's allocator and fp32 route, the
        dropout masks' stream, which backends training and validation take."""
        w = self.world
        self.fp32_route: bool | None = None  # (CPU) fp32 GEMMs through oneDNN; saved with every checkpoint
        self.route: CheckedRoute | None = None  # (its checks, while fit() runs with the route)
        if w.device.type == "cpu":
            self._configure_cpu()
        else:
            self.say(f"runtime: {backends().describe()}")
        self.masks = self._dropout_masks()  # (the CPU's dropout stream: saved with every checkpoint, kept on resume)
        self.say(f"runtime: {backends().training_paths(w.device.type, self.precision)}")  # (which backends run)
        self.say(f"runtime: {backends().inference_paths(w.device.type, self.precision)}")  # (validation's)

    def _dropout_masks(self) -> str:
        """The stream of the run's CPU dropout masks (txl.kernels.dropout): a resumed run keeps its checkpoint's,
        so that it draws the masks the interrupted run would have, whichever kernels this machine has; a new run
        takes this process's default (Philox's where the native dropout runs)."""
        earlier = read_metadata(self.checkpoint_to_load).get("dropout_masks") if self.checkpoint_to_load else None
        if earlier is not None and earlier not in MASKS:
            raise TrainingError(
                f"{self.checkpoint_to_load}/metadata.json: dropout_masks is {earlier!r}, not one of {', '.join(MASKS)}"
                "; resume from a checkpoint that txl wrote"
            )
        w = self.world
        masks = earlier or (default_masks() if w.is_main else "torch")  # (one stream for every process: process 0's)
        if earlier is None and w.distributed:
            masks = "philox" if all_reduce_sum(w, float(masks == "philox"))[0] > 0 else "torch"
        slow = masks == "philox" and not native.dropout_ready()
        how = " (kept from the run being resumed)" if earlier else ""
        note = "; without the native kernel here they are drawn in PyTorch operations, slower" if slow else ""
        self.say(f"runtime: CPU dropout masks from the {masks} stream{how}{note}")
        return masks

    def _lock_run_dir(self) -> RunLock | None:
        """Process 0 locks the run folder; every process stops if that fails (one run per folder)."""
        w = self.world
        lock, error = None, None
        if w.is_main:
            try:
                lock = RunLock(self.run_dir)
            except CheckpointError as e:
                error = e
        if all_reduce_sum(w, float(error is not None))[0] > 0:
            raise error or CheckpointError(f"{self.run_dir} is in use by another txl train (see process 0)")
        return lock

    def close(self, failed: bool = False) -> None:
        """Close the logs and release the run folder (``failed``: a run that never began; its lock file is put back
        as it was, so the folder is byte-identical)."""
        if self.reporter is not None:
            self.reporter.close()
        if self.lock is not None:
            self.lock.release(restore=failed)
            self.lock = None

    def _find_resume(self, resume: str) -> Path | None:
        existing = latest_checkpoint(self.run_dir)
        if resume == "auto":
            return existing
        if resume == "none":
            if existing is not None:
                raise ValueError(
                    f"{self.run_dir} already has checkpoints (latest {existing.name}); continue it with --resume auto, "
                    "or choose another --run_dir"
                )
            return None
        return resolve_model_dir(resume, prefer="latest")

    def _model_config(self, model: TransformerXLConfig, vocab_size: int) -> TransformerXLConfig:
        """The recipe's model for the corpus's vocabulary: n_token from it, and the adaptive softmax's cutoffs at or
        past its end dropped (with their clusters' tie_projs entries), so that one recipe fits any text."""
        if model.n_token == vocab_size:
            return model
        self.say(
            f"model.n_token = {vocab_size:,} (the vocabulary of {self.cfg.data.label}; "
            f"the config said {model.n_token:,})"
        )
        changes: dict[str, Any] = {"n_token": vocab_size}
        kept = [c for c in model.cutoffs if c < vocab_size]
        if len(kept) < len(model.cutoffs):
            changes.update(cutoffs=kept, tie_projs=model.tie_projs[: len(kept) + 1])
            dropped = ", ".join(f"{c:,}" for c in model.cutoffs[len(kept) :])
            self.say(
                f"model.cutoffs = {kept} (the clusters from {dropped} on lie past the vocabulary's end; "
                f"the config said {model.cutoffs})"
            )
        try:
            return TransformerXLConfig.from_dict({**model.to_dict(), **changes})
        except ValueError as e:
            what = "adjust model.cutoffs, and model.tie_projs to one entry per cluster if the recipe sets it"
            raise ValueError(f"{e} (n_token is the vocabulary size, {vocab_size:,}: {what})") from None

    def _check_resumable(self, folder: Path) -> None:
        """The checkpoint fits this run: the same architecture, and the same vocabulary (a corpus whose symbols got
        other ids would go on training silently with them). A ValueError, not a damaged checkpoint: an earlier
        checkpoint of the run would not fit either, so none is suggested."""
        saved_cfg = TransformerXLLM.load_config(folder).to_dict()
        ours = self.cfg.model.to_dict()
        diff = [f"{k}: checkpoint {saved_cfg.get(k)!r}, config {v!r}" for k, v in ours.items() if saved_cfg.get(k) != v]
        blocking = [d for d in diff if d.split(":")[0] not in RESUMABLE_CHANGES]
        if blocking:
            raise ValueError(
                f"{folder}: the checkpoint's model differs from the config ({'; '.join(blocking)}); resume needs the "
                "same architecture - change the config back, or start a new --run_dir"
            )
        saved_tok = folder / "tokenizer.json"
        if saved_tok.is_file() and sha256_file(saved_tok) != sha256_file(self.tokenizer_file):
            raise ValueError(
                f"{folder}: the checkpoint was trained with another vocabulary than {self.cfg.data.label}'s "
                f"({self.tokenizer_file}): its ids would mean other symbols; resume with the run's data, or start a "
                "new --run_dir"
            )
        trained_on = read_metadata(folder).get("train_data_sha256")  # (None: a checkpoint from before it was kept)
        if trained_on is not None and trained_on != self.corpus.fingerprint("train"):
            raise ValueError(
                f"{folder}: the checkpoint was trained on other text than {self.cfg.data.label}'s train split (its "
                "token ids differ): its data position would point elsewhere; resume with the run's data, or start a "
                "new --run_dir"
            )

    def _load(self, folder: Path) -> None:
        w, tc = self.world, self.tc
        states = load_states(folder)
        mine = states[w.rank] if w.rank < len(states) else states[0]
        weights = read_safetensors(folder / "model.safetensors")
        verify_checksums(folder)  # (a file that reads but was damaged: probes.md n57)
        load_weights(self.model, weights, str(folder / "model.safetensors"))
        self.optimizer.load_state_dict(mine["optimizer"])
        self.scaler.load_state_dict(mine["scaler"])
        saved, ours = mine["iterator"].get("batch_size"), getattr(self.train_iter, "batch_size", None)
        if saved is not None and ours is not None and saved != ours:  # (probes.md t15: the iterator's own words)
            raise ValueError(
                f"{folder}: trained with a batch of {saved} columns, this run asks for {ours} (--train.batch_size, "
                "per process): the data order goes on only with the checkpoint's; keep it, or start a new --run_dir"
            )
        self.train_iter.load_state_dict(mine["iterator"])
        self.step, self.tokens, self.elapsed = mine["step"], mine["tokens"], mine["elapsed"]
        self.best_valid, self.best_step = mine["best_valid"], mine["best_step"]
        self.last_valid, self.last_eval_step = mine["last_valid"], mine["last_eval_step"]
        self.acc, self._epoch = dict(mine["acc"]), mine["epoch"]
        self.last_saved = self.step
        if len(states) != w.size or mine["batch_chunk"] != tc.batch_chunk:
            self.say(f"resuming a {len(states)}-process checkpoint with {w.size} process(es): memories regrouped")
        mems = regroup_mems(states, w, tc.batch_chunk)  # the saved split itself when nothing changed
        self.mems = [None if m is None else [t.to(w.device) for t in m] for m in mems]
        if len(states) == w.size:
            _set_rng_state(mine["rng"], w.device)
        self.say(f"resumed from {folder} at step {self.step:,} ({self.tokens:,} tokens)")
        self._schedule_note(folder)

    def _schedule_note(self, folder: Path) -> None:
        """Say so when the learning rate from here on is not the one the checkpoint's run would have used (a longer
        --train.max_steps re-plans a cosine schedule: the rate goes back up to where the longer one has it)."""
        saved = read_json(folder / RUN_CONFIG).get("train", {})
        self._memory_note(saved)
        fields = [f for f in SCHEDULE if f in saved and saved[f] != getattr(self.tc, f)]
        if not fields:
            return
        before = dataclasses.replace(self.tc, **{f: saved[f] for f in fields})
        now, then = lr_at(self.step + 1, self.tc), lr_at(self.step + 1, before)
        if not math.isclose(now, then, rel_tol=1e-9, abs_tol=1e-12):
            changed = ", ".join(f"{f} {saved[f]} -> {getattr(self.tc, f)}" for f in fields)
            self.say(
                f"note: the learning-rate schedule changed ({changed}): step {self.step + 1:,} gets lr {now:.3g} "
                f"where the checkpoint's run would have used {then:.3g}"
            )

    def _memory_note(self, saved: dict[str, Any]) -> None:
        """Say so when the memory from here on is not the one the checkpoint's run would have used (a changed
        --train.mem_len_schedule, probes.md n28: a memory shrinking from 16 to 4 went unsaid)."""
        plain = lambda sched: None if sched is None else [list(x) for x in sched]  # noqa: E731
        if "mem_len_schedule" not in saved or plain(saved["mem_len_schedule"]) == plain(self.tc.mem_len_schedule):
            return
        mem_len = self.cfg.model.mem_len
        before = dataclasses.replace(self.tc, mem_len_schedule=saved["mem_len_schedule"])
        now, then = mem_len_at(self.step, self.tc, mem_len), mem_len_at(self.step, before, mem_len)
        if now != then:
            self.say(
                f"note: the memory schedule changed ({saved['mem_len_schedule']} -> {self.tc.mem_len_schedule}): "
                f"step {self.step + 1:,} carries a memory of {now} where the checkpoint's run would have used {then}"
            )

    def _state(self) -> dict[str, Any]:
        return {
            "world_size": self.world.size,
            "batch_chunk": self.tc.batch_chunk,
            "step": self.step,
            "tokens": self.tokens,
            "elapsed": self.elapsed,
            "best_valid": self.best_valid,
            "best_step": self.best_step,
            "last_valid": self.last_valid,
            "last_eval_step": self.last_eval_step,
            "acc": dict(self.acc),
            "epoch": self._epoch,
            "optimizer": self.optimizer.state_dict(),  # the learning rate is a function of the step
            "scaler": self.scaler.state_dict(),
            "iterator": self.train_iter.state_dict(),
            "mems": [None if m is None else [t.detach().cpu() for t in m] for m in self.mems],
            "rng": _rng_state(self.world.device),
        }

    # -- one step ---------------------------------------------------------------------------------------------

    def train_step(self, batch) -> tuple[float, float]:
        """Forward/backward over the chunks, check, clip and update. Returns (loss, grad norm)."""
        tc, w = self.tc, self.world
        self.model.train()
        lr = lr_at(self.step + 1, tc)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        if w.device.type in backends().compiled_layers_graphs:  # (the layers' CUDA graphs: last step's outputs dead)
            torch.compiler.cudagraph_mark_step_begin()
        n = tc.batch_chunk
        mem = mem_len_at(self.step, tc, self.cfg.model.mem_len)
        target = batch.target
        if tc.loss_fraction < 1.0:  # score the last positions only (the model scores targets right-aligned)
            target = target[:, target.shape[1] - scored_positions(target.shape[1], tc.loss_fraction) :]
        inputs, targets = batch.input.chunk(n, dim=0), target.chunk(n, dim=0)
        loss_sum, recons = torch.zeros((), dtype=torch.float32, device=w.device), []
        for c in range(n):
            sync = self.net.no_sync() if w.distributed and c < n - 1 else contextlib.nullcontext()
            with sync:
                with autocast(w.device, self.precision):
                    out = self.net(inputs[c], targets[c], mems=self.mems[c], ext_len=tc.ext_len, mem_len=mem)
                loss, recon = out.loss.float() / n, out.recon_loss  # (recon: a Compressive Transformer's, for f_c)
                self.scaler.scale(loss if recon is None else loss + recon.float() / n).backward()
            self.mems[c] = out.mems
            loss_sum += loss.detach()
            recons += [] if recon is None else [recon.detach().float() / n]
        where = f"step {self.step + 1:,} (after {self.tokens:,} tokens, lr {lr:.3g})"
        loss, norm, *recon = self.update(loss_sum, where, *([torch.stack(recons).sum()] if recons else []))
        self._recon = recon[0] if recon else None  # (the mean over processes, as the loss's)
        return loss, norm

    # -- the loop (txl.train.loop) ----------------------------------------------------------------------------

    def stop_reason(self) -> str | None:
        if self.tc.max_tokens is not None and self.tokens >= self.tc.max_tokens:
            return f"max_tokens {self.tc.max_tokens:,}"
        return None

    def progress(self) -> dict[str, Any]:
        """Before a step: the data's position, the memories (a step replaces them, never writes into them), the
        epoch and torch's random state (what :meth:`rewind` restores after a step that failed). numpy's and
        Python's generators are not taken (~40 us a step): no step draws from them, so at a failure they are still
        as the step found them."""
        iterator, rng = copy.deepcopy(self.train_iter.state_dict()), _rng_state(self.world.device, host=False)
        return {"iterator": iterator, "mems": list(self.mems), "epoch": self._epoch, "rng": rng}

    def rewind(self, progress: dict[str, Any]) -> None:
        self.train_iter.load_state_dict(progress["iterator"])
        self.mems, self._epoch = progress["mems"], progress["epoch"]
        _set_rng_state(progress["rng"], self.world.device)

    def train_one(self) -> tuple[float, float]:
        batch = next(self._batches)
        if batch.epoch != self._epoch:  # a new pass over the data: the old memories do not precede it
            self._epoch, self.mems = batch.epoch, [None] * self.tc.batch_chunk
        self._batch_tokens = batch.target.numel() * self.world.size
        return self.train_step(batch)

    def after_step(self, loss: float, norm: float, seconds: float) -> None:
        self.tokens += self._batch_tokens
        for key, value in (("loss", loss), ("steps", 1), ("tokens", self._batch_tokens), ("time", seconds)):
            self.acc[key] += value
        if self._recon is not None:  # (the attention-reconstruction loss)
            self.acc["recon"] = self.acc.get("recon", 0.0) + self._recon
        self.reporter.advance(1, loss=f"{loss:.3f}")
        if self.step % self.tc.log_interval == 0:
            self._log_train(norm)

    @contextlib.contextmanager
    def around_steps(self):
        """The checked fp32 route's checks (train.fp32_route) around every step and validation."""
        self.route = CheckedRoute() if self.fp32_route else None
        try:
            with self.route if self.route is not None else contextlib.nullcontext(), use_masks(self.masks):
                yield
        finally:
            if self.route is not None:
                self.say(f"runtime: {self.route.describe()}")

    def validate(self) -> float:
        tc, m = self.tc, self.cfg.model
        eval_tgt = tc.eval_tgt_len or tc.tgt_len
        mem = m.mem_len + tc.tgt_len - eval_tgt if m.mem_len > 0 else 0
        res = evaluate(
            self.model,
            self.corpus.splits["valid"],
            batch_size=tc.eval_batch_size,
            tgt_len=eval_tgt,
            mem_len=mem,
            max_batches=tc.eval_max_steps,
            precision=self.precision,
            world=self.world,
        )
        value = metric_value(res.loss, self.metric)
        self.reporter.row(
            {"step": self.step, "split": "valid", "tokens": self.tokens, "loss": res.loss, self.metric: value}
        )
        self.say(f"| valid | step {self.step:>8,} | loss {res.loss:.4f} | {self.metric} {value:.4f} |")
        return res.loss

    def save(self) -> Path:
        meta = {
            "step": self.step,
            "tokens": self.tokens,
            "valid_loss": self.last_valid,
            "best_valid_loss": self.best_valid,
            "best_step": self.best_step,
            "world_size": self.world.size,
            "torch": torch.__version__,
            "train_data_sha256": self.corpus.fingerprint("train"),
            "backends": backends().to_dict(),
            "fp32_route": self.fp32_route,
            "dropout_masks": self.masks,
            "fp32_route_kinds": None
            if self.route is None
            else {"routed": self.route.routed, "not_exact": self.route.refused},
        }
        keep = {self.best_step} if self.tc.keep_best and self.best_step is not None else set()
        try:
            path = save_checkpoint(
                self.world,
                self.run_dir,
                self.step,
                model=self.model,
                state=self._state(),
                tokenizer_file=self.tokenizer_file,
                run_config=self.cfg.to_dict(),
                metadata=meta,
                keep_last=self.tc.keep_last,
                keep_steps=keep,
            )
        except OSError as e:
            raise self.checkpoint_error(e) from None
        self.last_saved = self.step
        return path

    def fit(self) -> TrainResult:
        tc, w = self.tc, self.world
        n_params = sum(p.numel() for p in self.params)
        self.say(
            f"training {n_params:,} parameters on {w.size} process(es) ({w.device}, {self.precision}); "
            f"batch {tc.batch_size} x tgt_len {tc.tgt_len}, mem_len {self.cfg.model.mem_len}"
            + (f" (the memory grows: {tc.mem_len_schedule})" if tc.mem_len_schedule else "")
            + f"; run folder {self.run_dir}"
        )
        self._batches = self.train_iter.forever()
        reason, path = super().fit()
        return TrainResult(self.step, self.tokens, reason, path, self.last_valid, self.best_valid)

    def _log_train(self, norm: float) -> None:
        a = self.acc
        loss = a["loss"] / a["steps"]
        value = metric_value(loss, self.metric)
        row = {
            "step": self.step,
            "split": "train",
            "tokens": self.tokens,
            "loss": loss,
            self.metric: value,
            "lr": lr_at(self.step, self.tc),
            "grad_norm": norm,
            "tokens_per_s": a["tokens"] / a["time"] if a["time"] > 0 else 0.0,
            "epoch": self._epoch,
        }
        if "recon" in a:
            row["recon"] = a["recon"] / a["steps"]
        self.reporter.row(row)
        recon = f" recon {row['recon']:.4g} |" if "recon" in row else ""
        self.say(
            f"| step {self.step:>8,} | tokens {self.tokens:>12,} | lr {row['lr']:.3g} | loss {loss:.4f} | "
            f"{self.metric} {value:.4f} |{recon} grad norm {norm:.3f} | {row['tokens_per_s']:,.0f} tok/s |"
        )
        self.acc = {"loss": 0.0, "steps": 0, "tokens": 0, "time": 0.0}


def train(cfg: RunConfig, resume: str = "auto") -> TrainResult:
    """Train ``cfg`` (joining the torchrun process group when there is one)."""
    world = init_world(cfg.train.device)
    try:
        with use_backends(**Backends.changes(cfg.train.fast_paths or {})):  # (train.fast_paths: this run's policy)
            trainer = Trainer(cfg, resume, world=world)
            try:
                return trainer.fit()
            finally:
                trainer.close()
    finally:
        shutdown(world)
