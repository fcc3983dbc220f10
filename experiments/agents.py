"""PPO with GTrXL, TrXL-I (no gates), a GRU and an MLP (no memory) on POPGym's memory tasks and MiniGrid's Memory
task, at equal environment steps: the learning curves (mean episodic return against env steps and wall-clock) and the
tables of docs/agents.md (one section per family of tasks).

    python experiments/agents.py --steps 1000000 --seeds 1 2 --write docs/agents.md
    python experiments/agents.py --envs minigrid_memory_s7 --memories gtrxl gru mlp --steps 1000000 --seeds 1 \
        --write docs/agents.md

Each run is ``python examples/rl/ppo_gtrxl.py --env E --memory K --steps S --seed N --out runs/agents/E-K-sN`` (the
larger GRU: ``--memory gru --gru-hidden 185``), one thread each, two at a time (2 cores). ``--report-only`` redraws
from the runs already there.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _report import replace_section  # noqa: E402
from model_speed import cpu_description  # noqa: E402

TASKS = {
    "repeat_previous": "RepeatPreviousEasy",
    "position_only_cartpole": "PositionOnlyCartPoleEasy",
    "repeat_first": "RepeatFirstEasy",
}
MINIGRID_TASKS = {
    "minigrid_memory_s7": "MiniGrid-MemoryS7",
    "minigrid_memory_s9": "MiniGrid-MemoryS9",
}
# (section heading, figure, the return level whose first crossing the table gives, what the returns mean) per family;
# a run's family is its tasks'
POPGYM = (
    "## Results: PPO on POPGym memory tasks",
    "agents_curves.png",
    0.9,
    "RepeatPrevious, RepeatFirst: -0.5 is chance, 1 is perfect; PositionOnlyCartPole: 1 is balancing for the whole "
    "episode",
)
MINIGRID = (
    "## Results: PPO on MiniGrid's Memory task",
    "agents_minigrid_curves.png",
    0.55,  # (above what an agent without memory can get: about 0.48)
    "success gives 1 - 0.9 × steps / max_steps (MemoryS7: 245 steps), the wrong object 0, so a policy without memory "
    "that always reaches an object gets about half of what one that remembers the cue gets; the symbolic 7 × 7 view, "
    "one-hot, and MiniGrid's first three actions (left, right, forward)",
)
MEMORIES = {  # run name: (label, the example's arguments)
    "gtrxl": ("GTrXL", ["--memory", "gtrxl"]),
    "trxl": ("TrXL-I (no gates)", ["--memory", "trxl"]),
    "gru": ("GRU (128)", ["--memory", "gru"]),
    "gru185": ("GRU (185: GTrXL's size)", ["--memory", "gru", "--gru-hidden", "185"]),
    "mlp": ("MLP (no memory)", ["--memory", "mlp"]),
}
TITLE = "# Agents: GTrXL in txl\n"


def run_dir(out: Path, env: str, memory: str, seed: int) -> Path:
    return out / f"{env}-{memory}-s{seed}"


def launch(cmds: list[list[str]], parallel: int) -> None:
    running: list[subprocess.Popen] = []
    for cmd in cmds:
        while len(running) >= parallel:
            running[0].wait()
            running = [p for p in running if p.poll() is None]
        print(" ".join(cmd), flush=True)
        running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    for p in running:
        p.wait()


def read(d: Path) -> tuple[list[tuple[float, float, float]], dict] | None:
    if not (d / "summary.json").exists():
        return None
    with open(d / "curve.csv") as f:
        rows = [tuple(map(float, r)) for r in list(csv.reader(f))[1:]]
    return rows, json.loads((d / "summary.json").read_text())


def to_reach(curve: list[tuple[float, float, float]], level: float) -> str:
    """The env steps (in thousands) and wall-clock seconds at which the mean return first reaches ``level``, or
    "never"."""
    return next((f"{steps / 1000:.0f}k, {wall:.0f} s" for steps, wall, ret in curve if ret >= level), "never")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--envs", nargs="+", default=list(TASKS), choices=[*TASKS, *MINIGRID_TASKS])
    p.add_argument("--memories", nargs="+", default=list(MEMORIES))
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "agents")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--write", type=Path, default=None)
    a = p.parse_args()
    if len({e in MINIGRID_TASKS for e in a.envs}) > 1:
        p.error("give POPGym's tasks or MiniGrid's in one run (each family has its own section and figure)")
    if not a.report_only:
        cmds = [
            [sys.executable, str(ROOT / "examples" / "rl" / "ppo_gtrxl.py"), "--env", e, *MEMORIES[m][1], "--steps",
             str(a.steps), "--seed", str(s), "--out", str(run_dir(a.out, e, m, s))]
            for s in a.seeds for e in a.envs for m in a.memories
            if not (run_dir(a.out, e, m, s) / "summary.json").exists()
        ]  # fmt: skip
        launch(cmds, a.parallel)
    report(a)


def report(a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heading, figure_name, level, meaning = MINIGRID if a.envs[0] in MINIGRID_TASKS else POPGYM
    names = {**TASKS, **MINIGRID_TASKS}
    fig, axes = plt.subplots(2, len(a.envs), figsize=(6 * len(a.envs), 8), squeeze=False)
    lines = [
        "| task | memory | params | final mean return (per seed) | mean | "
        f"to {level}: env steps, wall-clock (per seed) | env steps | wall-clock (s, per run) |",
        "|---|---|---:|---|---:|---|---:|---:|",
    ]
    for col, env in enumerate(a.envs):
        for mem, (name, _) in MEMORIES.items():
            if mem not in a.memories:
                continue
            runs = [r for s in a.seeds if (r := read(run_dir(a.out, env, mem, s)))]
            if not runs:
                continue
            finals = [s["final_mean_return"] for _, s in runs]
            walls = [s["wall_s"] for _, s in runs]
            for i, (curve, _) in enumerate(runs):
                steps, wall, ret = zip(*curve, strict=True)
                kw = dict(color=f"C{list(MEMORIES).index(mem)}", alpha=0.8, label=name if i == 0 else None)
                axes[0][col].plot(steps, ret, **kw)
                axes[1][col].plot(wall, ret, **kw)
            lines.append(
                f"| {names[env]} | {name} | {runs[0][1]['params']:,} | {' / '.join(f'{f:.3f}' for f in finals)} | "
                f"{sum(finals) / len(finals):.3f} | {' / '.join(to_reach(c, level) for c, _ in runs)} | "
                f"{runs[0][1]['env_steps']:,} | "
                f"{' / '.join(f'{w:.0f}' for w in walls)} |"
            )
        axes[0][col].set_title(f"{names[env]}")
        axes[0][col].set_xlabel("environment steps")
        axes[1][col].set_xlabel("wall-clock seconds (1 thread, 2 runs at once on 2 cores)")
        for r in (0, 1):
            axes[r][col].set_ylabel("mean episodic return")
            axes[r][col].legend(loc="lower right")
            axes[r][col].grid(alpha=0.3)
    if len(lines) == 2:  # (no finished run: leave the figure and the page as they are)
        raise SystemExit(f"no finished runs of {' '.join(a.envs)} in {a.out}: nothing to report")
    fig.tight_layout()
    figure = ROOT / "docs" / figure_name
    fig.savefig(figure, dpi=80)
    envs = "" if a.envs == list(TASKS) else f" --envs {' '.join(a.envs)}"
    memories = "" if a.memories == list(MEMORIES) else f" --memories {' '.join(a.memories)}"
    section = "\n".join(
        [
            heading,
            "",
            f"Command: `python experiments/agents.py{envs}{memories} --steps {a.steps} --seeds "
            f"{' '.join(map(str, a.seeds))} --write docs/agents.md` (each run: `python examples/rl/ppo_gtrxl.py "
            f"--env E --memory K --steps {a.steps} --seed N`). "
            f"Machine: {cpu_description()}; one thread per run, two runs at once. Final mean return: the mean over the "
            f"last 10% of the iterations of the episodes that ended in them ({meaning}).",
            "",
            *lines,
            "",
            f"![learning curves]({figure_name})",
            "",
        ]
    )
    print(section)
    if a.write:
        replace_section(a.write, heading, section, title=TITLE)


if __name__ == "__main__":
    main()
