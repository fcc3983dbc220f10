"""The ``txl`` command line: ``txl <command> [<subcommand>] ...`` (``txl --help`` lists them).
Design notes: docs/internals.md#txlcliapp."""

from __future__ import annotations

import dataclasses
import difflib
import errno
import inspect
import json as _json
import math
import os
import re
import sys
import typing
from argparse import ArgumentError
from pathlib import Path

from txl.cli.analysis import attention, plot, recl
from txl.cli.convert import convert_hf, convert_original, convert_tf
from txl.cli.data import data_get, data_prepare
from txl.cli.evaluate import eval
from txl.cli.export import export_onnx
from txl.cli.finetune import finetune, predict
from txl.cli.generate import generate
from txl.cli.serve import serve
from txl.cli.tokenize import tokenize
from txl.cli.train import _recorded_run_args, train
from txl.config import build_run_parser, one_line, run_config_from_namespace

COMMANDS = {
    "train": train, "eval": eval, "generate": generate, "plot": plot, "recl": recl, "attention": attention,
    "serve": serve, "finetune": finetune, "predict": predict, "tokenize": tokenize,
    "convert": {"hf": convert_hf, "original": convert_original, "tf": convert_tf}, "export": {"onnx": export_onnx},
    "data": {"get": data_get, "prepare": data_prepare},
}  # fmt: skip
HELP = {
    "convert": "Import checkpoints of other implementations.",
    "export": "Export models to other runtimes (ONNX).",
    "data": "Download and prepare datasets.",
}
# boolean options that may be given without a value
FLAGS = {
    "--trust_pickle", "--last_only", "--json", "--same_length", "--verify", "--print_config", "--stream",
    "--allow_remote", "--ids", "--decode", "--raw_text",
}  # fmt: skip


NUMBER_LISTS = {"--mem_len", "--contexts", "--r", "--model.cutoffs", "--train.betas", "--prompt_ids", "--stop_ids"}
LIST_ONLY = {"--model.cutoffs", "--prompt_ids"}  # one number is a list of one (--mem_len 64 is one length, not a sweep)
_NUMBERS = re.compile(r"^-?[0-9.]+(,-?[0-9.]+)*$")


def _number_list(option: str, value: str) -> str:
    """``0,64,128`` as ``[0,64,128]`` after an option that takes a list of numbers (``2000`` as ``[2000]`` after one
    that takes only a list)."""
    if option in NUMBER_LISTS and _NUMBERS.match(value) and ("," in value or option in LIST_ONLY):
        return f"[{value}]"
    return value


ALIASES = {  # one option language: each command also takes the names other commands use for the same thing
    "train": {"--device": "--train.device", "--threads": "--train.threads", "--precision": "--train.precision",
              "--seed": "--train.seed"},
    "eval": {"--data.path": "--data", "--data.dataset": "--dataset", "--data.encoding_errors": "--encoding_errors"},
    "recl": {"--data.path": "--data"},
    "attention": {"--data.path": "--data"},
}  # fmt: skip
PATH_LISTS = {"--models", "--sliding"}  # also as --models runs/a runs/b (a shell glob: --models runs/*)


