"""Which fast paths may run: the one policy that chooses the backends of txl's named operations.
Design notes: docs/internals.md#txlkernelsbackends."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


def _native_from_env() -> bool:
    """``TXL_NATIVE=0`` (or false, no, off) starts a process with the native kernels off."""
    return os.environ.get("TXL_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _measure_from_env() -> bool:
    """``TXL_MEASURE=0`` (or false, no, off) starts a process whose CPU fast paths run unmeasured, wherever they
    apply (the tests: the kernels they hold to the reference always run)."""
    return os.environ.get("TXL_MEASURE", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Backends:
    """The fast paths that may run (each True: where it can; False: the reference kernels instead)."""

    native_kernels: bool = field(default_factory=_native_from_env)
    """Every kernel of :mod:`txl.kernels.native` (built with the machine's C compiler on first use); off: the PyTorch
    path
    everywhere. The default comes from ``TXL_NATIVE`` (``TXL_NATIVE=0``: off)."""
    measured: bool = field(default_factory=_measure_from_env)
    """Each CPU fast path (native attention, dropout, relu + dropout, NLL, decode; the segment projection) runs only
    where it was measured faster than the reference on this machine, at its first use (``txl.kernels.measured``:
    kept per machine and version in ``~/.cache/txl/native/measured.json``; ``txl --version`` lists them). False
    (``TXL_MEASURE=0``): wherever it applies."""
    native_attention: bool = True
    """The attention of attn_type 0 as one native call per head where it can (fp32 on the CPU, a C compiler to build
    it): in inference (evaluation, prompts, :func:`txl.kernels.native.attention`) the (b)+(d) product, the shift, the
    mask,
    the softmax and the value sum without a [B, H, T, K] tensor in memory; with gradients (training) the same
    forward keeping the probabilities, and one native backward (dropatt included). False: the PyTorch kernels."""
    native_dropout: bool = True
    """CPU dropout (fp32, bf16) by :mod:`txl.kernels.native`'s kernel where it is built: one pass, a Philox4x32-10
    stream
    keyed by a seed from torch's generator, ~5x cheaper (1.1x / 1.2x on the fp32 / bf16 bench-char training step).
    False, or no C compiler: the PyTorch mask (a different random stream)."""
    native_relu_dropout: bool = True
    """The feed-forward's relu and dropout as one native pass each way in training (where the native dropout runs;
    the same values and masks). False: relu, then the dropout."""
    segment_projection: bool = True
    """Training's W_q / W_kv products of a post-LN layer with one backward (no input gradient for the detached
    memory's rows). False: ``F.linear`` per slice."""
    half_precision_scores: bool = True
    """Under bf16 autocast, the attention scores summed and masked in bf16 (the softmax computes in fp32 either
    way). False: upcast to fp32 first."""
    sdpa_training_devices: tuple[str, ...] = ("cuda",)
    """Devices on which training's attention is one ``scaled_dot_product_attention`` call (the scores' sum, mask
    and shift in PyTorch kernels first)."""
    native_nll: bool = True
    """The adaptive softmax's training and scoring loss (targets given, no log-probs asked for) as each cluster's NLL
    straight from its logits by :mod:`txl.kernels.native` (fp32 CPU); in evaluation from the hidden states, no logits
    stored. False: log_softmax + gather."""
    transposed_weights: bool = True
    """CPU inference on a few rows keeps a transposed copy of each weight with at least as many outputs as inputs
    (about 2/3 of the layer weights): generation is faster, at that memory. False saves the memory."""
    fast_decode: bool = True
    """A cached step of one token (generation, serving) as one loop over the layers (``TransformerXL._decode``: the
    attention's products and scores from its weights, then the layer's own output, norm, gate and feed-forward
    modules) instead of the layers' general path. Admitted only for stock layers (``txl.kernels.admission``: no
    subclass, replaced method, shadowing attribute, swapped module or hook; checked against the layers' forward once
    per process), else declined with one log line."""
    native_decode: bool = True
    """``TransformerXL._decode`` as one native call where it can (fp32 on the CPU, a C compiler to build it)."""
    graph_decode: bool = True
    """``txl.infer.generation.stream`` replays its one-token step as a CUDA graph on a CUDA device (attn_type 0). False:
    the K/V cache's step, launched kernel by kernel."""
    graph_act: tuple[str, ...] = ("cuda",)
    """Devices on which ``txl.rl``'s acting memory is a ring of fixed shape whose step of every environment replays
    as one CUDA graph (``txl.rl.acting.RingMemory``; stock layers only). Elsewhere the K/V cache's step (on the CPU
    one native call). ``MemoryTransformer.initial_memory(graph=...)`` chooses for one memory."""
    graph_segments: tuple[str, ...] = ("cuda",)
    """Devices on which a cached segment of several positions (evaluation, scoring) runs its layers as a replayed
    CUDA graph once the window's length repeats (``txl.kernels.graphs``: one graph per offset of the window in the
    cache's buffer, captured at its first step), for half-precision steps. The same kernels on the same operands; on
    the CPU (tests) the step traced by ``make_fx`` stands in for the graph."""
    compiled_layers: tuple[str, ...] = ("cuda",)
    """Devices on which training's layers (attention and feed-forward, forward and backward) run as one
    ``torch.compile`` graph per layer shape (``txl.kernels.compiled``): the reference code, traced, its pointwise
    passes fused by Inductor (the shift as an index, the mask, softmax and dropout in one kernel). The same values
    up to rounding (tests/test_compiled.py); its first steps wait for the compiler (about a minute on a GPU)."""
    compiled_layers_graphs: tuple[str, ...] = ()
    """Devices on which the compiled layers are also replayed as CUDA graphs (Inductor's ``mode="reduce-overhead"``:
    each layer's forward and backward one launch, their inputs copied into the graphs' buffers). Off by default: not
    yet measured on a GPU (issue 68: the bf16 training step looked bound by something other than its products; the
    profile of ``benchmarks/gpu_profile.py`` and gpu_paper.py's ``txl-layer-graphs`` row decide). A training loop
    that turns it on marks each step's start (``torch.compiler.cudagraph_mark_step_begin()``)."""
    fused_attention: tuple[str, ...] = ("cuda",)
    """Devices on which attn_type 0's attention in inference (no gradients: evaluation, scoring, prompts) is one fused
    Triton kernel (``txl.kernels.fused_attention``: the content and position terms, the shift as an index, the mask,
    an online softmax and the value sum, no [B, H, T, K] tensor; needs ``triton``), for half-precision segments of
    several positions on a GPU of compute capability 8.0 or later. fp32 on a GPU is left to the reference (the
    kernel's IEEE fp32 products were 6x slower than cuBLAS), one-token steps to the decode paths. Measured on an
    H200 (docs/benchmarks.md): evaluation at NVIDIA's setting 256,159 -> 281,154 tok/s, the losses within bf16
    rounding. Under Triton's interpreter (``TRITON_INTERPRET=1``) it runs on the CPU too: that is how the tests hold
    it to the reference."""
    fused_attention_training: tuple[str, ...] = ()
    """Devices on which training's attention (forward and backward, dropatt by the kernel's own Philox stream: the
    same distribution as ``F.dropout``) is the fused Triton kernel, under the same conditions. Off by default: on an
    H200 the WT103 base step trained at 98,304 tok/s with it against 137,269 with the compiled layers alone
    (docs/benchmarks.md). ``use_backends(fused_attention_training=("cuda",))`` turns it on."""
    half_precision_logits: tuple[str, ...] = ("cuda",)
    """Devices on which the adaptive softmax's products run in the autocast dtype under autocast (bf16 products with
    fp32 accumulation; the log-softmax, its sum and the loss stay fp32). Elsewhere, or off: the products in fp32."""

    def describe(self) -> str:
        """One line for a log: which fast paths are off (all on: the default), and whether the CPU ones run only where
        measured faster (the default)."""
        default = Backends()
        fields = [f.name for f in dataclasses.fields(self) if f.name != "measured"]
        off = [n for n in fields if getattr(self, n) is False]
        changed = [n for n in fields if n not in off and getattr(self, n) != getattr(default, n)]
        how = "" if self.measured else " (CPU paths unmeasured: wherever they apply)"
        if not off and not changed:
            return f"fast paths: all that can run{how}"
        parts = [f"off: {', '.join(off)}"] if off else []
        parts += [f"{n} = {getattr(self, n)!r}" for n in changed]
        return "fast paths: " + "; ".join(parts) + how

    def training_paths(self, device: str, precision: str) -> str:
        """One line for a training log: which backend each of training's operations takes on ``device`` ("cuda",
        "cpu", ...) in ``precision`` ("fp32", "bf16", "fp16") under this policy (the native CPU kernels also need
        their library: ``txl.kernels.native.status``)."""
        half = precision != "fp32"
        native_cpu = device == "cpu" and self.native_kernels and not half
        fused_here = device in self.fused_attention_training and fused_pays(device, _DTYPES[precision], 2)
        fused = " (attention: the fused Triton kernel)" if fused_here else ""
        if device in self.compiled_layers:
            layers = f"compiled by torch.compile (Inductor: the scores' shift, mask, softmax, dropout fused){fused}"
        elif fused:
            layers = f"eager{fused}"
        elif native_cpu and self.native_attention:
            layers = "eager, attention by the native kernels" + self._where_measured()
        elif device in self.sdpa_training_devices and not half:
            layers = "eager, attention by scaled_dot_product_attention"
        else:
            layers = "eager, attention by PyTorch kernels"
        return (
            f"training on {device} ({precision}): layers {layers}; adaptive softmax {self._logits(device, precision)}"
        )

    def inference_paths(self, device: str, precision: str) -> str:
        """One line for a log: which backend evaluation and scoring take on ``device`` in ``precision`` under this
        policy (a cached segment of several positions, the memory full)."""
        half = precision != "fp32"
        if device in self.fused_attention and fused_pays(device, _DTYPES[precision], 2):
            triton = importlib.util.find_spec("triton") is not None
            attention = "the fused Triton kernel" if triton else "PyTorch kernels (the fused kernel needs triton)"
        elif device == "cpu" and self.native_kernels and self.native_attention and not half:
            attention = "the native kernels" + self._where_measured()
        else:
            attention = "PyTorch kernels (one SDPA call)"
        graphs = (
            "; layers replayed as CUDA graphs" if half and device == "cuda" and device in self.graph_segments else ""
        )
        logits = self._logits(device, precision)
        return f"evaluation on {device} ({precision}): attention by {attention}{graphs}; adaptive softmax {logits}"

    def _where_measured(self) -> str:
        return " where measured faster here (else PyTorch's; txl --version lists them)" if self.measured else ""

    def _logits(self, device: str, precision: str) -> str:
        """The adaptive softmax's path, for the two lines above."""
        if precision != "fp32" and device in self.half_precision_logits:
            return f"{precision} products, fp32 log-softmax"
        native_cpu = device == "cpu" and self.native_kernels and precision == "fp32"
        return "native NLL" if native_cpu and self.native_nll else "fp32"

    @staticmethod
    def changes(mapping: dict) -> dict:
        """``mapping`` (field name -> value, as JSON or YAML gives it: lists for device lists) as keyword arguments
        of :func:`use_backends`, checked: a ValueError names an unknown field (and the known ones) or a value of the
        wrong type."""
        if not isinstance(mapping, dict):
            raise ValueError(
                f"takes a mapping of txl.Backends fields, e.g. {{native_attention: false}} (got {mapping!r})"
            )
        default = Backends()
        out = {}
        for name, value in mapping.items():
            if not hasattr(default, name):
                known = ", ".join(sorted(f.name for f in dataclasses.fields(Backends)))
                raise ValueError(f"unknown fast path {name!r}: one of {known}")
            if isinstance(getattr(default, name), tuple):  # (a list of device types)
                if isinstance(value, str) or not all(isinstance(d, str) and d for d in value):
                    raise ValueError(f"{name} takes a list of device types, e.g. [cuda] or [] (got {value!r})")
                out[name] = tuple(value)
            elif isinstance(value, bool):
                out[name] = value
            else:
                raise ValueError(f"{name} takes true or false (got {value!r})")
        return out

    @staticmethod
    def why_not(mapping: dict | None) -> str | None:
        """Why ``mapping`` (a config's ``fast_paths``; None: no changes) is not a valid :meth:`changes`, or None."""
        try:
            Backends.changes(mapping if mapping is not None else {})
        except ValueError as e:
            return str(e)
        return None

    def to_dict(self) -> dict:
        """The policy as JSON takes it (tuples as lists)."""
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fused_pays(device: str, dtype: torch.dtype, positions: int) -> bool:
    """Whether the fused attention kernel is the faster choice for a segment of ``positions`` queries whose products
    are in ``dtype`` on ``device`` (a device type): on a GPU only in half precision (its fp32 products are IEEE FMA
    loops, 6-8x slower than cuBLAS on an H200) and for segments of several positions (one-token steps are the decode
    paths', not measured with it); elsewhere (Triton's interpreter, the tests) always."""
    return device != "cuda" or (dtype in (torch.float16, torch.bfloat16) and positions > 1)


