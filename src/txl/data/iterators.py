"""Batches for segment-level recurrence: consecutive segments of the same text in the same batch row.
Design notes: docs/internals.md#txldataiterators."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from txl.data.corpus import SentenceShard
from txl.data.errors import DataError


@dataclass
class Batch:
    """``input`` [B, ext + T] and ``target`` [B, T] token ids (``target[:, t]`` follows ``input[:, ext + t]``)."""

    input: torch.Tensor
    target: torch.Tensor
    seq_len: int
    epoch: int
    index: int


def _rows(batch_size: int, rank: int, world_size: int) -> range:
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in 0..{world_size - 1}")
    if batch_size % world_size:
        raise DataError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
    per = batch_size // world_size
    return range(rank * per, (rank + 1) * per)


class _Stateful:
    _state_keys: tuple[str, ...] = ()
    _check_keys: tuple[str, ...] = ()
    index: int

    def forever(self) -> Iterator[Batch]:
        """Batches across epochs without end (training loops count steps, not epochs)."""
        while True:
            fresh = self.index == 0
            n = 0
            for batch in self:
                n += 1
                yield batch
            if fresh and n == 0:
                raise DataError("the data is too short for a single batch")

    def state_dict(self) -> dict:
        """The exact position (the next batch to yield) plus what must match on restore."""
        return {"kind": type(self).__name__, **{k: getattr(self, k) for k in self._check_keys + self._state_keys}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != type(self).__name__:
            raise DataError(f"iterator state is for {state.get('kind')}, not {type(self).__name__}")
        for k in self._check_keys:
            if state[k] != getattr(self, k):
                raise DataError(f"iterator state has {k}={state[k]}, but this iterator has {k}={getattr(self, k)}")
        for k in self._state_keys:
            setattr(self, k, _plain(state[k]))


def _plain(value):
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return int(value) if isinstance(value, int | np.integer) else value


class OrderedIterator(_Stateful):
    """Contiguous columns of an id stream, ``tgt_len`` at a time (``ext_len`` extra context tokens in front)."""

    _check_keys = ("n_tokens", "batch_size", "tgt_len", "ext_len", "varlen", "seed")
    _state_keys = ("epoch", "pos", "index")

    def __init__(
        self, data: np.ndarray, batch_size: int, tgt_len: int, *, ext_len: int = 0, varlen: bool = False, seed: int = 0,
        rank: int = 0, world_size: int = 1, device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        if batch_size < 1 or tgt_len < 1 or ext_len < 0:
            raise DataError(f"need batch_size, tgt_len >= 1 and ext_len >= 0 (got {batch_size}, {tgt_len}, {ext_len})")
        self.data, self.n_tokens = data, len(data)
        self.batch_size, self.tgt_len, self.ext_len, self.varlen, self.seed = batch_size, tgt_len, ext_len, varlen, seed
        self.n_step = self.n_tokens // batch_size  # tokens per column
        if self.n_step < 2:
            raise DataError(
                f"{self.n_tokens:,} tokens cannot fill {batch_size} columns of at least 2 tokens "
                f"(one input and one target); use a smaller batch size or more text"
            )
        rows = _rows(batch_size, rank, world_size)
        self.col_starts = np.arange(rows.start, rows.stop, dtype=np.int64) * self.n_step
        self.device = device
        self.epoch, self.pos, self.index = 0, 0, 0

    def __len__(self) -> int:
        """Batches per epoch (fixed-length mode)."""
        return -(-(self.n_step - 1) // self.tgt_len)

    @property
    def max_seq_len(self) -> int:
        """The longest segment a batch has: tgt_len (varlen: up to tgt_len + 15), at most a column's targets."""
        return min(self.tgt_len + (15 if self.varlen else 0), self.n_step - 1)

    @property
    def column_len(self) -> int | None:
        """Positions one column gives in an epoch (a memory carried through one epoch holds at most these)."""
        return self.n_step - 1

    def _length(self) -> int:
        if not self.varlen:
            return self.tgt_len
        # (seed % 2**64: the 64 bits torch reads of a negative seed; numpy takes no negative seed)
        rng = np.random.default_rng([self.seed % 2**64, self.epoch, self.index])
        mean = self.tgt_len if rng.random() < 0.95 else self.tgt_len / 2
        return int(min(self.tgt_len + 15, max(5, int(rng.normal(mean, 5)))))

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the current position to the end of the epoch; the next ``iter`` starts the next epoch."""
        while self.pos < self.n_step - 1:
            seq_len = min(self._length(), self.n_step - 1 - self.pos)
            begin = max(0, self.pos - self.ext_len)
            offs = np.arange(begin, self.pos + seq_len + 1, dtype=np.int64)
            window = torch.from_numpy(self.data[self.col_starts[:, None] + offs].astype(np.int64))
            batch = Batch(window[:, :-1], window[:, self.pos - begin + 1 :], seq_len, self.epoch, self.index)
            self.pos += seq_len
            self.index += 1
            yield batch if self.device is None else _to(batch, self.device)
        self.epoch, self.pos, self.index = self.epoch + 1, 0, 0


def _to(batch: Batch, device) -> Batch:
    return Batch(batch.input.to(device), batch.target.to(device), batch.seq_len, batch.epoch, batch.index)


class SentenceStreamIterator(_Stateful):
    """``batch_size`` streams of whole sentences, shard by shard (One Billion Word; ``LMShuffledIterator``)."""

    _check_keys = ("n_sentences", "batch_size", "tgt_len", "shuffle", "seed")
    _state_keys = ("epoch", "shard_pos", "next_sentence", "streams", "index")

    def __init__(
        self, shards: list[SentenceShard], batch_size: int, tgt_len: int, *, shuffle: bool = True, seed: int = 0,
        rank: int = 0, world_size: int = 1, device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        if not shards or not any(len(s) for s in shards):
            raise DataError("no sentences to iterate over")
        self.shards, self.batch_size, self.tgt_len, self.shuffle, self.seed = shards, batch_size, tgt_len, shuffle, seed
        self.n_sentences = [len(s) for s in shards]
        self.rows = _rows(batch_size, rank, world_size)
        self.device = device
        self.epoch, self.shard_pos, self.next_sentence, self.index = 0, 0, 0, 0
        self.streams: list[list[int]] = [[-1, 0] for _ in range(batch_size)]  # [sentence order index, offset]

    @property
    def max_seq_len(self) -> int:
        """The longest segment a batch has: tgt_len (streams are filled to it)."""
        return self.tgt_len

    @property
    def column_len(self) -> int | None:
        """None: a stream is as long as its sentences (no bound known before they are read)."""
        return None

    def _shard_order(self) -> np.ndarray:
        n = len(self.shards)
        return np.random.default_rng([self.seed % 2**64, self.epoch]).permutation(n) if self.shuffle else np.arange(n)

    def _sentence_order(self, shard: int) -> np.ndarray:
        n = len(self.shards[shard])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed % 2**64, self.epoch, 1 + shard]).permutation(n)

    def _fill(self, shard: SentenceShard, order: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """One global batch, or None when the shard runs out of sentences (the partial batch is dropped)."""
        data = np.full((self.batch_size, self.tgt_len), -1, dtype=np.int64)
        target = np.full((self.batch_size, self.tgt_len), -1, dtype=np.int64)
        streams, nxt = [list(s) for s in self.streams], self.next_sentence
        for row in range(self.batch_size):
            filled = 0
            while filled < self.tgt_len:
                sent, off = streams[row]
                if sent < 0 or len(shard.sentence(order[sent])) - off <= 1:
                    if nxt >= len(order):
                        return None
                    streams[row], nxt = [nxt, 0], nxt + 1
                    continue
                s = shard.sentence(order[sent])
                n = min(len(s) - off - 1, self.tgt_len - filled)
                data[row, filled : filled + n] = s[off : off + n]
                target[row, filled : filled + n] = s[off + 1 : off + 1 + n]
                streams[row][1] += n
                filled += n
        self.streams, self.next_sentence = streams, nxt
        return data, target

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the current position to the end of the epoch (all shards)."""
        shard_order = self._shard_order()
        while self.shard_pos < len(shard_order):
            shard_id = int(shard_order[self.shard_pos])
            order = self._sentence_order(shard_id)
            while (got := self._fill(self.shards[shard_id], order)) is not None:
                rows = slice(self.rows.start, self.rows.stop)
                batch = Batch(
                    torch.from_numpy(got[0][rows]), torch.from_numpy(got[1][rows]), self.tgt_len, self.epoch, self.index
                )
                self.index += 1
                yield batch if self.device is None else _to(batch, self.device)
            self.shard_pos, self.next_sentence = self.shard_pos + 1, 0
            self.streams = [[-1, 0] for _ in range(self.batch_size)]
        self.epoch, self.shard_pos, self.index = self.epoch + 1, 0, 0
