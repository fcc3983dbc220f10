"""Property-based tests (Hypothesis) of what users hand txl: tokenizer round trips, the YAML reader and recipes on
arbitrary text and structures, and the command line's parsing of random argument lists. Each either works as
documented or fails with the project's one error type (a ``ValueError`` subclass, or an argument error) and never
with anything else. Seeded (derandomized) and bounded in examples."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl.data import Tokenizer

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))  # fmt: skip
ALPHABET = "abcdefgh ABC.,;:!?\n'-"


@SETTINGS
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tok = Tokenizer.bytes256()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    decoder = tok.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == text  # (the stream's pieces add up)


@SETTINGS
@given(st.text(alphabet=ALPHABET))
def test_char_tokenizer_round_trips_text_of_its_alphabet(text):
    tok = Tokenizer("char", sorted(set(ALPHABET)))
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) == len(text)
    decoder = tok.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == text


@SETTINGS
@given(st.text(alphabet="abcxyz \n\t"))
def test_word_tokenizer_round_trips_up_to_its_documented_normalisation(text):
    """Words split on white space, each line ended by the line-end symbol: decoding gives the words of each line
    joined by one space, lines joined by a newline (the documented normalisation of the text)."""
    words = ["<unk>", "<eos>", "a", "b", "c", "abc"]
    tok = Tokenizer("word", words, unk_token="<unk>", line_end="eos")
    ids = tok.encode(text)
    known = {"a", "b", "c", "abc"}
    lines = [" ".join(w if w in known else "<unk>" for w in line.split()) for line in text.split("\n")]
    assert tok.decode(ids) == "\n".join(lines)
    decoder = tok.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == tok.decode(ids)


@SETTINGS
@given(st.text(max_size=300))
def test_the_yaml_reader_loads_or_says_why(text):
    from txl.config import checked_yaml_load

    try:
        checked_yaml_load(text)
    except yaml.YAMLError:
        pass


scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False) | st.text(max_size=8)
structures = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["model", "data", "train", "eval", "run_dir", "d_model", "n_layer", "lr", "path", "x"]), inner,
    max_size=4), max_leaves=12)  # fmt: skip


@SETTINGS
@given(structures)
def test_recipes_of_any_structure_load_or_are_one_config_error(tmp_path_factory, value):
    from txl.config import load_recipe

    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text(yaml.safe_dump(value))
    try:
        load_recipe(path)
    except ValueError:  # (ConfigError and the validation errors of the sections)
        pass


words = st.sampled_from([
    "train", "eval", "generate", "serve", "convert", "hf", "data", "get", "tokenize", "--config", "--model", "--data",
    "--data.path", "--train.lr", "--model.d_model", "--mem_len", "--port", "--help=x", "-1", "0", "1e9", "abc", "",
    "[1, 2]", "{a: 1}", "true", "none", "--", "-",
])  # fmt: skip


@SETTINGS
@given(st.lists(words, max_size=6))
def test_the_command_line_parses_or_refuses_random_argument_lists(argv):
    """The parser alone (nothing runs): a namespace, or an argument error that the CLI prints as one line."""
    from argparse import ArgumentError

    from txl.cli import build_parser, normalize_argv

    top, _ = build_parser()
    try:
        top.parse_args(normalize_argv(argv))
    except (ArgumentError, SystemExit):
        pass


@pytest.mark.parametrize("cut", [0, 1, 7, 100, -1])
def test_a_truncated_or_flipped_model_folder_is_refused_cleanly(cut, tmp_path):
    """A model folder whose weights are cut short or have a flipped byte: a CheckpointError (ValueError) naming the
    file, or, for a flipped byte inside a tensor's data, a model that loads (its numbers are just numbers)."""
    from tests.conftest import debug_config
    from txl import TransformerXLLM

    folder = tmp_path / "m"
    TransformerXLLM(debug_config()).save_pretrained(folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if cut >= 0:
        weights.write_bytes(bytes(data[:cut]))
    else:
        for i in range(0, 200, 13):  # (the header: its JSON damaged)
            data[i] ^= 0xFF
        weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors"):
        TransformerXLLM.from_pretrained(folder)


@SETTINGS
@given(st.binary(max_size=400), st.sampled_from(["char", "byte", "word"]))
def test_the_text_readers_read_any_bytes_or_name_the_line(tmp_path_factory, data, kind):
    """A file of arbitrary bytes: a vocabulary is built and the file read back to ids that decode to its text, or
    one DataError naming the file (invalid UTF-8, nothing to read), never anything else."""
    import numpy as np

    from txl.data import FileRange

    path = tmp_path_factory.mktemp("bytes") / "text.txt"
    path.write_bytes(data)
    try:
        tok = Tokenizer.build(kind, [FileRange(path)])
        ids = np.concatenate([np.zeros(0, dtype=np.int64), *tok.encode_file(FileRange(path))])
    except ValueError as e:
        assert str(path) in str(e) or "vocabulary" in str(e), e
        return
    assert ids.size == 0 or 0 <= int(ids.min()) and int(ids.max()) < tok.vocab_size
    if kind == "byte":
        assert (
            bytes(ids.astype(np.uint8))
            == data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").removeprefix(b"\xef\xbb\xbf")
            or bytes(ids.astype(np.uint8)) == data
        )


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_model_folders_damaged_at_random_load_or_are_refused(tmp_path_factory, data):
    """model.safetensors cut at a random length or with random bytes flipped: it loads (a flip inside a tensor's
    numbers is just other numbers) or is a ValueError naming the file; nothing else."""
    from tests.conftest import debug_config
    from txl import TransformerXLLM

    folder = tmp_path_factory.mktemp("damaged") / "m"
    TransformerXLLM(debug_config()).save_pretrained(folder)
    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=8)):
            raw[i] ^= data.draw(st.integers(1, 255))
    weights.write_bytes(bytes(raw))
    try:
        TransformerXLLM.from_pretrained(folder)
    except ValueError as e:
        assert "model.safetensors" in str(e), e
