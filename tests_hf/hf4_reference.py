"""Hugging Face transformers 4.46.3's TransfoXL on a model folder, for the transformers-5 suite to compare with: run
by the main environment's Python (which has 4.46.3; its one broken expression, #29650, patched in memory as
benchmarks/model_speed.py does). Prints JSON: the tokenizer's ids of each text, and the tokens of greedy search, beam
search, sampling, and the greedy tokens pipeline("text-generation") would give.

    .venv/bin/python tests_hf/hf4_reference.py FOLDER VOCAB_TXT '["prompt", ...]'
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from transformers import TextGenerationPipeline, TransfoXLConfig, TransfoXLTokenizer  # noqa: E402
from transformers.utils import logging  # noqa: E402

from model_speed import patched_hf  # noqa: E402

logging.set_verbosity_error()
folder, vocab, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(1)
config = {k: v for k, v in json.loads(Path(folder, "config.json").read_text()).items() if not k.startswith("_")}
model = patched_hf().TransfoXLLMHeadModel(TransfoXLConfig(**config)).eval()
model.load_state_dict(load_file(Path(folder, "model.safetensors")), strict=True)
tok = TransfoXLTokenizer(vocab_file=vocab)
out = {"ids": [tok.encode(p, add_special_tokens=False) for p in prompts], "greedy": [], "beam": [], "sample": []}
with torch.no_grad():
    for ids in out["ids"]:
        x = torch.tensor([ids])
        out["greedy"].append(model.generate(x, max_new_tokens=12, do_sample=False)[0].tolist())
        out["beam"].append(model.generate(x, max_new_tokens=8, num_beams=3, do_sample=False)[0].tolist())
        torch.manual_seed(7)
        out["sample"].append(model.generate(x, max_new_tokens=8, do_sample=True, top_k=20)[0].tolist())
    # pipeline("text-generation") of 4.46.3 fails for TransfoXL (it concatenates an attention mask that is None), so
    # what it would compute: greedy search over the ids of its XL_PREFIX + the prompt (its text is tokenised whole)
    prefix = TextGenerationPipeline.XL_PREFIX
    out["pipeline"] = []
    for p in prompts:
        x = torch.tensor([tok.encode(prefix + p, add_special_tokens=False)])
        out["pipeline"].append(model.generate(x, max_new_tokens=10, do_sample=False)[0].tolist())
print(json.dumps(out))
os._exit(0)
