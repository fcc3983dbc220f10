"""Other formats: Hugging Face, original PyTorch, TensorFlow and NVIDIA checkpoints (``convert``,
``convert_original``, ``convert_tf``, ``tf_checkpoint``), vocabulary pickles (``hf_vocab``), ONNX (``export``),
lm-evaluation-harness (``lm_harness``). Imports inference and below; not train or serve."""
