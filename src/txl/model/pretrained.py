"""Saving and loading models: ``config.json`` + ``model.safetensors``, never pickle.
Design notes: docs/internals.md#txlmodelpretrained."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Self

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from txl.util.fileio import save_safetensors, write_bytes
from txl.util.folders import (  # noqa: F401  (re-exported: their home before the redesign)
    CONFIG_NAME,
    MARKER,
    METADATA,
    CheckpointError,
    best_checkpoint,
    hub_hint,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    read_json,
    read_metadata,
    resolve_model_dir,
)

WEIGHTS_NAME = "model.safetensors"
FORMAT = "txl"
FORMAT_VERSION = 1


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for every parameter reachable under more than one name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def unique_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without tied aliases, each tensor contiguous (what we write)."""
    aliases = tied_aliases(module)
    return {k: v.detach().contiguous() for k, v in module.state_dict().items() if k not in aliases}


def load_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Load ``tensors`` (no tied aliases needed) into ``module``; one error lists every bad key.

    Refused: missing, unexpected or mis-shaped keys, integer or boolean tensors for floating-point weights
    (never cast silently), and non-finite values (NaN/inf: a diverged or corrupted checkpoint)."""
    tensors = _check_weights(module, tensors, source)
    aliases = tied_aliases(module)
    with torch.no_grad():
        params = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers())
        for k, t in tensors.items():
            target = params.get(aliases.get(k, k), buffers.get(k))
            target.copy_(t)


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """``name (count of numel)`` of every tensor with NaN/inf values. A tensor whose sum is finite has none (one
    pass, no temporary), so the element-wise check runs only on the others (NaN/inf, or a sum that overflows)."""
    return sorted(
        f"{k} ({int((~torch.isfinite(t)).sum()):,} of {t.numel():,})"
        for k, t in tensors.items()
        if t.is_floating_point()
        and not bool(torch.isfinite(t.sum()))  # (an overflowing sum falls through to the exact check)
        and not bool(torch.isfinite(t).all())
    )


def _check_weights(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str, finite: bool = True, fresh: str = ""
) -> dict[str, torch.Tensor]:
    """``tensors`` with tied aliases mapped to their canonical names; raises one error listing every problem.
    Keys under ``fresh`` (a module prefix, e.g. ``score.``) may be missing: they are initialised anew."""
    expected = {k: v for k, v in unique_state_dict(module).items() if not (fresh and k.startswith(fresh))}
    aliases = tied_aliases(module)
    for alias, canonical in aliases.items():  # a file may keep a tied tensor under its other name
        if alias in tensors and canonical not in tensors:
            tensors = {**tensors, canonical: tensors[alias]}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(aliases))
    shapes = sorted(
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(tensors) & set(expected)
        if tensors[k].shape != expected[k].shape
    )
    kinds = sorted(
        f"{k}: {tensors[k].dtype}"
        for k in set(tensors) & set(expected)
        if expected[k].is_floating_point() and not tensors[k].is_floating_point()
    )
    bad_values = _non_finite(tensors) if finite else []
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    if shapes:
        problems.append(f"mis-shaped keys: {'; '.join(shapes)}")
    if kinds:
        problems.append(f"not floating-point (weights are never cast): {'; '.join(kinds)}")
    if bad_values:
        problems.append(f"non-finite values (NaN/inf; a diverged or corrupted checkpoint): {', '.join(bad_values)}")
    if problems:
        raise CheckpointError(f"{source} cannot be loaded into the model: " + "; ".join(problems))
    return tensors


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def safetensors_index(path: Path) -> tuple[dict[str, tuple[torch.dtype, list[int], int, int]], int]:
    """``{name: (dtype, shape, begin, end)}`` of a safetensors file (byte offsets from the data start) and where
    the data starts; every entry checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > min(size - 8, 100_000_000):
                raise ValueError(f"header length {n} does not fit a file of {size:,} bytes")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    index, data = {}, 8 + n
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = SAFETENSORS_DTYPES[e["dtype"]], [int(d) for d in e["shape"]], e["data_offsets"]
            numel = int(torch.Size(shape).numel())
            if end - begin != numel * dtype.itemsize or begin < 0 or data + end > size:
                raise ValueError(f"offsets {begin}..{end} do not hold {shape} {e['dtype']} within the file")
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: bad entry {name!r} in the safetensors header ({err})") from None
        index[name] = (dtype, shape, begin, end)
    return index, data


