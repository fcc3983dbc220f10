"""Beam search's bookkeeping, as Hugging Face's ``generate(num_beams=...)`` keeps it, on plain Python numbers: which
continuations each prompt keeps, which hypotheses are finished, when a prompt is done. Shared by txl's
``beam_search`` (PyTorch) and txl.keras's (any Keras backend); the model calls and the token arrays are theirs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class BeamBook:
    """The finished hypotheses and the done flags of ``B`` prompts of ``K`` beams each (beam k of prompt b is row
    ``b * K + k``). ``fill``: the token of a done prompt's rows and of a beam that ran out."""

    def __init__(self, B: int, K: int, eos: Sequence[int], fill: int, length_penalty: float, early_stopping: bool):
        self.B, self.K, self.eos, self.fill = B, K, list(eos), fill
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.finished: list[list[tuple[float, Any]]] = [[] for _ in range(B)]
        self.done = [False] * B

    def keep(self, b: int, tokens: Any, total: float, new_len: int) -> None:
        """A finished hypothesis of prompt b (its sum of log-probabilities ``total``), among the best K of them."""
        score = total / new_len**self.length_penalty
        hyps = self.finished[b]
        if len(hyps) < self.K or score > min(s for s, _ in hyps):
            hyps.append((score, tokens))
            if len(hyps) > self.K:
                hyps.remove(min(hyps, key=lambda x: x[0]))

    def step(
        self, top: list[list[int]], top_scores: list[list[float]], V: int, new_len: int, row: Callable[[int], Any]
    ) -> tuple[list[int], list[int], list[float]]:
        """One step: ``top`` / ``top_scores`` [B][n] the best flat indices (beam * V + token) of each prompt and their
        totals, best first; ``row(r)`` a copy of row r's tokens (a hypothesis that ends with eos). Returns each new
        row's source row, token and total."""
        K, rows, tokens, next_scores = self.K, [], [], []
        for b in range(self.B):
            if self.done[b]:  # (its rows run on, unused)
                rows += [b * K] * K
                tokens += [self.fill] * K
                next_scores += [0.0] * K
                continue
            chosen = 0
            for rank, (flat, value) in enumerate(zip(top[b], top_scores[b], strict=True)):
                if value == float("-inf"):  # (banned, or the continuation of a beam that ran out)
                    break
                source, token = b * K + flat // V, flat % V
                if token in self.eos:
                    if rank < K:
                        self.keep(b, row(source), value, new_len)
                    continue
                rows.append(source)
                tokens.append(token)
                next_scores.append(value)
                chosen += 1
                if chosen == K:
                    break
            first = len(rows) - chosen  # (fewer allowed continuations than beams: the others run out)
            for _ in range(K - chosen):
                rows.append(rows[first] if chosen else b * K)
                tokens.append(tokens[first] if chosen else self.fill)
                next_scores.append(float("-inf"))
            if len(self.finished[b]) == K:
                worst = min(s for s, _ in self.finished[b])
                best = top_scores[b][0] / new_len**self.length_penalty
                self.done[b] = self.early_stopping or worst >= best
        return rows, tokens, next_scores

    def best(self, row: Callable[[int], Any], beam_scores: list[float], new_len: int, n: int) -> list[Any]:
        """The best ``n`` hypotheses of each prompt, the running beams of a prompt not done counted as finished."""
        for b in range(self.B):
            if not self.done[b]:
                for k in range(self.K):
                    self.keep(b, row(b * self.K + k), beam_scores[b * self.K + k], new_len)
        return [hyp for hyps in self.finished for _, hyp in sorted(hyps, key=lambda x: -x[0])[:n]]


def padded(hyps: list[list[int]], fill: int, eos: Sequence[int], limit: int) -> list[list[int]]:
    """The hypotheses as rows of one width (the longest + 1, at most ``limit``): a shorter one followed by an eos,
    then ``fill``."""
    width = min(max(len(h) for h in hyps) + 1, limit)
    out = []
    for h in hyps:
        row = h + ([eos[0]] if len(h) < width and eos else [])
        out.append(row + [fill] * (width - len(row)))
    return out
