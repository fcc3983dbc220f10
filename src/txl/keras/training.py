"""Training as txl's trainer trains: Adam with PyTorch's update (its epsilon added to the bias-corrected root of the
second moment; Keras's Adam adds it before the correction, which moves the first steps by up to 3e-4 of their size),
the global gradient norm clipped, and txl's learning-rate schedule (a linear warm-up, then a cosine over the whole
run, the warm-up included, down to ``eta_min``)."""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="txl")
class TxlSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """txl's ``cosine`` and ``constant`` schedules (``txl.train.optim``): ``lr * step / warmup_steps`` during the
    warm-up, then ``eta_min + (lr - eta_min) * (1 + cos(pi * step / decay_steps)) / 2`` (cosine) or ``lr``."""

    def __init__(self, lr: float, decay_steps: int, warmup_steps: int = 0, eta_min: float = 0.0,
                 scheduler: str = "cosine"):  # fmt: skip
        if scheduler not in ("cosine", "constant"):
            raise ValueError(f"scheduler = {scheduler!r}: 'cosine' or 'constant'")
        if decay_steps < 1 or warmup_steps < 0:
            raise ValueError("decay_steps must be >= 1 and warmup_steps >= 0")
        self.lr, self.decay_steps, self.warmup_steps = float(lr), int(decay_steps), int(warmup_steps)
        self.eta_min, self.scheduler = float(eta_min), scheduler

    def __call__(self, step: Any) -> Any:
        step = ops.cast(step, "float32")
        if self.scheduler == "cosine":
            progress = ops.minimum(step, float(self.decay_steps)) / self.decay_steps
            after = self.eta_min + (self.lr - self.eta_min) * (1.0 + ops.cos(math.pi * progress)) / 2.0
        else:
            after = ops.cast(self.lr, "float32")
        if not self.warmup_steps:
            return after
        return ops.where(step < self.warmup_steps, self.lr * step / self.warmup_steps, after)

    def get_config(self) -> dict[str, Any]:
        return {"lr": self.lr, "decay_steps": self.decay_steps, "warmup_steps": self.warmup_steps,
                "eta_min": self.eta_min, "scheduler": self.scheduler}  # fmt: skip


@keras.saving.register_keras_serializable(package="txl")
class TxlAdam(keras.optimizers.Adam):
    """Adam with PyTorch's update: ``w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``."""

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        dtype = variable.dtype
        lr, gradient = ops.cast(learning_rate, dtype), ops.cast(gradient, dtype)
        t = ops.cast(self.iterations + 1, dtype)
        bc1 = 1 - ops.power(ops.cast(self.beta_1, dtype), t)
        bc2 = 1 - ops.power(ops.cast(self.beta_2, dtype), t)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - self.beta_2))
        self.assign_sub(variable, (lr / bc1) * m / (ops.sqrt(v) / ops.sqrt(bc2) + self.epsilon))


def txl_adam(lr: float | TxlSchedule, clip: float = 0.25, betas: tuple[float, float] = (0.9, 0.999),
             eps: float = 1e-8) -> TxlAdam:  # fmt: skip
    """txl's default optimizer (``train.optimizer: adam``, ``train.clip``): Adam with PyTorch's update, the global
    gradient norm clipped at ``clip`` (0: not clipped)."""
    return TxlAdam(learning_rate=lr, beta_1=betas[0], beta_2=betas[1], epsilon=eps, global_clipnorm=clip or None)