_process = [Backends()]  # the process's policy (threads without a use_backends block of their own read it)
_block: ContextVar[Backends | None] = ContextVar("txl_backends", default=None)


_traced: list[Backends | None] = [None]  # the policy fixed for txl's own compiled calls (txl.kernels.compiled)


def backends() -> Backends:
    """The policy in force here: the innermost :func:`use_backends` block's, else the process's. Code that
    ``torch.compile`` traces (a graph cannot read a context variable) reads the policy that txl's compiled layer call
    fixed for it (:func:`traced_policy`), else, in a user's own ``torch.compile`` or ``torch.export``, the process's
    (:func:`set_backends`; its graphs are guarded on it: a change recompiles). A :func:`use_backends` block is not seen
    inside a user's compiled code."""
    if torch.compiler.is_compiling():
        traced = _traced[0]
        return _process[0] if traced is None else traced
    return _block.get() or _process[0]


def traced_policy(policy: Backends | None) -> Backends | None:
    """Fix the policy that compiled code reads (its graphs are guarded on it: a change recompiles; None: the
    process's); returns the one it replaces, for the caller to put back after its call (so that code compiled or
    exported later, elsewhere, does not read a policy fixed for another call)."""
    previous, _traced[0] = _traced[0], policy
    return previous


def set_backends(policy: Backends | None = None, **changes) -> Backends:
    """Set the process's policy (``policy``, else the current one with ``changes``); returns the one it replaces."""
    previous = _process[0]
    _process[0] = dataclasses.replace(policy or previous, **changes)
    return previous


@contextlib.contextmanager
def use_backends(policy: Backends | None = None, **changes) -> Iterator[Backends]:
    """The policy for this block, in this thread or task only (``policy``, else the current one with ``changes``)."""
    chosen = dataclasses.replace(policy or backends(), **changes)
    token = _block.set(chosen)
    try:
        yield chosen
    finally:
        _block.reset(token)
