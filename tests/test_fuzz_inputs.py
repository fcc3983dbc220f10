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


@pytest.mark.slow  # (~80 s: 150 command lines; CI runs it)
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


@SETTINGS
@given(st.text())
def test_text8_tokenizer_round_trips_up_to_the_text8_normalisation(text):
    """Any text reads as its text8 normalisation (ASCII letters lower-cased, digits spelled out, everything else one
    space), and the stream decoder's pieces add up to decode."""
    from txl.data.rawtext import Text8

    tok = Tokenizer("char", list(" abcdefghijklmnopqrstuvwxyz"), raw_text=Text8())
    ids = tok.encode(text)
    expected = Text8().normalize(text)
    assert tok.decode(ids) == expected and "  " not in expected
    assert set(expected) <= set(" abcdefghijklmnopqrstuvwxyz")
    decoder = tok.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == expected


MOSES_WORDS = ["<unk>", "<eos>", "the", "cat", "'s", "1", "000", "@,@", "@.@", "@-@", ",", ".", "(", ")", '"', "a-b"]


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(["the", "cat", "cat's", "1,000", "1.5", "x-y", "(", ")", ",", ".", '"', "zz", " ", "\n",
                                 "\t", "Cat", "<unk>"]), max_size=14).map("".join))  # fmt: skip
def test_moses_tokenizer_round_trips_up_to_its_documented_normalisation(text):
    """Raw text through Moses (HF's TransfoXL pipeline): each line's decoded text is the Moses detokenisation of its
    symbols, unknown words as <unk> (the documented normalisation), lines joined by newlines; the stream decoder's
    pieces add up to decode. (Not a projection: Moses itself re-reads some of its output differently, as in HF.)"""
    from txl.data.rawtext import Moses

    moses = Moses(never_split=("<unk>", "<eos>"), specials=("<unk>", "<eos>"))
    tok = Tokenizer("word", MOSES_WORDS, unk_token="<unk>", line_end="eos", raw_text=moses)
    ids = tok.encode(text)
    known = set(MOSES_WORDS)
    lines = [
        moses.detokenize([w if w in known else "<unk>" for w in moses.tokenize(line)]) for line in text.split("\n")
    ]
    decoded = tok.decode(ids)
    assert decoded == "\n".join(lines)
    decoder = tok.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == decoded


CONFIG_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.lists(st.integers(-2, 80), max_size=4), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip


@pytest.fixture(scope="module")
def nvidia_dict():
    from safetensors.torch import load_file

    from tests.conftest import CHAR_FIXTURE

    hf = load_file(str(CHAR_FIXTURE / "model.safetensors"))
    aliases = ("attn.r_w_bias", "attn.r_r_bias")
    state = {f"module.{k.removeprefix('transformer.')}": v for k, v in hf.items() if not k.endswith(aliases)}
    config = {"n_token": 64, "d_embed": 32, "div_val": 1, "cutoffs": [], "tie_projs": [False], "mem_len": 20}
    return state, config | {"same_length": True, "clamp_len": 8, "dropout": 0.1, "dropatt": 0.0, "attn_type": 0}


@settings(max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_nvidia_checkpoints_of_any_layout_convert_or_are_one_checkpoint_error(tmp_path_factory, nvidia_dict, data):
    """A checkpoint dict as NVIDIA's port saves it, with its model_config's values (or the config itself) and its
    state's tensors replaced at random: converted, or refused with one CheckpointError naming the file."""
    import torch

    from txl import CheckpointError
    from txl.interop.convert_original import convert_original_checkpoint

    state, config = dict(nvidia_dict[0]), dict(nvidia_dict[1])
    for key in data.draw(st.lists(st.sampled_from([*config, "d_model", "n_layer"]), max_size=3)):
        config[key] = data.draw(CONFIG_VALUES)
    for key in data.draw(st.lists(st.sampled_from(sorted(state)), max_size=2)):
        state[key] = data.draw(st.sampled_from([torch.zeros(3), torch.zeros(0), 5, "x", torch.zeros(2, 2, 2)]))
    whole = data.draw(st.sampled_from(["dict", "list", "str", "none", "state-list"]))
    saved = {"model_state": state, "model_config": config}
    if whole != "dict":
        saved = {"list": {"model_state": state, "model_config": list(config.items())},
                 "str": {"model_state": state, "model_config": "n_token=64"},
                 "none": {"model_state": state, "model_config": None},
                 "state-list": {"model_state": list(state.values()), "model_config": config}}[whole]  # fmt: skip
    path = tmp_path_factory.mktemp("nvidia") / "checkpoint_last.pt"
    torch.save(saved, path)
    try:
        convert_original_checkpoint(path, trust_pickle=True)
    except CheckpointError as e:
        assert str(path) in str(e) and "\n" not in str(e)


# --- Classes of inputs the outside probes found that the strategies above missed (probes.md mt1-4, fg, fl, f12,
# n19, r9): metrics lines of any JSON shape, fine-tuning rows of any shape, and bad items in list-valued options.

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["step", "split", "loss", "x"]), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=8,
)


