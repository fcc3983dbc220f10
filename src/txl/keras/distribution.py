"""Several devices: ``keras.distribution`` (JAX backend). Data parallelism needs nothing of the model
(``keras.distribution.DataParallel``); :func:`layout_map` gives a model-parallel layout (``ModelParallel``): the heads
of every attention and the inner width of every feed-forward layer split over the mesh's ``model`` axis, as
Megatron splits them; embeddings and the softmax by their rows (the vocabulary)."""

from __future__ import annotations

import keras


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
