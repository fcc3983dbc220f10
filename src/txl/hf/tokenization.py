"""``TransfoXLTokenizer``: Hugging Face's TransfoXL tokenizer as a transformers-5 (Python) tokenizer over txl's
:class:`~txl.data.Tokenizer`: Hugging Face 4.x's ids for its word-level vocabularies (Moses pre-tokenisation,
``<unk>``, ``<eos>``), and txl's character and byte vocabularies too. It writes ``vocab.json`` (txl's tokenizer
file: JSON, no pickle) and reads that, Hugging Face 4.x's ``vocab.txt``, or its ``vocab.pkl`` with
``trust_pickle=True`` (a restricted unpickler that runs nothing)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizer

from txl.data.errors import DataError
from txl.data.rawtext import Moses
from txl.data.tokenizer import BYTE_OF_CHAR, Tokenizer
from txl.interop.hf_vocab import convert_hf_tokenizer
from txl.model.pretrained import CheckpointError

VOCAB_FILES = {"vocab_file": "vocab.json", "vocab_txt": "vocab.txt", "vocab_pkl": "vocab.pkl"}


def library_words(message: str) -> str:
    """A message of txl's converters in a library caller's words (probes hf17: a CLI flag named to Python code)."""
    return message.replace("--trust-pickle", "trust_pickle=True")


class VocabularyError(OSError):
    """A vocabulary that cannot be read (missing, not a vocabulary, a pickle not trusted): which file, what to do."""


class TransfoXLTokenizer(PreTrainedTokenizer):
    """Hugging Face's ``TransfoXLTokenizer``. ``tokenizer``: a txl tokenizer to wrap (else the vocabulary files);
    special tokens that the vocabulary does not hold are not added (they would get ids beyond the model's)."""

    vocab_files_names = VOCAB_FILES
    model_input_names = ["input_ids"]

    def __init__(
        self,
        vocab_file: str | None = None,
        vocab_txt: str | None = None,
        vocab_pkl: str | None = None,
        tokenizer: Tokenizer | None = None,
        trust_pickle: bool = False,
        unk_token: str | None = "<unk>",
        eos_token: str | None = "<eos>",
        additional_special_tokens: list[str] | None = None,
        **kwargs: Any,
    ):
        self.txl = tokenizer if tokenizer is not None else _read(vocab_file, vocab_txt, vocab_pkl, trust_pickle)
        present = self.txl._index
        specials = {
            "unk_token": self.txl.unk_token or (unk_token if unk_token in present else None),
            "eos_token": eos_token if eos_token in present else None,
        }
        extra = [t for t in (additional_special_tokens or ["<formula>"]) if t in present]
        kwargs.pop("extra_special_tokens", None)
        super().__init__(**specials, additional_special_tokens=extra, **kwargs)
        self.init_kwargs.pop("trust_pickle", None)  # (a permission for this load, not a setting to save)

    @classmethod
    def _from_pretrained(cls, *args: Any, **kwargs: Any):
        """transformers' loading, with the tokenizer's own message where transformers would replace it by its generic
        "Unable to load vocabulary from file" (probes D9d, tk0-tk9: which file, and what to give)."""
        try:
            return super()._from_pretrained(*args, **kwargs)
        except OSError as e:
            if isinstance(e.__context__, VocabularyError):
                raise VocabularyError(str(e.__context__)) from None
            raise

    @property
    def vocab_size(self) -> int:
        return self.txl.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self.txl._index)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        """Hugging Face 4.x's rule for a word vocabulary (the text stripped, Moses-tokenised as one line, lower-cased
        if the vocabulary is); a character or byte vocabulary's symbols as txl's tokenizer reads them."""
        tok = self.txl
        if tok.kind == "word":
            text = text.strip()
            if isinstance(tok.raw_text, Moses):
                return tok.raw_text.tokenize(text, tok.lower_case)
            return (text.lower() if tok.lower_case else text).split()
        return [tok.symbols[i] for i in tok.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        i = self.txl.token_to_id(token)
        if i is None:
            if self.txl.unk_id is None:
                raise ValueError(f"{token!r} is not in the vocabulary, which has no unknown token")
            return self.txl.unk_id
        return i

    def _convert_id_to_token(self, index: int) -> str:
        return self.txl.symbol(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        tok = self.txl
        if tok.kind == "byte":
            return bytes(BYTE_OF_CHAR[s] for s in tokens).decode("utf-8", errors="replace")
        if tok.kind == "char":
            return "".join(tokens)
        join = tok.raw_text.detokenize if isinstance(tok.raw_text, Moses) else " ".join
        return join(tokens).strip()

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        """txl's tokenizer file (JSON: the symbols and the rule that reads text) as ``vocab.json``."""
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES["vocab_file"]
        path = Path(save_directory) / name
        self.txl.save(path)
        return (str(path),)


def _read(vocab_file: str | None, vocab_txt: str | None, vocab_pkl: str | None, trust_pickle: bool) -> Tokenizer:
    """The txl tokenizer of a folder's vocabulary files (ours, or Hugging Face 4.x's)."""
    try:
        if vocab_file is not None:
            return Tokenizer.load(Path(vocab_file))
        if vocab_txt is not None or vocab_pkl is not None:
            txt, pkl = (None if f is None else Path(os.fspath(f)) for f in (vocab_txt, vocab_pkl))
            tok = convert_hf_tokenizer((txt or pkl).parent, trust_pickle, (txt, pkl))
            if tok is not None:
                return tok
    except (CheckpointError, DataError) as e:
        raise VocabularyError(library_words(str(e))) from None
    raise VocabularyError(
        "TransfoXLTokenizer needs a vocabulary: vocab.json (txl's), vocab.txt or vocab.pkl (Hugging Face 4.x's, "
        "with trust_pickle=True), or tokenizer=<a txl Tokenizer>"
    )
