"""One way to load a trained model for inference (``txl generate``, ``txl serve``, ``txl lm-eval``): the folder
resolved, the weights checked and loaded, the tokenizer, and how the model reads text (the one reading rule,
:func:`txl.infer.evaluate.reading_settings`), passed to its calls, never written into its config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from txl.config import EvalConfig, RunConfig, read_run_config
from txl.data import Tokenizer
from txl.infer.evaluate import reading_settings
from txl.infer.quantize import quantize
from txl.model.modeling import Reading, TransformerXLLM
from txl.util.folders import resolve_model_dir


@dataclass
class Loaded:
    """A model ready for inference, and what goes with it."""

    model: TransformerXLLM
    """In eval mode, on the device asked for."""
    tokenizer: Tokenizer | None
    """The folder's ``tokenizer.json`` for the model's vocabulary (None: the folder has none)."""
    settings: EvalConfig
    """How the model reads text (mem_len, clamp_len, same_length, tgt_len...): given, else the run's, else the
    model's."""
    folder: Path
    """The model folder (a run folder resolved to its checkpoint)."""
    run: RunConfig | None
    """The run's recipe (``run.json`` beside the checkpoint), if there is one."""

    @property
    def reading(self) -> Reading:
        """:attr:`settings` as the model's calls take them (``reading=``)."""
        return self.settings.reading()


def load(model_dir: str | Path, device: str = "cpu", quantization: str | None = None, **given) -> Loaded:
    """Load the model of ``model_dir`` (a run folder, a ``step-N`` checkpoint or a model folder) onto ``device`` (a
    ``torch.device`` or its name, already checked by the caller), its tokenizer, and its reading settings (``given``:
    mem_len, clamp_len, same_length, tgt_len..., each None for the run's or model's); ``quantization``: its Linear
    layers quantized (:func:`txl.infer.quantize.quantize`: "int8" or "int8-weight-only"; None: as saved)."""
    folder = resolve_model_dir(model_dir)
    model = quantize(TransformerXLLM.from_pretrained(folder).to(device).eval(), quantization, device)
    settings = reading_settings(folder, model.config, **given)
    tok_file = folder / "tokenizer.json"
    tokenizer = Tokenizer.load(tok_file).for_model(model.config.n_token, tok_file) if tok_file.exists() else None
    return Loaded(model, tokenizer, settings, folder, read_run_config(folder))
