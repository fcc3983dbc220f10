"""What every training loop of txl shares: ``txl train``'s :class:`~txl.train.trainer.Trainer` and ``txl finetune``'s
:class:`~txl.train.finetune.Finetuner` are both a :class:`TrainingLoop`.
Design notes: docs/internals.md#txltrainloop."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from txl.model.config import TransformerXLConfig
from txl.util.distributed import World, all_reduce_sum
from txl.util.folders import latest_checkpoint
from txl.util.metrics import Reporter


def step_memory_bound(m: TransformerXLConfig, rows: int, seg: int, mem: int, itemsize: int) -> int:
    """Bytes that one training step of ``rows`` x ``seg`` positions over a memory of ``mem`` holds at least for its
    backward: every layer's attention probabilities [rows, n_head, seg, mem + seg] and feed-forward activations
    [rows, seg, d_inner], ``itemsize`` bytes a value (a lower bound: what else a step keeps is not counted)."""
    per_layer = rows * seg * (m.n_head * (mem + seg) + m.d_inner)
    return m.n_layer * per_layer * itemsize


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient, a checkpoint that cannot be written); the message says
    where, what was kept and how to go on."""


class NonFiniteStep(TrainingError):
    """A non-finite loss or gradient norm, found before the weights change. Both are all-reduced, so every process
    finds it at the same step: the steps before it can be saved together, under torchrun too."""


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class TrainingLoop:
    """The shared loop. A subclass's setup sets the attributes below, then :meth:`fit` runs."""

    world: World
    run_dir: Path
    reporter: Reporter
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    scaler: torch.amp.GradScaler
    max_steps: int
    max_time: float | None = None
    eval_interval: int = 0
    checkpoint_interval: int = 0
    keep_best: bool = False
    clip: float = 0.0
    retry_hint: str = "the weights were not updated"
    """What the user can do after a non-finite loss or gradient (the subclass names its own options)."""
    resume_hint: str = "resume with --resume auto"
    """How the user goes on after a checkpoint could not be written."""

    def start_loop(self) -> None:
        """The loop's counters (a resumed run then sets ``step``, ``elapsed`` and the best validation)."""
        self.step = 0
        self.elapsed = 0.0
        self.best_valid: float | None = None
        self.best_step: int | None = None
        self.last_valid: float | None = None
        self.last_eval_step: int | None = None
        self.last_saved: int | None = None
        self._stop_signal = False
        self._updating = False

    def say(self, text: str) -> None:
        self.reporter.say(text)

    # -- what a subclass provides ---------------------------------------------------------------------------------

    def train_one(self) -> tuple[float, float]:
        """One optimizer step (forward, backward, :meth:`update`); returns (loss, gradient norm)."""
        raise NotImplementedError

    def validate(self) -> float:
        """The validation loss (and its rows in the log)."""
        raise NotImplementedError

    def save(self) -> Path:
        """A checkpoint of the current step."""
        raise NotImplementedError

    def latest(self) -> Path | None:
        """The newest complete checkpoint (the run's result when the last step is saved already)."""
        return latest_checkpoint(self.run_dir)

    def progress(self) -> Any:
        """What a step moves besides the weights and the optimizer's moments (the data's position, the memories, the
        random state), taken before each step so that one failing before the weights change can be undone and the
        steps before it saved; None: the subclass cannot rewind (a failing step then loses the steps since the last
        checkpoint)."""
        return None

    def rewind(self, progress: Any) -> None:
        """Back to :meth:`progress`'s state (a step failed before the optimizer changed the weights)."""
        raise NotImplementedError

    def stop_reason(self) -> str | None:
        """A reason of the subclass's own to stop before the next step (e.g. a token budget), or None."""
        return None

    def around_steps(self) -> contextlib.AbstractContextManager:
        """Entered around the steps and validations (e.g. the checked fp32 route); closed before the summary."""
        return contextlib.nullcontext()

    def after_step(self, loss: float, norm: float, seconds: float) -> None:
        """Accounting and logging after step ``self.step``."""

    def checkpoint_error(self, e: OSError) -> TrainingError:
        """The one-line error of a checkpoint that could not be written (a full disk, a read-only folder): what
        failed, that the last complete checkpoint is intact, and how to go on."""
        last = self.latest()
        cause = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        kept = f"the last complete checkpoint, {last}, is intact" if last else "no complete checkpoint exists yet"
        return TrainingError(
            f"could not write checkpoint step-{self.step} in {self.run_dir / 'checkpoints'} ({cause}); {kept}. "
            f"Free space or fix the folder's permissions, then {self.resume_hint}"
        )

    # -- one update -----------------------------------------------------------------------------------------------

    def update(self, loss_sum: torch.Tensor, where: str, *extra: torch.Tensor) -> tuple[float, ...]:
        """After the backward pass(es) of a step: unscale, clip the global gradient norm to ``clip`` (0: no clipping;
        the norm is still checked), refuse a non-finite loss or gradient before the weights change, and step.
        ``loss_sum`` is this process's loss (a 0-d tensor), ``extra`` other 0-d values of this process's to log (a
        Compressive Transformer's reconstruction loss); returns (the mean loss over processes, the norm, the mean of
        each extra value): one device-to-host copy and one reduction for all of them."""
        w = self.world
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip if self.clip > 0 else math.inf)
        local_loss, norm_value, *local_extra = torch.stack([loss_sum.float(), norm.float(), *extra]).tolist()
        loss_value, *extra_values = (v / w.size for v in all_reduce_sum(w, local_loss, *local_extra))
        if not math.isfinite(loss_value):
            raise NonFiniteStep(f"non-finite training loss ({loss_value}) at {where}: {self.retry_hint}")
        if not math.isfinite(norm_value) and not self.scaler.is_enabled():
            raise NonFiniteStep(f"non-finite gradient norm ({norm_value}) at {where}: {self.retry_hint}")
        self._updating = True  # (from here a failure may leave the weights half updated: nothing is saved then)
        self.scaler.step(self.optimizer)  # fp16: skips the update (and lowers the scale) on inf/nan gradients
        self.scaler.update()
        return loss_value, norm_value, *extra_values

    # -- the loop -------------------------------------------------------------------------------------------------

    def _stop_reason(self) -> str | None:
        if self.step >= self.max_steps:
            return f"max_steps {self.max_steps:,}"
        own = self.stop_reason()
        if own is not None:
            return own
        flags = all_reduce_sum(
            self.world, float(self._stop_signal), float(self.max_time is not None and self.elapsed >= self.max_time)
        )
        if flags[0] > 0:
            return "signal"
        if flags[1] > 0:
            return f"max_time {self.max_time:g} s"
        return None

    def _on_signal(self, signum, frame) -> None:  # noqa: ANN001 (signal's handler protocol)
        """SIGTERM or a first Ctrl-C: finish the step, save, stop. A second Ctrl-C interrupts at once."""
        self._stop_signal = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _unsaved(self) -> bool:
        """Steps since the last checkpoint."""
        return self.step > 0 and self.last_saved != self.step

    def _save_first(self, what: str) -> None:
        """After ``what`` failed: save the steps before it, say so (the error itself goes up from the caller)."""
        try:
            path = self.save()
        except Exception as e:  # (the first error is the one reported; this one is said)
            self.say(f"{what} failed, and the steps before it could not be saved: {e}")
            return
        self.say(f"{what} failed: the steps before it were saved first, {path}")

    def _train_step(self) -> tuple[float, float]:
        """:meth:`train_one`; where it fails, the steps before it are saved first (undone to before the step): by one
        process, or by all of them together where every one failed alike (:class:`NonFiniteStep`)."""
        before = None
        if self._unsaved():
            before = self.progress(), [group["lr"] for group in self.optimizer.param_groups]
        self._updating = False
        try:
            return self.train_one()
        except Exception as e:
            alike = self.world.size == 1 or isinstance(e, NonFiniteStep)
            if before is not None and before[0] is not None and alike:
                what = f"step {self.step + 1:,}"
                if self._updating:
                    last = self.latest()
                    kept = f"the last complete checkpoint is {last}" if last else "no checkpoint exists yet"
                    self.say(f"{what} failed while the optimizer changed the weights: they are not saved; {kept}")
                else:
                    self.rewind(before[0])
                    for group, lr in zip(self.optimizer.param_groups, before[1], strict=True):
                        group["lr"] = lr
                    self._save_first(what)
            raise

    def _evaluate_and_track(self) -> bool:
        try:
            valid = self.validate()
        except Exception:  # (its own steps are not lost with it: they are saved first, where one process runs)
            if self.world.size == 1 and self._unsaved():  # (alone: a collective save could hang)
                self._save_first(f"the validation at step {self.step:,}")
            raise
        self.last_valid, self.last_eval_step = valid, self.step
        if self.best_valid is None or self.last_valid < self.best_valid:
            self.best_valid, self.best_step = self.last_valid, self.step
            return True
        return False

    def fit(self) -> tuple[str, Path | None]:
        """Run steps until a stop condition; validate and save at the end. Returns (why it stopped, checkpoint)."""
        old = {}
        if _in_main_thread():
            old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.reporter.start_at(self.step)
        reason, path = None, None
        try:
            with self.around_steps():
                while (reason := self._stop_reason()) is None:
                    t0 = time.perf_counter()
                    loss, norm = self._train_step()
                    self.step += 1
                    dt = time.perf_counter() - t0
                    self.elapsed += dt
                    self.after_step(loss, norm, dt)
                    improved = False
                    last = self.step >= self.max_steps  # (validated before its checkpoint: the best is known)
                    if (self.eval_interval and self.step % self.eval_interval == 0) or last:
                        improved = self._evaluate_and_track()
                    if (self.checkpoint_interval and self.step % self.checkpoint_interval == 0) or (
                        improved and self.keep_best
                    ):
                        self.save()
                if self.step > 0 and self.last_eval_step != self.step and reason != "signal":
                    self._evaluate_and_track()
                path = self.save() if self.last_saved != self.step else self.latest()
                self.say(f"stopped at step {self.step:,} ({reason}); checkpoint {path}")
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self.reporter.close()
        return reason, path
