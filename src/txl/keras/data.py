"""A token stream as ``fit()`` reads it for Transformer-XL: the stream cut into ``batch_size`` contiguous rows, read
``tgt_len`` positions at a time, so that row b of batch i+1 continues row b of batch i (txl's and the paper's
ordered iterator) and the memory a model carries (``carry_memory``) is the past of each row."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np


class TokenStream(keras.utils.PyDataset):
    """Batches ``(x [batch_size, tgt_len], y [batch_size, tgt_len])`` of a 1-D token stream, y the next tokens of x
    (``fit`` does not shuffle a ``PyDataset``: the order is the stream's). Every batch has ``tgt_len`` positions (one
    shape: one compiled step); the stream's last positions that do not fill one are left out (the original code reads
    them as a shorter last segment)."""

    def __init__(self, tokens: Any, batch_size: int, tgt_len: int, **kwargs: Any):
        super().__init__(**kwargs)
        data = np.asarray(tokens)
        if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
            raise ValueError(f"TokenStream: tokens must be a 1-D array of token ids, got {data.ndim}-D {data.dtype}")
        if batch_size < 1 or tgt_len < 1:
            raise ValueError("TokenStream: batch_size and tgt_len must be >= 1")
        per_row = len(data) // batch_size
        if per_row < tgt_len + 1:
            raise ValueError(
                f"TokenStream: {len(data):,} tokens cannot fill one batch of {batch_size} rows x {tgt_len} positions "
                "(and their next tokens)"
            )
        self.rows = data[: per_row * batch_size].reshape(batch_size, per_row).astype("int32")  # [B, N]
        self.tgt_len = tgt_len

    def __len__(self) -> int:
        return (self.rows.shape[1] - 1) // self.tgt_len

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"TokenStream: batch {i} of {len(self)}")
        start = i * self.tgt_len
        return self.rows[:, start : start + self.tgt_len], self.rows[:, start + 1 : start + self.tgt_len + 1]
