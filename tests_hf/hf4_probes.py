"""Hugging Face transformers 4.46.3's TransfoXL on the round-5 probes (D1-D3, D7, D8 of
../shared/research/round5_defects.md) and round 6's greedy and beam search on every folder, for the transformers-5
suite to compare with: run by the main environment's Python, as tests_hf/hf4_reference.py. Prints JSON.

    .venv/bin/python tests_hf/hf4_probes.py ORACLE_DIR
"""

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from transformers import TransfoXLConfig  # noqa: E402
from transformers.utils import logging  # noqa: E402

from model_speed import patched_hf  # noqa: E402

logging.set_verbosity_error()
warnings.simplefilter("ignore")
oracle = Path(sys.argv[1])
torch.set_num_threads(1)


def load(name: str, **overrides):
    config = {k: v for k, v in json.loads((oracle / name / "config.json").read_text()).items() if not k.startswith("_")}
    model = patched_hf().TransfoXLLMHeadModel(TransfoXLConfig(**{**config, **overrides})).eval()
    model.load_state_dict(load_file(oracle / name / "model.safetensors"), strict=True)
    return model, load_file(oracle / name / "inputs.safetensors")


def shape(v):
    """A tuple's structure: tensors as their shapes, tuples and lists as lists."""
    if isinstance(v, torch.Tensor):
        return list(v.shape)
    if isinstance(v, tuple | list):
        return [shape(x) for x in v]
    return repr(v)


out = {}
with torch.no_grad():
    # D1: -100 labels on a model without clusters: losses in position order
    model, inp = load("char-sharp")
    ids = inp["seg0.input_ids"]
    labels = ids.clone()
    labels[0, 3:7] = -100
    labels[1, 10] = -100
    out["d1_losses"] = model(ids, labels=labels.clone()).losses.tolist()
    # D3 (and D11): the tuples of return_dict=False, with and without labels and trainer_compatible
    out["d3_tuple_labels"] = shape(model(ids, labels=ids.clone(), return_dict=False))
    out["d3_tuple"] = shape(model(ids, return_dict=False))
    out["d3_tuple_hidden"] = shape(model(ids, labels=ids.clone(), return_dict=False, output_hidden_states=True))
    tc, _ = load("char-sharp", trainer_compatible=True)
    out["d11_tuple_labels"] = shape(tc(ids, labels=ids.clone(), return_dict=False))
    loss = tc(ids, labels=ids.clone(), return_dict=False)[0]
    out["d11_loss_first"] = float(loss)
    # D2: reset_memory_length(8): three segments' scores with the shorter memory
    model.reset_memory_length(8)
    mems, scores = None, []
    for s in range(3):
        o = model(inp[f"seg{s}.input_ids"], mems=mems)
        scores.append(o.prediction_scores.tolist())
        mems = o.mems
    out["d2_mem_shapes"] = [list(m.shape) for m in mems]
    out["d2_scores"] = scores
    # D8: generate's per-step attentions and hidden states
    model, inp = load("word-adaptive-div4-sharp")
    x = inp["seg0.input_ids"][:1, :6]
    g = model.generate(
        x, max_new_tokens=3, do_sample=False, output_attentions=True, output_hidden_states=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    out["d8_attentions"] = shape(g.attentions)
    out["d8_hidden_states"] = shape(g.hidden_states)
    out["d8_first_attention"] = g.attentions[0][0].tolist()
    # D7: resize_token_embeddings (the last cluster, and the first)
    for name in ("word-adaptive-div4-sharp", "word-adaptive-sharp", "char-sharp"):
        for layer in (-1, 0):
            model, inp = load(name)
            n = model.config.vocab_size
            model.resize_token_embeddings(n + 3, layer=layer)
            emb = model.transformer.word_emb
            out[f"d7_{name}_{layer}"] = {
                "vocab_size": model.config.vocab_size,
                "cutoffs": list(model.config.cutoffs),
                "tables": [list(e.weight.shape) for e in emb.emb_layers],
                "out_layers": [list(layer.weight.shape) for layer in model.crit.out_layers],
                "scores": list(model(inp["seg0.input_ids"][:, :4]).prediction_scores.shape),
            }
# Round 6 (A): greedy (12 new tokens) and beam search (3 beams, 8) on every folder, from the first 8 tokens of the
# first two rows of its first segment
out["generation"] = {}
for folder in sorted(p.name for p in oracle.iterdir() if p.is_dir()):
    model, inp = load(folder)
    prompts = [inp["seg0.input_ids"][row, :8].tolist() for row in range(min(2, inp["seg0.input_ids"].shape[0]))]
    got = out["generation"][folder] = {"prompts": prompts, "greedy": [], "beam": []}
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            got["greedy"].append(model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist())
            got["beam"].append(
                model.generate(x, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)[0].tolist()
            )
print(json.dumps(out))
os._exit(0)