def _path_list(values: list[str]) -> str:
    """The values given after an option that takes a list of paths, as one list (a JSON list given as such)."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        return values[0]
    return _json.dumps(values)


def normalize_argv(argv: list[str]) -> list[str]:
    """Accept the names of :data:`ALIASES` (``txl eval --data.path`` as ``txl train`` says it), ``--some-option`` for
    ``--some_option``, ``--flag`` alone for ``--flag=true``, ``0,64,128`` for
    ``[0, 64, 128]`` after the options that take a list of numbers (also as ``--option=0,64,128``), and the
    paths after an option that takes a list of them (``--models runs/a runs/b``) as one list."""
    out: list[str] = []
    command = next((a for a in argv if not a.startswith("-")), "")
    aliases = ALIASES.get(command, {})
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        prev = out[-1] if out else ""
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            name = "--" + name[2:].replace("-", "_")
            name = aliases.get(name, name)
            if name in PATH_LISTS:
                values = [value] if eq else []
                while not eq and i < len(argv) and not argv[i].startswith("--"):
                    values.append(argv[i])
                    i += 1
                out += [name, _path_list(values)] if values else [name]
                continue
            nxt = argv[i].lower() if i < len(argv) else ""
            bare = name in FLAGS and not eq and nxt not in ("true", "false", "null")
            arg = f"{name}=true" if bare else name + eq + (_number_list(name, value) if eq else "")
        elif prev.startswith("--") and "=" not in prev:
            arg = _number_list(prev, arg)
        out.append(arg)
    return _config_first(out)


def _config_first(argv: list[str]) -> list[str]:
    """Move every ``--config FILE`` in front of the command's other options: a recipe is read first wherever it is
    given, so the options beside it win (the parser applies arguments in order, and an option given before
    ``--config`` would otherwise be replaced by the file's value without a word)."""
    at = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))  # (after the command's words)
    configs, rest, i = [], [], at
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            configs += argv[i : i + 2]
            i += 2
            continue
        (configs if argv[i].startswith("--config=") else rest).append(argv[i])
        i += 1
    return argv[:at] + configs + rest


def _reading_dict(s) -> dict:
    return {"mem_len": s.mem_len, "clamp_len": s.clamp_len, "same_length": s.same_length}


def _description(target) -> str:
    """A command's docstring without its Args section (the options' help comes from there)."""
    return inspect.getdoc(target).split("\nArgs:")[0].strip()


