"""A cached step of one token through every layer (generation, serving), a named operation, ``decode_step``: the
layers' forward (``TransformerXL.layers_forward``) is the reference; the model's plain one-token step
(``TransformerXL.step``: each layer's ``step``, the attention's products and scores from its weights, then the
layer's own output and feed-forward modules) is its fast form (``fast_decode``), and decode.c runs that step as one
native call (``native_decode``: fp32 on the CPU, a C compiler), from the weight layout this module owns
(``DecodeLayer``), kept in the cache's ``kernel_state``. The model calls :func:`decode_step` with itself and its
prepared segment; this module decides, by the registry's rules (txl.kernels.registry: stock layers, checked against
the reference once per process and kind of model, measured faster), and calls the model's reference or its step.
The CUDA graph of the same step over a ring of fixed shape is txl.infer.static_decode's (``graph_decode``).
tests/test_backends_exact.py holds every backend to the reference, tests/test_changed_models.py the admission,
tests/test_registry.py the registry."""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from torch import Tensor, nn

from txl.kernels import native, registry
from txl.kernels.registry import Backend, _cpu_switch, dispatch, register

register(
    Backend(
        "fast_decode", "decode_step", "the layers' forward on one position", lambda p, dev: p.fast_decode, deep=True
    )
)
register(
    Backend(
        "native_decode",
        "decode_step",
        "the model's one-token step in Python (fast_decode)",
        _cpu_switch("native_decode"),
        lambda h, *_: None if native.usable(h) else "not fp32 on the CPU",
    )
)


def _gru_weights(gate: nn.Module | None) -> tuple | None:
    """A gate's weights as decode.c reads a GRU gate's: (W [3D, D], U [2D, D], U_g [D, D], b_g [D]); () for no gate;
    None for another kind (a class that does not itself declare the GRU formula)."""
    if gate is None:
        return ()
    if vars(type(gate)).get("formula") != "gru":
        return None
    return gate.w.weight, gate.u.weight, gate.u_g.weight, gate.b_g


class DecodeLayer(NamedTuple):
    """One layer's weights as decode.c reads them (the tensors themselves: changes in place are seen), and the
    modules whose values it reads (txl.kernels.native.layer_values). ``norm1``/``norm2``: the arguments of
    ``F.layer_norm`` after the input."""

    layer: nn.Module
    attn: nn.Module
    qkv: Tensor
    o: Tensor
    norm1: tuple
    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor
    norm2: tuple
    gru: tuple = ((), ())
    """Each gate's weights as a GRU gate's (W, U, U_g, b_g); () without a gate; None for another kind of gate (the C
    step computes the GRU gate and the residual sum)."""

    @classmethod
    def of(cls, layer: nn.Module) -> DecodeLayer:
        attn, ff = layer.attn, layer.ff

        def norm(ln: nn.LayerNorm) -> tuple:
            return ln.normalized_shape, ln.weight, ln.bias, ln.eps

        return cls(
            layer, attn, attn.qkv_net.weight, attn.o_net.weight, norm(attn.layer_norm), ff.layer_1.weight,
            ff.layer_1.bias, ff.layer_2.weight, ff.layer_2.bias, norm(ff.layer_norm),
            (_gru_weights(attn.gate), _gru_weights(ff.gate)),
        )  # fmt: skip


def _read(model: Any) -> list:
    """Every module and parameter of ``model``'s layers (and u, v), read from the modules' own dicts at each step (a
    few microseconds): one replaced since the native plan was made (``attn.qkv_net = nn.Linear(...)``, a new
    Parameter, a bias removed) makes a new plan. (A storage replaced under the same Parameter, ``.data =``, is the
    native plan's own check: txl.kernels.native.)"""
    out = [model, *model._parameters.values()]
    for layer in model._modules["layers"]._modules.values():
        attn, ff = layer._modules["attn"], layer._modules["ff"]
        am, fm = attn._modules, ff._modules
        out += (layer, attn, ff)
        for m in (am["qkv_net"], am["o_net"], am["layer_norm"], fm["layer_1"], fm["layer_2"], fm["layer_norm"]):
            out.append(m)
            out += m._parameters.values()
        for gate in (am.get("gate"), fm.get("gate")):
            if gate is not None:  # (a GRU gate's b_g, then its linear maps' weights)
                out.append(gate)
                out += gate._parameters.values()
                out += (p for sub in gate._modules.values() for p in sub._parameters.values())
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _restart(record: tuple[list, list] | None) -> None:
    """Forget what a run recorded (each verification runs both sides; each records from the start)."""
    if record is not None:
        del record[0][1:]
        record[1].clear()


def decode_step(model: Any, s: Any, record: tuple[list, list] | None, need_weights: bool) -> Tensor:
    """Every layer of ``model`` (a ``TransformerXL``) for one new position per row of its prepared segment ``s``
    (``s.h`` [B, 1, D], with a cache): [B, 1, D]. ``record`` (lists, or None) receives each layer's output and
    attention weights. The model's step (``fast_decode``; natively where the registry chooses ``native_decode``)
    for relative attention without head masks or attention weights; else, or where the registry declines, the
    layers' forward."""

    def reference() -> Tensor:
        _restart(record)
        return model.layers_forward(s, need_weights, record)

    cfg = model.config
    if cfg.attn_type != 0 or need_weights or any(m is not None for m in s.heads):
        return reference()

    def step() -> Tensor:
        _restart(record)
        return _step(model, s, record)

    kind = (type(model), cfg.pre_lnorm, cfg.identity_map)
    return dispatch("fast_decode", model.layers, step, reference, operands=(s.h,), kind=kind, where="layers")


def _step(model: Any, s: Any, record: tuple[list, list] | None) -> Tensor:
    """The model's one-token step: one native call (:func:`txl.kernels.native.decode_step`) where the registry
    chooses ``native_decode`` (checked against ``model.step`` for this kind of model in this process, and measured
    faster than it here); else ``model.step``. (The checks run both on this step: each writes the same keys and
    values.)"""
    h, cache = s.h, s.cache
    state, read = cache.kernel_state, _read(model)
    if not _same(state.get("read", ()), read):  # (another model, a module or a weight replaced: a new plan)
        state.clear()
        state.update(read=read, plan=[DecodeLayer.of(layer) for layer in model.layers])
    plan, biases = state["plan"], (model.r_w_bias, model.r_r_bias)
    values = native.layer_values(plan)  # (every value the kernel reads from the modules: a new one is checked)
    fast = lambda: native.decode_step(plan, biases, h, s.pos, s.mask, cache, state, None, values)  # noqa: E731
    kind = (values, tuple((type(lay.attn.gate), type(lay.layer.ff.gate)) for lay in plan))
    window = 1 << cache.length.bit_length()  # (the keys' count rounded up to a power of two, as the kind keeps it)
    shapes = (h.shape, cache.k.shape[:3], (window, h.shape[-1], plan[0].w1.shape[0]))
    chosen = registry.choose(
        "native_decode", None, fast, lambda: model.step(s), operands=(h,), kind=kind, shapes=shapes
    )
    if chosen:
        hids = None if record is None else []
        out = native.decode_step(plan, biases, h, s.pos, s.mask, cache, state, hids, values)
        if out is not None:
            if record is not None:
                record[0].extend([*hids, out])
            return out
    return model.step(s, record)
