"""Inference: evaluation (``evaluate``), generation and beam search (``generation``, ``static_decode``), RECL
(``recl``) and attention maps (``attention_maps``). Imports the run configuration, data, model and below."""