def read_weights_into(
    module: torch.nn.Module, path: Path, rename: dict[str, str] | None = None, fresh: str = ""
) -> None:
    """Read a safetensors file straight into ``module``'s parameters (allocated, e.g. by ``to_empty``), tensor by
    tensor with ``readinto``: no memory map and no second copy of the weights in memory. Parameters of another
    dtype (a model built in bf16) are cast one tensor at a time. The same checks as :func:`load_weights`.

    ``rename`` (file key -> the module's key; a file key left out is not read) and ``fresh`` (a prefix of the
    module's keys the file need not have) load a checkpoint of another architecture (:func:`architecture_plan`)."""
    file_index, data = safetensors_index(path)
    rename = rename if rename is not None else {k: k for k in file_index}
    index = {rename[k]: entry for k, entry in file_index.items() if k in rename}
    specs = {k: torch.empty(shape, dtype=dt, device="meta") for k, (dt, shape, _, _) in index.items()}
    aliases = tied_aliases(module)
    canonical = {aliases.get(k, k): k for k in _check_weights(module, specs, str(path), finite=False, fresh=fresh)}
    params = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
    read = {}
    with torch.no_grad(), open(path, "rb") as f:
        for name, key in sorted(canonical.items(), key=lambda kv: index[kv[1]][2]):
            dtype, shape, begin, end = index[key]
            target = params[name]
            direct = target.dtype == dtype and target.is_contiguous()
            buf = target if direct else torch.empty(shape, dtype=dtype)
            f.seek(data + begin)
            if end > begin and f.readinto(buf.view(-1).view(torch.uint8).numpy()) != end - begin:
                raise CheckpointError(f"{path}: {key} is cut short (a truncated file)")
            if not direct:
                target.copy_(buf)
            read[key] = target
    _check_weights(module, read, str(path), fresh=fresh)  # now the values: NaN/inf


def _one(shapes: dict[str, list[int]], suffix: str) -> list[int] | None:
    """The shape of the first tensor whose name ends with ``suffix`` (after a dot, or the whole name)."""
    return next((v for k, v in sorted(shapes.items()) if k == suffix or k.endswith("." + suffix)), None)


def check_config_fits_weights(config: Any, shapes: dict[str, list[int]], config_path: str, weights: str) -> None:
    """Before a model is built from ``config``: the fields that size it (n_layer, d_model, d_inner, n_token, n_head x
    d_head) against the weights file's header (``shapes``: name -> shape, nothing read or allocated). A config.json
    that asks for 1,000,000 layers over the weights of 2 would otherwise be built first (minutes, gigabytes) and
    only then found wrong (probes rl29, hl1-hl5). One error naming the field and what the weights hold."""
    found: dict[str, int] = {}
    layers = {int(m.group(1)) for k in shapes if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))}
    if layers:
        found["n_layer"] = max(layers) + 1
    if (ff := _one(shapes, "layers.0.ff.layer_1.weight")) is not None and len(ff) == 2:
        found["d_inner"], found["d_model"] = ff
    if (qkv := _one(shapes, "layers.0.attn.qkv_net.weight")) is not None and len(qkv) == 2 and qkv[0] % 3 == 0:
        found["n_head x d_head"] = qkv[0] // 3
    tables = [v for k, v in shapes.items() if re.search(r"(?:^|\.)word_emb\.emb_layers\.\d+\.weight$", k)]
    if tables and all(len(v) == 2 for v in tables):
        found["n_token"] = sum(v[0] for v in tables)
    wanted = {k: getattr(config, k, None) for k in ("n_layer", "d_inner", "d_model", "n_token")}
    if getattr(config, "n_head", None) is not None and getattr(config, "d_head", None) is not None:
        wanted["n_head x d_head"] = config.n_head * config.d_head
    for name, held in found.items():
        want = wanted.get(name)
        if isinstance(want, int) and not isinstance(want, bool) and want != held:
            unit = "layers" if name == "n_layer" else "in its tensors"
            raise CheckpointError(
                f"{config_path}: {name} = {want:,}, but {weights} holds {held:,} {unit}; the config does not "
                f"describe these weights (set {name} to {held:,}, or use the config.json saved with them)"
            )


