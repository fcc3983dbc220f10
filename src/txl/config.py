"""Typed sections of a training run (``txl train --config X.yaml``): ``model``, ``data``, ``train``, ``eval``.
Design notes: docs/internals.md#txlconfig."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from txl.data import DataConfig
from txl.kernels.backends import Backends
from txl.model.modeling import Reading, TransformerXLConfig
from txl.util.folders import read_json

Precision = Literal["fp32", "bf16", "fp16", "auto"]
Quantization = Literal["none", "int8", "int8-weight-only"]
"""Inference with the Linear layers in int8 on the CPU (txl.infer.quantize): none, int8 (PyTorch's dynamic
quantization), int8-weight-only (torchao's)."""
Split = Literal["train", "valid", "test"]
SECTIONS = ("model", "data", "train", "eval", "run_dir")
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
"""The range of a random seed (64 bits; the server's seeds are 0 to MAX_SEED): torch's generators take -2**63 to
2**64 - 1 (a negative seed as seed + 2**64), numpy's (the data order) the same 64 bits as seed % 2**64, and a run's
process r draws dropout with seed + r."""
SEED_RANGE = "a seed is a whole number from -2**63 to 2**63 - 1 (64 bits)"
"""What a bad seed's error says, in every command."""


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the field (or file) and what to do."""


@dataclass
class TrainConfig:
    """How to train (the ``train`` section)."""

    batch_size: int = 60
    """Global batch size: columns of the token stream, split over all processes."""
    tgt_len: int = 70
    """Segment length: tokens predicted per column per step."""
    ext_len: int = 0
    """Extended context: the last ext_len tokens of each segment are fed again (with gradient) in front of the
    next one instead of being kept in the memory; only the last tgt_len positions are scored (the reference's
    --ext_len)."""
    loss_fraction: float = 1.0
    """Fraction of each segment's positions that are scored, counted from its end: 1.0 scores all of them; 0.5 is
    the paper's "half loss" ablation (Table 6), where only the last half, the positions with the longest context
    within the segment, contribute to the loss."""
    mem_len_schedule: list[list[int]] | None = None
    """A memory that grows during training: [[step, mem_len], ...], the first at step 0, each memory used from its
    step on, growing to model.mem_len (the memory the model keeps and is evaluated with), e.g. [[0, 64], [1000, 128],
    [2000, 256]]. None: model.mem_len from the first step."""
    varlen: bool = False
    """Vary the segment length per step as the reference's --varlen does (tgt_len, sometimes half, plus noise)."""
    batch_chunk: int = 1
    """Gradient accumulation: split each process's columns into this many chunks, each with its own memory."""
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    """Optimizer (Adam as in the paper)."""
    lr: float = 0.00025
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw, L2 for adam and sgd)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW betas."""
    eps: float = 1e-8
    """Adam/AdamW epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    fused: bool | None = None
    """Use the fused optimizer kernel (None: wherever torch offers one for the device)."""
    scheduler: Literal["cosine", "inv_sqrt", "constant"] = "cosine"
    """Learning-rate schedule after the linear warm-up."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many steps."""
    eta_min: float = 0.0
    """cosine: the final learning rate."""
    decay_steps: int | None = None
    """cosine: steps from 0 to eta_min (None: max_steps, as the reference: the cosine includes the warm-up)."""
    clip: float = 0.25
    """Clip the global gradient norm to this value (0: no clipping; the norm is still checked and logged)."""
    max_steps: int = 200_000
    """Stop after this many optimizer steps."""
    max_tokens: int | None = None
    """Stop once this many training tokens (all processes) have been seen."""
    max_time: float | None = None
    """Stop after this many seconds of training (summed over resumed runs), saving a checkpoint."""
    precision: Precision = "fp32"
    """fp32; bf16 (autocast, CPU or CUDA); fp16 (autocast + GradScaler, CUDA only); auto (bf16 where the device
    computes it natively: a CUDA GPU, a CPU with avx512_bf16 or AMX; else fp32). Attention softmax and the
    adaptive log-softmax always run in fp32."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (the local rank's GPU if there is one, else cpu)."""
    threads: int | None = None
    """torch CPU threads per process (None: torch's default)."""
    fp32_route: bool = False
    """(CPU, opt-in) fp32 matrix products through oneDNN where that is faster and exact: each kind of product
    (operation, shapes, strides) is checked against float64 before the route computes it, and runs on the default
    path where the route is not exact (it computes in bf16 on AMX CPUs). Training steps 1.06-1.09x measured on AMD
    EPYC. Recorded with each checkpoint; a resumed run keeps its checkpoint's choice."""
    fast_paths: dict[str, Any] | None = None
    """Changes to the fast-path policy for this run (``txl.Backends``' fields, docs/speed.md), e.g.
    {fused_attention_training: [cuda]} (the fused Triton attention in training on a GPU) or {native_attention: false};
    the log's ``runtime:`` lines and each checkpoint's metadata.json say which policy ran. None: the default policy."""
    seed: int = 1111
    """Seed for initialisation, dropout and the data order (process r uses seed + r for dropout); 64 bits: -2**63 to
    2**63 - 1."""
    log_interval: int = 200
    """Write a metrics line every this many steps."""
    eval_interval: int = 4000
    """Evaluate on the valid split every this many steps (0: only at the end)."""
    eval_batch_size: int = 10
    """Batch size of the periodic evaluation (the reference hard-codes 10)."""
    eval_tgt_len: int | None = None
    """Segment length of the periodic evaluation; its memory is mem_len + tgt_len - eval_tgt_len, keeping the
    attention span of training, as the reference does (None: tgt_len)."""
    eval_max_steps: int | None = None
    """Evaluate on at most this many batches (None: the whole split)."""
    checkpoint_interval: int = 4000
    """Save a checkpoint every this many steps (0: only at the end). One is always saved when training stops."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (plus the best one by validation loss)."""
    keep_best: bool = True
    """Also keep the checkpoint with the best validation loss."""
    progress: bool | None = None
    """Show a progress bar (None: only when stderr is a terminal)."""
    tensorboard: bool = False
    """Also write TensorBoard logs to RUN/tensorboard (needs the `tb` extra)."""

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ConfigError(f"train.{name} = {getattr(self, name)!r}: {why}")

        positive = ("batch_size", "tgt_len", "batch_chunk", "max_steps", "log_interval", "eval_batch_size", "keep_last")
        for name in positive:
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        for name in ("ext_len", "warmup_steps", "eval_interval", "checkpoint_interval"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        for name in ("threads", "max_tokens", "eval_max_steps", "eval_tgt_len", "decay_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                bad(name, "must be >= 1 (or null)")
        for name in ("lr", "clip", "weight_decay", "momentum", "eta_min", "eps", "loss_fraction"):
            if not math.isfinite(getattr(self, name)):  # (probes ya7: lr .inf trained to a NaN loss at step 2)
                bad(name, "must be a finite number")
        if not 0.0 < self.loss_fraction <= 1.0:
            bad("loss_fraction", "must be in (0, 1] (1: every position is scored; 0.5: the paper's half loss)")
        if self.lr <= 0:
            bad("lr", "must be > 0")
        if not MIN_SEED <= self.seed <= MAX_SEED:
            bad("seed", SEED_RANGE)
        for name in ("clip", "weight_decay", "momentum", "eta_min"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        if self.eps <= 0:
            bad("eps", "must be > 0")
        if self.max_time is not None and self.max_time <= 0:
            bad("max_time", "must be > 0 seconds (or null)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            bad("betas", "needs two values in [0, 1)")
        if self.mem_len_schedule is not None:
            pairs = self.mem_len_schedule
            if not pairs or any(len(x) != 2 for x in pairs) or pairs[0][0] != 0:
                bad("mem_len_schedule", "needs [step, mem_len] pairs, the first at step 0, e.g. [[0, 64], [1000, 256]]")
            steps, mems = [x[0] for x in pairs], [x[1] for x in pairs]
            if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
                bad("mem_len_schedule", "its steps must increase")
            if mems[0] < 0 or any(b < a for a, b in zip(mems, mems[1:], strict=False)):
                bad("mem_len_schedule", "its memories must be >= 0 and grow (never shrink)")
        if Backends.why_not(self.fast_paths):  # (a mapping of Backends' fields, each of its type)
            bad("fast_paths", Backends.why_not(self.fast_paths))
        if self.scheduler == "inv_sqrt" and self.warmup_steps == 0:
            bad("warmup_steps", "inv_sqrt needs warmup_steps > 0 (the peak is at the end of the warm-up)")


@dataclass
class EvalConfig:
    """How the trained model is evaluated (the ``eval`` section; the defaults of ``txl eval``).

    The paper evaluates with a longer memory than in training and ``same_length``."""

    split: Split = "test"
    """Split to evaluate."""
    batch_size: int = 10
    """Columns evaluated in parallel."""
    tgt_len: int = 64
    """Segment length."""
    mem_len: int = 640
    """Memory length (usually longer than in training)."""
    clamp_len: int = -1
    """Relative distances above this share one positional embedding (-1: none)."""
    same_length: bool = True
    """Every query sees the same number (mem_len) of keys."""
    cmem_len: int | None = None
    """A Compressive Transformer's compressed memory slots per layer (None: the model's cmem_len)."""

    def reading(self) -> Reading:
        """How the model reads with these settings (its mem_len, same_length, clamp_len, cmem_len), for its calls."""
        return Reading(self.mem_len, self.same_length, self.clamp_len, self.cmem_len)

    def validate(self, prefix: str = "eval.") -> None:
        """Raise ``ConfigError`` naming the first bad field as ``{prefix}{field}``."""

        def bad(name: str, why: str) -> None:
            raise ConfigError(f"{prefix}{name} = {getattr(self, name)!r}: {why}")

        if self.split not in ("train", "valid", "test"):
            bad("split", "must be train, valid or test")
        for name in ("batch_size", "tgt_len"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.mem_len < 0:
            bad("mem_len", "must be >= 0")
        if self.same_length and self.mem_len == 0:
            bad("same_length", "needs mem_len > 0 (the window of mem_len keys would be empty)")
        if self.cmem_len is not None and (self.cmem_len < 0 or (self.cmem_len and not self.mem_len)):
            bad("cmem_len", "must be >= 0, and 0 without a memory (it holds what leaves the memory)")


@dataclass
class RunConfig:
    """All sections of a run, as saved in RUN/config.yaml and in every checkpoint (run.json)."""

    model: TransformerXLConfig
    """The model (n_token is set from the tokenizer's vocabulary when training)."""
    data: DataConfig
    """The dataset and tokenizer."""
    train: TrainConfig
    """Optimisation, precision, logging and checkpoints."""
    eval: EvalConfig
    """Evaluation settings of the trained model (the defaults of `txl eval`)."""
    run_dir: str = "runs/default"
    """Run folder: config.yaml, metrics.jsonl, train.log, checkpoints/step-N/."""

    def __post_init__(self) -> None:
        self.train.validate()
        self.eval.validate()
        self.data.validate()
        t, m = self.train, self.model
        if m.attn_type in (1, 3) and m.max_klen == 0:  # learned positions: the longest span of training
            m.max_klen = t.tgt_len + t.ext_len + m.mem_len
        if t.mem_len_schedule is not None and t.mem_len_schedule[-1][1] != m.mem_len:
            raise ConfigError(
                f"train.mem_len_schedule = {t.mem_len_schedule!r}: its last memory must be model.mem_len = "
                f"{m.mem_len} (the memory the trained model keeps); end it with [step, {m.mem_len}]"
            )
        if m.attn_type in (2, 3) and self.eval.clamp_len > 0:
            raise ConfigError(
                f"eval.clamp_len = {self.eval.clamp_len}: clamps relative distances, and model.attn_type "
                f"{m.attn_type} has absolute positions; use -1"
            )
        if m.mem_len > 0 and t.eval_tgt_len is not None and t.eval_tgt_len >= t.tgt_len + m.mem_len:
            raise ConfigError(
                f"train.eval_tgt_len = {t.eval_tgt_len}: the in-training evaluation keeps the attention span of "
                f"training (tgt_len + mem_len = {t.tgt_len + m.mem_len}) and would have no memory left; "
                f"use an eval_tgt_len below {t.tgt_len + m.mem_len}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "data": asdict(self.data),
            "train": asdict(self.train),
            "eval": asdict(self.eval),
            "run_dir": self.run_dir,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run configuration") -> RunConfig:
        """Rebuild from a dict (e.g. a checkpoint's ``run.json``), through the same parser as ``txl train``."""
        return _build(lambda: run_parser().parse_object(data), source)


YAML_MODE = "txl_yaml"
"""The jsonargparse parser mode of txl's parsers: YAML read by :func:`checked_yaml_load`."""
MAX_YAML_VALUES = 100_000
"""The most values a YAML document may hold once its aliases (``*name``) are expanded."""


def checked_yaml_load(text: str) -> Any:
    """jsonargparse's YAML loader, after checks that a document written by mistake or by an attacker cannot pass:
    a duplicate key (YAML takes the last silently), an alias that refers to itself (an endless structure), or
    aliases that expand to more than :data:`MAX_YAML_VALUES` values (a kilobyte "billion laughs" grows to gigabytes),
    and a run section (``model``, ``data``, ``train``, ``eval``) that is not a mapping of its fields."""
    import yaml
    from jsonargparse._loaders_dumpers import yaml_load

    try:
        nodes = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        nodes = None  # (jsonargparse's loader reports it, or reads the value as a plain string)
    if nodes is not None:
        _check_yaml_node(nodes, {}, set())
    value = yaml_load(text)
    if isinstance(value, dict):
        for section in SECTIONS[:4]:
            if section in value and not isinstance(value[section], dict | None):
                raise yaml.YAMLError(
                    f"the section {section}: must be a mapping of its fields ({section}: then indented lines "
                    f"field: value), not {value[section]!r}"
                )
    return value


def _check_yaml_node(node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """The number of values ``node`` expands to (aliases counted each time they are used; memoised by node, so the
    walk is linear in the document); raises on a duplicate key, a recursive alias or too many values."""
    import yaml

    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise yaml.YAMLError(f"line {node.start_mark.line + 1}: an alias refers to the structure it is part of")
    open_nodes.add(id(node))
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen and key.tag != "tag:yaml.org,2002:merge":
                    raise yaml.YAMLError(f"line {key.start_mark.line + 1}: the key {key.value!r} is given twice")
                seen.add(key.value)
            size += _check_yaml_node(key, sizes, open_nodes) + _check_yaml_node(value, sizes, open_nodes)
    elif isinstance(node, yaml.SequenceNode):
        size += sum(_check_yaml_node(item, sizes, open_nodes) for item in node.value)
    open_nodes.discard(id(node))
    if size > MAX_YAML_VALUES:
        raise yaml.YAMLError(
            f"line {node.start_mark.line + 1}: its aliases expand to more than {MAX_YAML_VALUES:,} values"
        )
    sizes[id(node)] = size
    return size


def _parser_mode() -> str:
    """Register :func:`checked_yaml_load` as jsonargparse's loader of :data:`YAML_MODE` (once) and name it."""
    import yaml
    from jsonargparse import set_loader
    from jsonargparse._loaders_dumpers import loaders

    if YAML_MODE not in loaders:
        set_loader(YAML_MODE, checked_yaml_load, exceptions=(yaml.YAMLError,))
    return YAML_MODE


def build_run_parser(prog: str = "txl train"):
    """A new parser of run configurations: the options of ``txl train``, one per field of every section.

    Sections have no default instance: jsonargparse would otherwise read nested defaults off an instance whose
    derived fields were already resolved from *its* values (a ``d_embed`` of the default ``d_model``).
    """
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(
        prog=prog,
        description="Train a Transformer-XL language model (--config configs/NAME.yaml; under torchrun: "
        "data-parallel).",
        print_config=None,
        exit_on_error=False,
        parser_mode=_parser_mode(),
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe (YAML) with the sections below.")
    parser.add_class_arguments(RunConfig, as_group=False, sub_configs=True)
    return parser


@lru_cache(maxsize=1)
def run_parser():
    """The (shared) parser that ``load_recipe`` and ``RunConfig.from_dict`` use; ``txl train`` builds its own
    with :func:`build_run_parser`."""
    return build_run_parser()


def run_config_from_namespace(namespace, parser=None) -> RunConfig:
    """A :class:`RunConfig` from a namespace parsed by a run parser (instantiates every section)."""
    init = (parser or run_parser()).instantiate(namespace)
    return RunConfig(**{k: init[k] for k in SECTIONS})


def _build(parse: Callable[[], Any], source: str) -> RunConfig:
    try:
        return run_config_from_namespace(parse())
    except argparse.ArgumentError as e:
        raise ConfigError(f"{source}: {one_line(str(e))}") from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {one_line(str(e))}") from None


def one_line(message: str) -> str:
    """A (jsonargparse) multi-line message as one line."""
    return " ".join(part.strip() for part in message.strip().splitlines() if part.strip())


def load_recipe(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> RunConfig:
    """A recipe YAML (sections model/data/train/eval, run_dir) with nested ``overrides``, as a RunConfig.

    Parsed exactly as ``txl train --config PATH --section.field value ...`` parses it.
    """
    parser = run_parser()

    def parse():
        namespace = parser.parse_args(["--config", os.fspath(path)])
        return parser.parse_object(overrides, namespace=namespace) if overrides else namespace

    return _build(parse, os.fspath(path))


RUN_CONFIG = "run.json"  # a checkpoint's run configuration


def read_run_config(folder: Path) -> RunConfig | None:
    """The run configuration saved in a checkpoint (``run.json``), parsed like a recipe; None for a model folder."""
    path = Path(folder) / RUN_CONFIG
    return RunConfig.from_dict(read_json(path), source=str(path)) if path.is_file() else None


@dataclass
class ServeLimits:
    """What bounds one request's work, checked before it is admitted (each a `txl serve` option)."""

    max_prompt_tokens: int = 4096
    """Longest prompt, in tokens (read in pieces of 1,024 positions: ``txl.infer.prompt``, the memory a piece holds
    bounded by them)."""
    max_new_tokens: int = 1024
    """Most tokens one generation may ask for."""
    max_batch: int = 8
    """Rows in flight at most, whatever their memory lengths: a generation is one, a beam search one per beam, a
    scored text one."""
    max_queue: int = 64
    """Requests that may wait for a row; more get 429."""
    max_score_tokens: int = 200_000
    """Longest text /v1/score takes, in tokens."""
    max_mem_len: int = 8192
    """Longest memory a request may ask for (its keys and values are kept per row)."""
    max_tgt_len: int = 2048
    """Longest segment /v1/score may ask for (its attention is tgt_len x (tgt_len + mem_len) per head)."""
    max_stops: int = 16
    """Most stop strings per request."""
    max_stop_chars: int = 256
    """Longest stop string, in characters."""
    max_body_bytes: int = 8 << 20
    """Largest request body, in bytes; larger ones get 413."""
    stream_buffer_tokens: int = 256
    """Tokens of one generation made ahead of what its client has taken, at most: a client that reads slowly slows
    its own generation (which waits, its row given to others, until the client takes half of them)."""
    stream_timeout: float = 30.0
    """Seconds a response may wait for its client to read (a full send buffer) before the connection is closed."""