def _summary(target) -> str:
    """A command's one-line summary in ``txl --help``: the first sentence of its docstring, whole."""
    paragraph = " ".join(_description(target).split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s+(?=[A-Z`])", paragraph)[0]


def _arguments(target) -> type | None:
    """The dataclass of a typed command's arguments (its one parameter's type), or None for a flat function."""
    params = list(inspect.signature(target).parameters.values())
    if len(params) != 1:
        return None
    try:
        kind = typing.get_type_hints(target).get(params[0].name)
    except NameError:  # (an annotation only a type checker resolves: not a typed command)
        return None
    return kind if dataclasses.is_dataclass(kind) else None


def _new_parser(prog: str, description: str | None = None):
    from jsonargparse import ArgumentParser

    from txl.config import _parser_mode

    return ArgumentParser(
        prog=prog, description=description, print_config=None, exit_on_error=False, parser_mode=_parser_mode()
    )


def build_parser():
    """The whole ``txl`` parser, and the parser of each command (by command path, e.g. ``("convert", "hf")``)."""
    from jsonargparse import ActionConfigFile, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parsers = {}

    def add(parser, commands: dict, path: tuple[str, ...]) -> None:
        sub = parser.add_subcommands(required=True)
        for name, target in commands.items():
            here = (*path, name)
            prog = " ".join(("txl", *here))
            if isinstance(target, dict):
                child = _new_parser(prog, HELP[name])
                sub.add_subcommand(name, child, help=HELP[name])  # a level is added before the next one
                add(child, target, here)
                continue
            if target is train:
                child = build_run_parser(prog)
                child.add_argument(
                    "--resume",
                    default="auto",
                    help="auto (continue from the run's latest complete checkpoint, if any), none (start fresh; "
                    "refused if the run has checkpoints), or a checkpoint/run folder to continue from. Without "
                    "--config, a run continues with the settings recorded in its checkpoint (run.json; options given "
                    "override them), in the checkpoint's run folder unless --run_dir says otherwise.",
                )
                child.add_argument(
                    "--print_config",
                    type=bool,
                    default=False,
                    help="Print the fully resolved configuration (YAML, what the run would use; model.n_token is "
                    "replaced by the tokenizer's vocabulary size when training starts) and exit.",
                )
            elif target is finetune:
                from txl.train.finetune import FinetuneConfig

                child = _new_parser(prog, _description(target))
                child.add_argument("--config", action=ActionConfigFile, help="Options from a YAML file.")
                child.add_class_arguments(FinetuneConfig, as_group=False)
            elif _arguments(target) is not None:  # (a typed command: its dataclass's docstrings are the help)
                child = _new_parser(prog, _description(target))
                child.add_argument("--config", action=ActionConfigFile, help="Options from a YAML file.")
                child.add_class_arguments(_arguments(target), as_group=False)
            else:
                child = _new_parser(prog, _description(target))
                child.add_argument("--config", action=ActionConfigFile, help="Options from a YAML file.")
                child.add_function_arguments(target, as_group=False, as_positional=True, sub_configs=True)
            parsers[here] = child
            sub.add_subcommand(name, child, help=_summary(target))

    top = _new_parser(
        "txl",
        "Transformer-XL for PyTorch: train, evaluate, generate, convert. Also: txl lm-eval ARGS (EleutherAI's "
        "lm-evaluation-harness with --model txl; txl lm-eval --help).",
    )
    add(top, COMMANDS, ())
    return top, parsers


def _recipe_sections(argv: list[str], keep: tuple[str, ...]) -> tuple[list[str], Path | None]:
    """``argv`` with a ``--config`` recipe that has more sections than the command takes (a training recipe given to
    ``txl data prepare``: its model and train sections) replaced by a copy of the sections it takes (probes cfg2:
    jsonargparse's KeyError 'data'); and that copy, to remove after parsing (None when nothing was replaced)."""
    import tempfile

    import yaml

    for i, arg in enumerate(argv[:-1]):
        if arg != "--config":
            continue
        try:
            recipe = yaml.safe_load(Path(argv[i + 1]).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return argv, None  # (the parser names what is wrong with the file)
        if isinstance(recipe, dict) and set(recipe) & set(keep) and set(recipe) - set(keep):
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, encoding="utf-8") as f:
                yaml.safe_dump({k: v for k, v in recipe.items() if k in keep}, f)
            return [*argv[: i + 1], f.name, *argv[i + 2 :]], Path(f.name)
    return argv, None


def run(argv: list[str]) -> None:
    """Parse ``argv`` (already normalized) and run the command."""
    top, parsers = build_parser()
    copy = None
    if argv[:2] == ["data", "prepare"]:  # (a training recipe's data section)
        argv, copy = _recipe_sections(argv, ("data", "verify"))
    try:
        namespace = top.parse_args(argv)
    except ArgumentError as e:
        hint = _did_you_mean(str(e), argv, parsers)
        if not hint:
            raise
        raise ArgumentError(None, f"{e}{hint}") from None
    finally:
        if copy is not None:
            copy.unlink(missing_ok=True)
    path, node, commands = (), namespace, COMMANDS
    while True:
        name = node["subcommand"]
        path, node, target = (*path, name), node[name], commands[name]
        if not isinstance(target, dict):
            break
        commands = target
    parser = parsers[path]
    if target is train:
        recorded = _recorded_run_args(node, argv[1:])
        if recorded is not None:  # parsed again: the recorded settings first, the options given on top
            node = parser.parse_args(["--config", recorded[0], *argv[1:], *recorded[1:]])
        _n_token_past_the_cutoffs(node["model"])
        train(run_config_from_namespace(node, parser), resume=node["resume"], print_config=node["print_config"])
        return
    if target is finetune:
        from txl.train.finetune import FinetuneConfig

        finetune(FinetuneConfig(**{k: node[k] for k in FinetuneConfig.__dataclass_fields__}))
        return
    arguments = _arguments(target)
    if arguments is not None:
        target(arguments(**{f.name: node[f.name] for f in dataclasses.fields(arguments)}))
        return
    init = parser.instantiate(node)
    target(**{k: init[k] for k in inspect.signature(target).parameters})


def _did_you_mean(message: str, argv: list[str], parsers: dict) -> str:
    """For an option the command does not have: the nearest one it has (a typo, or Hugging Face's name); for a
    bare word, the option it belongs to (``txl generate runs/x`` -> ``--model runs/x``, ``txl train r.yaml`` ->
    ``--config r.yaml``)."""
    unknown = re.findall(r"does not accept option '([^']+)'", message)
    given = re.search(r"unrecognized arguments: (.*)", message)
    bare = []
    if given:
        unknown += [a.split("=", 1)[0].lstrip("-") for a in given.group(1).split() if a.startswith("--")]
        bare = [a for a in given.group(1).split() if not a.startswith("-")]
    words = [a for a in argv if not a.startswith("-")]
    path = max((p for p in parsers if tuple(words[: len(p)]) == p), key=len, default=None)
    if not (unknown or bare) or path is None:
        return ""
    from txl.model.modeling import HF_CONFIG_NAMES

    options = [o[2:] for a in parsers[path]._actions for o in a.option_strings if o.startswith("--")]
    options = [o for o in options if not o.endswith("+") and o != "help"]
    hints = []
    for name in unknown:
        head, _, last = name.rpartition(".")
        renamed = f"{head}.{HF_CONFIG_NAMES[last]}" if head and last in HF_CONFIG_NAMES else HF_CONFIG_NAMES.get(last)
        if renamed in options:
            hints.append(f"--{renamed} (Hugging Face's {last})")
        else:
            hints += [f"--{m}" for m in difflib.get_close_matches(name, options, n=1, cutoff=0.75)]
    if bare and not unknown:  # (with a misnamed option, the bare words are likely its values)
        hints += _bare_word_hint(bare[0], argv, options)
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def _bare_word_hint(word: str, argv: list[str], options: list[str]) -> list[str]:
    """The option a bare word belongs to: a recipe's ``--config``, or the model folder's ``--model`` (not train's,
    which is a group of settings: ``--model.n_token``, ...)."""
    if word.endswith((".yaml", ".yml")) and "config" in options:
        return [f"--config {word} (a recipe is an option)"]
    takes_model = "model" in options and not any(o.startswith("model.") for o in options)
    if takes_model and not any(a == "--model" or a.startswith("--model=") for a in argv):
        return [f"--model {word} (the model is an option)"]
    return []


def _n_token_past_the_cutoffs(model) -> None:
    """A recipe's n_token is a placeholder that training replaces with the vocabulary's size (dropping the cutoffs
    past its end): cutoffs given beyond it, for a larger vocabulary, raise it instead of failing its check."""
    cutoffs = model["cutoffs"]
    if isinstance(cutoffs, list) and cutoffs and all(isinstance(c, int) and not isinstance(c, bool) for c in cutoffs):
        if isinstance(model["n_token"], int) and model["n_token"] <= max(cutoffs):
            model["n_token"] = max(cutoffs) + 1


def _argument_message(message: str) -> str:
    """jsonargparse's type errors as ``--option = value: expected ...``; other messages unchanged."""
    key = re.match(r'Parser key "([^"]+)":', message)
    if key is None:
        return message
    option = f"--{key.group(1)}"
    union = re.search(
        r"Subtypes: \[(.*?)\] Errors: - Expected an? <class '(\w+)'>\.? Got value: ?(.*?) ?- Expected", message
    )
    whole = re.search(r"Given value: (.*)$", message)
    if union and whole:  # (a list option with a bad item: name the item and the list's type, probes.md n19, r9)
        wanted = union.group(1).split(", <class 'NoneType'>")[0]
        article = "an" if union.group(2)[0] in "aeiou" else "a"
        return (
            f"{option} = {whole.group(1).strip()}: {union.group(3).strip() or repr('')} is not {article} "
            f"{union.group(2)} (expected {wanted})"
        )
    choices = re.search(r"Literal\[([^\]]+)\]", message)
    given = re.search(r"(?:Given value|Got value): (.*?)(?: Given value type|$)", message)
    value = repr(given.group(1).strip()) if given else "this value"
    if choices:
        return f"{option} = {value}: expected one of {choices.group(1).replace(chr(39), '')}"
    expected = re.search(r"Expected a <class '(\w+)'>", message)
    if expected and expected.group(1) == "float" and given:
        try:
            if not math.isfinite(float(given.group(1).strip())):  # (probes cf12-cf15: nan is a float, not a finite one)
                return f"{option} = {value}: expected a finite number"
        except ValueError:
            pass
    if expected:
        return f"{option} = {value}: expected {'an' if expected.group(1)[0] in 'aeiou' else 'a'} {expected.group(1)}"
    return f"{option}: {message[key.end() :].strip()}"


def _error(e: BaseException) -> tuple[int, str] | None:
    """(exit code, message) for the errors a user can act on; None for anything else (a bug: traceback)."""
    from txl.infer.evaluate import NonFiniteError
    from txl.train.trainer import TrainingError

    if isinstance(e, ArgumentError):
        return 2, f"txl: error: {_argument_message(one_line(str(e)))} (--help lists the options)"
    if isinstance(e, TrainingError):
        return 1, f"txl: training stopped: {e}"
    if isinstance(e, NonFiniteError):
        return 1, f"txl: error: {e}"
    if isinstance(e, BrokenPipeError):  # (the reader of the output left: `txl generate ... | head -1`)
        return 1, "txl: stopped: the output was closed before the command finished (its reader exited)"
    if isinstance(e, FileNotFoundError):
        return 2, f"txl: error: {e.filename}: {e.strerror}" if e.filename else f"txl: error: {e}"
    if isinstance(e, (FileExistsError, NotADirectoryError)) and e.filename:  # a file where a folder must be
        return 2, f"txl: error: {e.filename}: {e.strerror} (a file is in the way of a folder: choose another path)"
    if isinstance(e, PermissionError):  # (probes.md d14: a file the user cannot read is the user's to fix: 2)
        where = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        return 2, f"txl: error: {where} (check its permissions)"
    if isinstance(e, OSError):
        where = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        advice = (
            "free space on that disk"
            if e.errno in (errno.ENOSPC, errno.EDQUOT)
            else "that folder's permissions and free space"
        )
        return 1, f"txl: error: {where} (check {advice})"
    if isinstance(e, ValueError):  # ConfigError, DataError, CheckpointError and bad values
        return 2, f"txl: error: {e}"
    if _out_of_memory(e):  # (past the commands' own estimates: one line, not torch's traceback)
        return 1, (
            f"txl: error: out of memory ({_allocation(e)}): give the command smaller sizes (batch size, segment "
            "and memory lengths), or free memory"
        )
    return None


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation torch could not make (a GPU's, or the CPU allocator's)."""
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e)
    )


def _allocation(e: BaseException) -> str:
    """What torch's out-of-memory message says was asked for, in GiB where it gives bytes."""
    asked = re.search(r"allocate (\d+) bytes", str(e))
    if asked:
        return f"an allocation of {int(asked.group(1)) / 2**30:,.1f} GiB failed"
    return one_line(str(e)).split(". ")[0]


def version_report() -> str:
    """``txl --version``: the versions, the native kernels' state, and which CPU fast paths this machine measured
    faster (``txl.kernels.measured``)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from txl.kernels import native, registry
    from txl.kernels.backends import backends

    try:
        mine = version("transformer-xl")
    except PackageNotFoundError:
        mine = "(source tree)"
    return "\n".join(
        [f"txl {mine} (torch {torch.__version__})", f"native kernels: {native.status()}", backends().describe(),
         registry.describe()]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["lm-eval"], ["lm_eval"]):  # EleutherAI's harness, its own command line (txl.interop.lm_harness)
        try:
            from txl.interop.lm_harness import cli as lm_eval_cli
        except ImportError as e:
            print(f"txl: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        lm_eval_cli(argv[1:])
        return
    if argv[:1] in (["--version"], ["-V"]):
        print(version_report())
        return
    try:
        run(normalize_argv(argv))
    except Exception as e:
        handled = None if os.environ.get("TXL_DEBUG") else _error(e)
        if handled is None:
            raise
        code, message = handled
        configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"] + [
            a.split("=", 1)[1] for a in argv if a.startswith("--config=")
        ]
        if configs and "Problems parsing config:" in message:  # (the recipe's checks name its line: name its file)
            message = message.replace("Problems parsing config:", f"{configs[-1]}:")
        if configs and "Unexpected config:" in message:  # (probes ya10, ya11: an empty file, a top-level list)
            message = (
                f"txl: error: {configs[-1]}: not a recipe (an empty file, or not a mapping at its top level); a "
                "recipe is YAML sections of options, as configs/*.yaml"
            )
        print(message, file=sys.stderr)
        raise SystemExit(code) from None