def check_fits_memory(model: torch.nn.Module, source: str, dtype: torch.dtype | None = None) -> None:
    """Before a model built on the meta device is allocated: its parameters' bytes against the memory free now."""
    from txl.kernels.runtime import check_fits

    need = sum(p.numel() * (dtype or p.dtype).itemsize for p in unique_state_dict(model).values())
    check_fits(need, f"{source}: the model's weights", "it cannot be loaded on this machine")


HEADS = {"crit": "the language-model head", "score": "the classification head"}


def architecture_plan(model: torch.nn.Module, file_keys: list[str], saved: str | None, source: str):
    """How a checkpoint saved by another model class loads into ``model``, as Hugging Face's ``from_pretrained``
    does: ``(rename, fresh)`` for :func:`read_weights_into`, or ``(None, "")`` when the classes are the same.

    The body (the base model, ``transformer.*`` inside a model with a head) always carries over; the saved head is
    left out; the model's own head must be in the file, unless the class may initialise it anew (``new_head``:
    the classification head, from a language model or the base model)."""
    here = type(model).__name__
    if saved is None or saved == here:
        return None, ""
    theirs = "transformer." if any(k.startswith("transformer.") for k in file_keys) else ""
    mine = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    rename = {k: mine + k[len(theirs) :] for k in file_keys if k.startswith(theirs)}
    heads = sorted({k.split(".")[0] for k in unique_state_dict(model) if mine and not k.startswith(mine)})
    fresh = getattr(model, "new_head", None)
    needed = [h for h in heads if h != fresh]
    if needed:
        what = " and ".join(f"{HEADS.get(h, h)} ({h}.*)" for h in needed)
        hint = f"; load it as {saved}"
        if any(k.startswith("score.") for k in file_keys):  # a fine-tuned classifier where a language model was meant
            hint += " (txl predict classifies with it); generation and scoring need the language model it started from"
        raise CheckpointError(f"{source}: a {saved} checkpoint, without {what} that {here} needs{hint}")
    return rename, (f"{fresh}." if fresh in heads else "")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def write_config(config: Any, directory: str | os.PathLike, architecture: str | None = None) -> Path:
    """Write ``directory/config.json``: the txl format header, the model class (if given) and the config's fields."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION}
    if architecture is not None:
        data["architecture"] = architecture
    data.update(config.to_dict())
    write_bytes(out / CONFIG_NAME, (json.dumps(data, indent=2) + "\n").encode())
    return out / CONFIG_NAME


def model_folder(directory: str | os.PathLike) -> Path:
    """The folder holding config.json: ``directory`` itself, or a run's or checkpoint's model (a clear error if
    neither)."""
    if (Path(directory) / CONFIG_NAME).is_file():
        return Path(directory)
    return resolve_model_dir(directory)  # (a run folder, or a clear error naming what it expected)


def read_config(config_class: type, directory: str | os.PathLike):
    """The config in ``directory/config.json`` (written by :func:`write_config`), as ``config_class``."""
    path = Path(directory) / CONFIG_NAME
    data = read_json(path)
    if data.pop("format", None) != FORMAT:
        raise CheckpointError(
            f'{path}: not a txl checkpoint config (no "format": "txl"); '
            "to import a Hugging Face TransfoXL checkpoint run `txl convert hf SRC OUT`"
        )
    version = data.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {version} is not supported (expected {FORMAT_VERSION})")
    data.pop("architecture", None)
    shape = ("n_token", "d_model", "n_layer", "n_head", "d_head", "d_inner")
    fields = getattr(config_class, "__dataclass_fields__", {})
    missing = [k for k in shape if k in fields and k not in data]
    if missing:  # (probes.md c06: defaults filled in, then ~20 mis-shaped tensors listed)
        raise CheckpointError(
            f"{path}: no {', '.join(missing)} (a model's config.json gives its shape; save_pretrained writes every "
            "field)"
        )
    try:
        return config_class.from_dict(data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


class PretrainedMixin:
    """``save_pretrained`` / ``from_pretrained`` for the model classes (``config_class`` + ``config``)."""

    config_class: type

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (tied tensors once) into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = unique_state_dict(self)
        save_safetensors(tensors, out / WEIGHTS_NAME, {"format": "pt", "txl_format_version": str(FORMAT_VERSION)})
        write_config(self.config, out, type(self).__name__)
        return out

    @classmethod
    def load_config(cls, directory: str | os.PathLike):
        return read_config(cls.config_class, directory)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        mmap: bool = False,
        **config_overrides: Any,
    ) -> Self:
        """Build the model from ``directory/config.json`` and load ``model.safetensors`` (strict).

        ``directory`` is a model folder, a checkpoint ``step-N`` folder or a run folder (its best checkpoint, as
        ``txl eval`` and ``txl generate`` take it).

        The model is built on the meta device (no initialisation) and the file is read straight into its
        parameters: the weights are in memory once. ``dtype`` (e.g. ``torch.bfloat16``) builds the model in that
        dtype and casts the weights as they are read (half the memory; not exact). ``config_overrides`` replace
        config fields (e.g. ``dropout=0.0``) before the model is built.

        ``mmap=True`` (opt-in, not exact): the parameters are the file's memory-mapped tensors, read from disk when
        first used, as Hugging Face loads: returns at once, but the tensors are not 64-byte aligned, so matrix
        products may take another path and differ in the last bits from the saved model's; the NaN/inf check is
        skipped (it would read every weight).
        """
        directory = model_folder(directory)
        config = cls.load_config(directory)
        if config_overrides:
            config = cls.config_class.from_dict({**config.to_dict(), **config_overrides})
        path = Path(directory) / WEIGHTS_NAME
        index = safetensors_index(path)[0]
        check_config_fits_weights(config, {k: e[1] for k, e in index.items()}, str(directory / CONFIG_NAME), str(path))
        with torch.device("meta"):
            model = cls(config, init=False)
        saved = read_json(Path(directory) / CONFIG_NAME).get("architecture")
        rename, fresh = architecture_plan(model, list(index), saved, str(directory))
        specs = {(k if rename is None else rename[k]): torch.empty(e[1], dtype=e[0], device="meta")
                 for k, e in index.items() if rename is None or k in rename}  # fmt: skip
        _check_weights(model, specs, str(path), finite=False, fresh=fresh)  # (every shape, before any allocation)
        if not mmap:
            check_fits_memory(model, str(directory), dtype)
        if mmap:
            tensors = read_safetensors(path)
            if rename is not None:
                tensors = {rename[k]: t for k, t in tensors.items() if k in rename}
            if dtype is not None:
                tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
            tensors = _check_weights(model, tensors, str(path), finite=False, fresh=fresh)
            aliases = tied_aliases(model)
            state = {k: tensors[aliases.get(k, k)] for k in model.state_dict() if not (fresh and k.startswith(fresh))}
            model.load_state_dict(state, assign=True, strict=not fresh)
            if fresh:
                model.get_submodule(fresh[:-1]).to_empty(device="cpu").to(dtype or torch.get_default_dtype())
            if hasattr(model, "tie_weights"):
                model.tie_weights()
        else:
            if dtype is not None:
                model = model.to(dtype)
            model = model.to_empty(device="cpu")
            if hasattr(model, "tie_weights"):
                model.tie_weights()  # to_empty gives every name its own tensor: the ties must be restored
            read_weights_into(model, path, rename, fresh)
        if fresh:  # (as Hugging Face: a head the checkpoint does not have starts from the model's initialisation)
            model.init_weights(model.get_submodule(fresh[:-1]).modules())
            head = HEADS.get(fresh[:-1], "the head")
            warnings.warn(
                f"{directory}: a {saved} checkpoint: {head} of {type(model).__name__} ({fresh}*) is newly "
                "initialised; train it (e.g. txl finetune) before use",
                stacklevel=2,
            )
        return model.eval()
