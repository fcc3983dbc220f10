"""Several devices: ``keras.distribution`` (JAX backend). Data parallelism needs nothing of the model
(``keras.distribution.DataParallel``); :func:`layout_map` gives a model-parallel layout (``ModelParallel``): the heads
of every attention and the inner width of every feed-forward layer split over the mesh's ``model`` axis, as
Megatron splits them; embeddings and the softmax by their rows (the vocabulary)."""

from __future__ import annotations

import keras

from txl.model.config import TransformerXLConfig


def layout_map(mesh: keras.distribution.DeviceMesh, model_axis: str = "model") -> keras.distribution.LayoutMap:
    """The layout of a Transformer-XL's weights over ``mesh`` (kernels are PyTorch's [out, in]): the q/k/v and W_kR
    projections by their outputs (the heads), W_o by its inputs, the feed-forward's first layer by its outputs and
    the second by its inputs, the embedding and output tables by their rows; everything else replicated."""
    m = model_axis
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*attn.*qkv_net"] = (m, None)
    layouts[".*attn.*r_net"] = (m, None)
    layouts[".*attn.*o_net"] = (None, m)
    layouts[".*ff.*layer_1_weight"] = (m, None)
    layouts[".*ff.*layer_1_bias"] = (m,)
    layouts[".*ff.*layer_2_weight"] = (None, m)
    layouts[".*emb_layers_0"] = (m, None)
    return layouts


def _shapes(cfg: TransformerXLConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """The weights a layout may split: path -> (shape, the config field behind each dimension)."""
    ends = [0, *cfg.cutoffs, cfg.n_token]
    sizes = [cfg.n_token] if cfg.div_val == 1 else [b - a for a, b in zip(ends, ends[1:], strict=False)]
    dims = [cfg.d_embed // (cfg.div_val**i) for i in range(len(sizes))]
    rows = ["n_token"] if cfg.div_val == 1 else [f"cluster {i}'s size (cutoffs)" for i in range(len(sizes))]
    hd, D = cfg.n_head * cfg.d_head, cfg.d_model
    out = {}
    for i, (n, d, field) in enumerate(zip(sizes, dims, rows, strict=True)):
        out[f"word_emb/emb_layers_{i}"] = ((n, d), (field, "d_embed"))
        out[f"crit/out_layers_{i}_weight"] = ((n, d), (field, "d_embed"))
        out[f"crit/out_layers_{i}_bias"] = ((n,), (field,))
    for i in range(cfg.n_layer):
        out[f"layers_{i}_attn/qkv_net"] = ((3 * hd, D), ("3 x n_head x d_head", "d_model"))
        out[f"layers_{i}_attn/r_net"] = ((hd, D), ("n_head x d_head", "d_model"))
        out[f"layers_{i}_attn/o_net"] = ((D, hd), ("d_model", "n_head x d_head"))
        out[f"layers_{i}_ff/layer_1_weight"] = ((cfg.d_inner, D), ("d_inner", "d_model"))
        out[f"layers_{i}_ff/layer_1_bias"] = ((cfg.d_inner,), ("d_inner",))
        out[f"layers_{i}_ff/layer_2_weight"] = ((D, cfg.d_inner), ("d_model", "d_inner"))
    return out


def check_layout(config: TransformerXLConfig) -> None:
    """Under ``keras.distribution.ModelParallel``: refuse, in one line naming the field, a configuration whose
    weights the layout splits over a mesh axis that does not divide them (the vocabulary or a cluster's size, the
    heads' width, d_inner), before any weight is made (JAX would fail deep inside the first one)."""
    dist = keras.distribution.distribution()
    if not isinstance(dist, keras.distribution.ModelParallel):
        return
    for path, (shape, fields) in _shapes(config).items():
        layout = dist.get_tensor_layout(path)
        if layout is None:
            continue
        mesh = layout.device_mesh or dist.device_mesh
        devices = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        for n, field, axis in zip(shape, fields, layout.axes, strict=False):
            if axis is not None and n % devices[axis]:
                raise ValueError(
                    f"ModelParallel: the layout splits {path} over the mesh's {axis!r} axis of {devices[axis]} "
                    f"devices, and {field} = {n} is not divisible by {devices[axis]}: choose a size divisible by it "
                    "(pad the vocabulary), or a mesh with fewer devices on that axis"
                )
