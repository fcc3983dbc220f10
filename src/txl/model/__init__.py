"""The model: the paper's Transformer-XL read top to bottom (``txl.model.modeling``), and model folders
(safetensors + config.json, ``txl.model.pretrained``). Imports ``txl.kernels`` and ``txl.util`` only."""
