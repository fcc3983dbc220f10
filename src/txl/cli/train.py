"""``txl train``: the run-configuration parser of :mod:`txl.config`, plus ``--resume`` and ``--print_config``."""

from __future__ import annotations

import os
import sys

from txl.config import RunConfig


def train(cfg: RunConfig, resume: str = "auto", print_config: bool = False) -> None:
    """Train a Transformer-XL language model (--config configs/NAME.yaml; under torchrun: data-parallel)."""
    if print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return
    from txl.train.trainer import train as _train

    _train(cfg, resume)


def _recorded_run_args(node, args: list[str]) -> list[str] | None:
    """`txl train` without --config, continuing a run (--resume auto with a --run_dir that has a checkpoint, or
    --resume PATH): the settings recorded in that checkpoint (its run.json) as the config, then the options given;
    with --resume PATH and no --run_dir, the run goes on in the checkpoint's own run folder. None: parse as given."""
    from txl.model.pretrained import read_json
    from txl.train.checkpoint import RUN_CONFIG, latest_checkpoint, naming_an_earlier_checkpoint, resolve_model_dir

    if node.get("config") or node["resume"] == "none":
        return None
    explicit = node["resume"] != "auto"
    folder = resolve_model_dir(node["resume"], prefer="latest") if explicit else latest_checkpoint(node["run_dir"])
    if folder is None:
        return None
    if not (folder / RUN_CONFIG).is_file():  # (probes.md n59, t28: compared with txl train's defaults instead)
        if (folder / "finetune.json").is_file():
            raise ValueError(f"{folder}: a checkpoint of txl finetune (finetune.json): continue it with txl finetune")
        raise ValueError(
            f"{folder}: no {RUN_CONFIG} (the settings of the run that wrote it); give them with --config (the run's "
            "config.yaml), or resume a checkpoint that has its run.json"
        )
    with naming_an_earlier_checkpoint(folder):
        read_json(folder / RUN_CONFIG)
    extra = []
    if explicit and not any(a == "--run_dir" or a.startswith("--run_dir=") for a in args):
        run_dir = folder.parent.parent if folder.parent.name == "checkpoints" else None
        if run_dir is None:
            raise ValueError(
                f"--resume {node['resume']}: not inside a run folder (RUN/checkpoints/step-N); say where the run "
                "goes on with --run_dir"
            )
        extra = ["--run_dir", str(run_dir)]
    if os.environ.get("RANK", "0") == "0":
        where = sys.stderr if node["print_config"] else sys.stdout  # (--print_config's output stays YAML)
        print(f"continuing from {folder} with the settings recorded in its {RUN_CONFIG} (options given override them)",
              file=where)  # fmt: skip
    return [str(folder / RUN_CONFIG), *extra]
