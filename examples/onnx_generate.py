"""Generate text with a txl model exported to ONNX, with onnxruntime and numpy only (no PyTorch).

    txl export onnx --model runs/shakespeare_char --out model.onnx --last_only
    python examples/onnx_generate.py --onnx model.onnx --prompt "ROMEO." --max_new_tokens 200

The step graph (see ``txl.export``) takes the token ids of a segment, the memories of every layer and a padding mask,
and gives log-probabilities and the new memories; this script feeds it the prompt once and then one token at a time,
carrying the memory, as ``txl generate`` does (greedy with ``--temperature 0``: the same tokens). The tokenizer is
the ``tokenizer.json`` that ``txl export`` wrote beside the graph (character- and word-level models).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort


class Tokenizer:
    """The character- and word-level tokenizers of txl, read from their tokenizer.json (no txl import)."""

    def __init__(self, path: Path):
        obj = json.loads(path.read_text(encoding="utf-8"))
        self.vocab = obj["model"]["vocab"]
        self.symbols = {i: s for s, i in self.vocab.items()}
        self.kind = {"Split": "char", "WhitespaceSplit": "word"}.get((obj.get("pre_tokenizer") or {}).get("type"))
        if self.kind is None:
            sys.exit(f"{path}: only character- and word-level tokenizers are read here; use `txl generate`")
        norms = (obj.get("normalizer") or {}).get("normalizers", [obj.get("normalizer")])
        self.lower = any((n or {}).get("type") == "Lowercase" for n in norms)
        self.eos = "<eos>" if "<eos>" in self.vocab else None
        self.unk = obj["model"].get("unk_token")

    def encode(self, text: str) -> list[int]:
        text = text.lower() if self.lower else text
        if self.kind == "char":
            units = list(text)
        else:
            lines = text.split("\n")
            units = []
            for i, line in enumerate(lines):
                units += line.split() + ([self.eos] if self.eos and i < len(lines) - 1 else [])
        missing = [u for u in units if u not in self.vocab and self.unk not in self.vocab]
        if missing:
            sys.exit(f"the prompt has {missing[0]!r}, which is not in the model's vocabulary")
        return [self.vocab.get(u, self.vocab.get(self.unk)) for u in units]

    def decode(self, ids: list[int], after_line_start: bool = True) -> str:
        if self.kind == "char":
            return "".join(self.symbols[i] for i in ids)
        out, start = [], after_line_start
        for i in ids:
            sym = self.symbols[i]
            out.append("\n" if sym == self.eos else (sym if start else " " + sym))
            start = sym == self.eos
        return "".join(out)


def choose(log_probs: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(log_probs))
    logits = log_probs / temperature
    if top_k:
        logits = np.where(logits >= np.sort(logits)[-top_k], logits, -np.inf)
    p = np.exp(logits - logits.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def generate(session: ort.InferenceSession, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0) -> list[int]:  # fmt: skip
    """New token ids continuing ``prompt``: the prompt in one segment, then one token per step with the memory."""
    meta = {k: json.loads(v) for k, v in session.get_modelmeta().custom_metadata_map.items()}
    n_layer, d_model = meta["txl.n_layer"], meta["txl.d_model"]
    rng = np.random.default_rng(seed)
    mems = np.zeros((n_layer, 1, 0, d_model), dtype=np.float32)  # an empty memory
    ids = np.asarray([prompt], dtype=np.int64)
    new = []
    for _ in range(max_new_tokens):
        padding = np.zeros((1, mems.shape[2] + ids.shape[1]), dtype=bool)
        log_probs, mems = session.run(None, {"input_ids": ids, "mems": mems, "padding": padding})
        last = log_probs[0] if meta["txl.last_only"] else log_probs[0, -1]  # [V]
        new.append(choose(last, temperature, top_k, rng))
        ids = np.asarray([[new[-1]]], dtype=np.int64)
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--onnx", type=Path, required=True, help="the graph written by `txl export onnx`")
    ap.add_argument("--tokenizer", type=Path, help="default: the .tokenizer.json beside the graph")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max_new_tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the new ids and text as JSON")
    args = ap.parse_args()
    tok = Tokenizer(args.tokenizer or args.onnx.with_suffix(".tokenizer.json"))
    prompt = tok.encode(args.prompt)
    if not prompt:
        sys.exit("the prompt encodes to no tokens")
    session = ort.InferenceSession(str(args.onnx), providers=["CPUExecutionProvider"])
    new = generate(session, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    text = tok.decode(new, after_line_start=tok.kind == "word" and args.prompt.endswith("\n"))
    print(json.dumps({"prompt": args.prompt, "ids": new, "text": text}) if args.json else args.prompt + text)


if __name__ == "__main__":
    main()
