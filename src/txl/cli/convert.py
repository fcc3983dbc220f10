"""``txl convert hf|original|tf``: checkpoints of other implementations into txl model folders."""

from __future__ import annotations

from pathlib import Path


def convert_hf(src: Path, out: Path, trust_pickle: bool = False, overwrite: bool = False) -> None:
    """Convert a Hugging Face TransfoXL checkpoint folder to a txl model folder (weights and tokenizer).

    Args:
        src: HF folder with config.json and model.safetensors (or pytorch_model.bin with --trust_pickle), and the
            tokenizer's vocab.txt or vocab.pkl.
        out: Output folder (config.json + model.safetensors + tokenizer.json).
        trust_pickle: Allow reading pickles: pytorch_model.bin (with torch.load(weights_only=True)) and the
            tokenizer's vocab.pkl (with a restricted unpickler that runs no code).
        overwrite: Replace an existing, non-empty output folder (kept until the new one is complete).
    """
    from txl.interop.convert import convert_hf_checkpoint
    from txl.interop.hf_vocab import PICKLE_VOCAB, TEXT_VOCAB
    from txl.util.fileio import size_of, staged_folder

    with staged_folder(out, overwrite=overwrite, sources=[src], command="txl convert", needed=size_of(src)) as staged:
        model = convert_hf_checkpoint(src, staged, trust_pickle=trust_pickle)
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} -> {out}: {type(model).__name__}, {n:,} parameters")
    if (out / "tokenizer.json").is_file():
        print(f"tokenizer: {out / 'tokenizer.json'} ({model.config.n_token:,} words, Hugging Face's ids)")
    elif (src / PICKLE_VOCAB).is_file():
        print(
            f"tokenizer not imported: {src / PICKLE_VOCAB} is a pickle; pass --trust-pickle to read it (with a "
            "restricted unpickler). Without tokenizer.json, txl eval needs text and txl generate --prompt_ids."
        )
    else:
        print(f"no tokenizer vocabulary ({TEXT_VOCAB} or {PICKLE_VOCAB}) in {src}: txl generate needs --prompt_ids")


def convert_original(
    src: Path, out: Path, corpus: Path | None = None, trust_pickle: bool = False, overwrite: bool = False
) -> None:
    """Convert a checkpoint of the original PyTorch code or of NVIDIA's port to a txl model folder.

    The weights, and the tokenizer from the vocabulary (the corpus cache's, or the one NVIDIA's checkpoint holds).

    Args:
        src: The original code's model.pt (torch.save of the whole MemTransformerLM, any PyTorch version's format),
            or NVIDIA DeepLearningExamples' checkpoint_best.pt / checkpoint_last.pt (it holds the vocabulary); or
            the folder holding one (model.pt, else checkpoint_best.pt, else checkpoint_last.pt).
        out: Output folder (config.json + model.safetensors + tokenizer.json).
        corpus: The original code's corpus cache (DATA/cache.pt, or the folder DATA), for the vocabulary of a model.pt.
        trust_pickle: Needed: both files are pickles. They are read with a restricted unpickler that rebuilds the
            tensors and keeps every object of the original code as inert data; it runs none of their code.
        overwrite: Replace an existing, non-empty output folder (kept until the new one is complete).
    """
    from txl.interop.convert_original import convert_original_checkpoint, original_checkpoint_file
    from txl.util.fileio import size_of, staged_folder

    src = original_checkpoint_file(src)  # (a folder: the checkpoint in it)
    sources = [p for p in (src, corpus) if p is not None]
    with staged_folder(out, overwrite=overwrite, sources=sources, command="txl convert", needed=size_of(src)) as staged:
        model, tokenizer = convert_original_checkpoint(src, staged, corpus=corpus, trust_pickle=trust_pickle)
    _converted(src, out, model, tokenizer, "", "the corpus cache with --corpus DATA/cache.pt")


def _converted(src: Path, out: Path, model, tokenizer, note: str, where_vocab: str | None) -> None:
    """What a conversion printed: the model, and the tokenizer or how to get one."""
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} -> {out}: {type(model).__name__}, {n:,} parameters{note}")
    if tokenizer is not None:
        print(f"tokenizer: {out / 'tokenizer.json'} ({tokenizer.vocab_size:,} {tokenizer.kind} symbols, the same ids)")
    elif where_vocab is not None:
        print(f"no vocabulary: give {where_vocab} (else txl generate needs --prompt_ids)")


def convert_tf(
    src: Path,
    out: Path,
    corpus: Path | None = None,
    trust_pickle: bool = False,
    mem_len: int | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    overwrite: bool = False,
) -> None:
    """Convert a checkpoint of the original TensorFlow code (the paper's published models) to a txl model folder.

    TensorFlow is not needed. The architecture comes from the variables' shapes; the memory settings from the options,
    else from the paper's evaluation scripts for the four published models (wt103, enwik8, text8, lm1b).

    Args:
        src: The checkpoint: its folder (e.g. pretrained_xl/tf_wt103/model), its prefix (model.ckpt-0) or its .index.
        out: Output folder (config.json + model.safetensors + tokenizer.json).
        corpus: The TF code's corpus cache with the vocabulary (default: data/cache.pkl beside the model folder).
        trust_pickle: Needed to read the vocabulary (cache.pkl is a pickle), with a restricted unpickler that runs
            none of its code. The checkpoint itself is not a pickle.
        mem_len: Memory length of the converted model (its default for eval and generation).
        clamp_len: Relative distances above this share one position embedding (-1: none).
        same_length: Every query attends to the same number of keys.
        overwrite: Replace an existing, non-empty output folder (kept until the new one is complete).
    """
    from txl.interop.convert_tf import convert_tf_checkpoint
    from txl.util.fileio import size_of, staged_folder

    sources = [p for p in (src, corpus) if p is not None]
    with staged_folder(out, overwrite=overwrite, sources=sources, command="txl convert", needed=size_of(src)) as staged:
        model, tokenizer, note = convert_tf_checkpoint(
            src, staged, corpus, trust_pickle=trust_pickle, mem_len=mem_len, clamp_len=clamp_len,
            same_length=same_length,
        )  # fmt: skip
    _converted(src, out, model, tokenizer, f"; {note}", None)  # (without a vocabulary, the note says why)