@SETTINGS
@given(st.lists(st.one_of(JSON_VALUES.map(lambda v: __import__("json").dumps(v)), st.text(max_size=20)), max_size=8))
def test_metrics_files_of_any_lines_read_as_their_rows(tmp_path_factory, lines):
    """Every line of metrics.jsonl that is an object with an integer step is a row, in order; any other line is
    skipped; dropping rows after a step (a resume that rewinds) keeps the others and never fails."""
    import json

    from txl.util.metrics import read_metrics, truncate_metrics

    run = tmp_path_factory.mktemp("metrics")
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    rows = read_metrics(run)
    expected = []
    for line in lines:
        try:
            v = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(v, dict) and type(v.get("step")) is int:
            expected.append(v)
    assert rows == expected
    truncate_metrics(run, 100)
    assert read_metrics(run) == [r for r in expected if r["step"] <= 100]


ROW_FIELDS = st.dictionaries(st.sampled_from(["text", "label", "extra"]), JSON_VALUES, max_size=3)


@SETTINGS
@given(st.lists(ROW_FIELDS, min_size=1, max_size=5), st.sampled_from(["jsonl", "csv"]), st.booleans())
def test_finetune_rows_of_any_shape_read_or_name_their_line(tmp_path_factory, rows, fmt, twice):
    """A fine-tuning file of rows of any shape (any JSON value as text or label, fields missing or extra, a key twice,
    CSV rows of any width): its examples, or one FinetuneError naming the file and line."""
    import csv
    import io
    import json

    from txl.train.finetune import FinetuneError, read_split

    folder = tmp_path_factory.mktemp("rows")
    path = folder / f"train.{fmt}"
    if fmt == "jsonl":
        lines = [json.dumps(r) for r in rows]
        if twice:
            lines[0] = lines[0][:-1] + (', "label": 1}' if len(lines[0]) > 2 else '"label": 1}')
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["text", "label"])
        for r in rows:
            writer.writerow([str(v) for v in r.values()])
        path.write_text(out.getvalue(), encoding="utf-8")
    try:
        examples = read_split(path, "single", Tokenizer.bytes256(), max_tokens=64)
    except FinetuneError as e:
        assert str(e).startswith(f"{path}") and "\n" not in str(e), str(e)
        return
    assert examples and all(e.ids and e.where.startswith(f"{path}: line ") for e in examples)


LIST_ITEMS = st.one_of(st.integers(-3, 50), st.floats(allow_nan=False, width=16), st.text("ab", max_size=2),
                       st.booleans(), st.none())  # fmt: skip


@pytest.mark.slow  # (~80 s; CI runs it)
@SETTINGS
@given(st.lists(LIST_ITEMS, min_size=1, max_size=4))
def test_list_options_parse_or_name_the_bad_item(items):
    """A list-valued option (recl's --contexts) with items of any type: parsed, or one line naming the option and,
    for a bad item, that item (never the garbled 'Expected a <class 'NoneType'>')."""
    import json

    from txl.cli import build_parser, normalize_argv
    from txl.cli.app import _error

    top, _ = build_parser()
    argv = ["recl", "--models", "a", "b", "--contexts", json.dumps(items)]
    try:
        top.parse_args(normalize_argv(argv))
    except Exception as e:  # (ArgumentError; the CLI prints _error's line)
        found = _error(e)
        assert found is not None and found[0] == 2, repr(e)
        assert "--contexts" in found[1] and "NoneType" not in found[1] and "\n" not in found[1], found[1]
    except SystemExit:
        pass
