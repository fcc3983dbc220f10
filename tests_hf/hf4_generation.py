"""Hugging Face transformers 4.46.3's TransfoXL generation on each of the 12 reference folders, for the
transformers-5 suite to compare with (round 6: a newer transformers 5 changed txl.hf's generation on 5 of them): run
by the main environment's Python, as tests_hf/hf4_reference.py. For each folder, two prompts (the first 8 tokens of
the first two rows of its inputs' first segment): greedy search (12 new tokens) and beam search (3 beams, 8 new
tokens). Prints JSON {folder: {"prompts", "greedy", "beam"}}.

    .venv/bin/python tests_hf/hf4_generation.py ORACLE_DIR
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
out = {}
for folder in sorted(p for p in oracle.iterdir() if p.is_dir()):
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if not k.startswith("_")}
    model = patched_hf().TransfoXLLMHeadModel(TransfoXLConfig(**config)).eval()
    model.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    ids = load_file(folder / "inputs.safetensors")["seg0.input_ids"]
    prompts = [ids[row, :8].tolist() for row in range(min(2, ids.shape[0]))]
    got = {"prompts": prompts, "greedy": [], "beam": []}
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            got["greedy"].append(model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist())
            got["beam"].append(
                model.generate(x, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)[0].tolist()
            )
    out[folder.name] = got
print(json.dumps(out))
os._exit(0)
