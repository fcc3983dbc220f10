"""A pure-Python rewrite of the original data pipeline's rules (pytorch/utils/vocabulary.py, data_utils.py,
prep_enwik8.py, prep_text8.py), written from the description in ../shared/research/original_code.md §2. Tests
compare txl's fast pipeline against it; it is deliberately slow and literal."""

from __future__ import annotations

from collections import Counter, OrderedDict


class RefVocab:
    def __init__(self, special=(), min_freq=0, max_size=None, lower_case=True, vocab_file=None):
        self.counter = Counter()
        self.special, self.min_freq, self.max_size, self.lower_case = list(special), min_freq, max_size, lower_case
        self.vocab_file = vocab_file

    def tokenize(self, line, add_eos=False, add_double_eos=False):
        line = line.strip()
        if self.lower_case:
            line = line.lower()
        symbols = line.split()
        if add_double_eos:
            return ["<S>"] + symbols + ["<S>"]
        if add_eos:
            return symbols + ["<eos>"]
        return symbols

    def count_file(self, path, add_eos=True):
        with open(path, encoding="utf-8") as f:  # text mode: universal newlines, as the original
            for line in f:
                self.counter.update(self.tokenize(line, add_eos=add_eos))

    def add_symbol(self, sym):
        if sym not in self.sym2idx:
            self.idx2sym.append(sym)
            self.sym2idx[sym] = len(self.idx2sym) - 1

    def build_vocab(self):
        self.idx2sym, self.sym2idx = [], OrderedDict()
        if self.vocab_file:
            with open(self.vocab_file, encoding="utf-8") as f:
                for line in f:
                    self.add_symbol(line.strip().split()[0])
            self.unk_idx = self.sym2idx["<UNK>"]
            return
        for sym in self.special:
            self.add_symbol(sym)
        for sym, cnt in self.counter.most_common(self.max_size):
            if cnt < self.min_freq:
                break
            self.add_symbol(sym)

    def get_idx(self, sym):
        if sym in self.sym2idx:
            return self.sym2idx[sym]
        assert hasattr(self, "unk_idx"), f"OOV {sym!r} and no unk"
        return self.sym2idx.get(sym, self.unk_idx)

    def encode_file(self, path, ordered=True, add_eos=True, add_double_eos=False):
        out = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                out.append([self.get_idx(s) for s in self.tokenize(line, add_eos, add_double_eos)])
        return [i for sent in out for i in sent] if ordered else out


def prep_enwik8(data: bytes) -> str:
    """prep_enwik8.py's text form of a split: decimal bytes joined by spaces, newline bytes as real newlines."""
    return " ".join(str(c) if c != ord("\n") else "\n" for c in data)


def prep_text8(part: str) -> str:
    """prep_text8.py's text form of a split: stripped, spaces as '_', characters joined by spaces."""
    return " ".join("_" if c == " " else c for c in part.strip())


def ref_ordered_batches(data: list[int], bsz: int, bptt: int, ext_len: int = 0):
    """LMOrderedIterator: batchify into bsz columns, then fixed-length get_batch; batch-first lists."""
    n_step = len(data) // bsz
    cols = [data[b * n_step : (b + 1) * n_step] for b in range(bsz)]
    for i in range(0, n_step - 1, bptt):
        seq_len = min(bptt, n_step - 1 - i)
        beg = max(0, i - ext_len)
        yield [c[beg : i + seq_len] for c in cols], [c[i + 1 : i + 1 + seq_len] for c in cols]


def ref_stream_batches(sentences: list[list[int]], bsz: int, bptt: int):
    """LMShuffledIterator.stream_iterator (shuffle=False) over one list of sentences; batch-first lists."""
    sent_stream = iter(sentences)
    streams = [None] * bsz
    while True:
        data = [[-1] * bptt for _ in range(bsz)]
        target = [[-1] * bptt for _ in range(bsz)]
        for i in range(bsz):
            n_filled = 0
            try:
                while n_filled < bptt:
                    if streams[i] is None or len(streams[i]) <= 1:
                        streams[i] = next(sent_stream)
                    n_new = min(len(streams[i]) - 1, bptt - n_filled)
                    data[i][n_filled : n_filled + n_new] = streams[i][:n_new]
                    target[i][n_filled : n_filled + n_new] = streams[i][1 : n_new + 1]
                    streams[i] = streams[i][n_new:]
                    n_filled += n_new
            except StopIteration:
                return
        yield data, target
