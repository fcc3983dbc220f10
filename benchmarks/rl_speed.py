"""Agents' speed (txl.rl): the acting step's latency and the environment steps/s of a whole PPO iteration (rollout of
128 steps in every environment, then 4 epochs of 4 minibatches of 32-step windows), for N = 16 / 64 / 256
environments and memory 64 / 256, GTrXL beside the GRU baseline of the same example, in one run.

    python benchmarks/rl_speed.py --write docs/agents.md

The model is the example's (examples/rl/ppo_gtrxl.py): GTrXL d_model 64, 2 layers, 4 heads; GRU 128 hidden units;
on POPGym's RepeatPreviousEasy (an environment step costs ~8 us). Medians of ``--repeats`` step timings after a
warm-up; one PPO iteration per configuration, after a warm-up iteration.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "rl"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ppo_gtrxl import Agent, Args, train  # noqa: E402

from _report import replace_section  # noqa: E402
from model_speed import cpu_description  # noqa: E402

AGENTS_TITLE = "# Agents: GTrXL in txl\n"


def step_latency(memory_kind: str, n_envs: int, mem_len: int, repeats: int) -> float:
    """Median seconds of one acting step of every environment (features of N observations, memory updated)."""
    args = Args(memory=memory_kind, num_envs=n_envs, mem_len=mem_len)
    agent = Agent(args, 4, 4).eval()  # (as the example acts: no mode switch per step)
    memory = agent.memory.initial(n_envs)
    x = torch.nn.functional.one_hot(torch.randint(0, 4, (n_envs,)), 4).float()
    reset = torch.zeros(n_envs, dtype=torch.bool)
    times = []
    for i in range(mem_len + 2 * repeats):  # (the memory full first: the step attends mem_len + 1 keys)
        t = time.perf_counter()
        agent.memory.step(x, reset, memory)
        if i >= mem_len + repeats:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def ppo_iteration(memory_kind: str, n_envs: int, mem_len: int) -> dict:
    """The second of two PPO iterations (the first warms up): its rollout and update seconds."""
    args = Args(env="repeat_previous", memory=memory_kind, num_envs=n_envs, mem_len=mem_len, threads=2)
    args.steps = 2 * n_envs * args.rollout
    act, update = train(args)["iterations_s"][-1]
    return {"act_s": act, "update_s": update, "wall_s": act + update, "env_steps": n_envs * args.rollout}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--mems", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--write", type=Path, default=None, help="the results page to update (docs/agents.md)")
    a = p.parse_args()
    torch.set_num_threads(2)
    rows = []
    for n in a.envs:
        for kind, mems in (("gtrxl", a.mems), ("gru", [0])):
            for m in mems:
                lat = step_latency(kind, n, max(m, 1), a.repeats)
                torch.set_num_threads(2)
                it = ppo_iteration(kind, n, max(m, 1))
                row = (n, kind, m, lat * 1e3, n / lat, it["env_steps"] / it["wall_s"], it["act_s"], it["update_s"])
                rows.append(row)
                print(" | ".join(str(round(v, 2)) if isinstance(v, float) else str(v) for v in row), flush=True)
    lines = [
        "## Speed: acting and a PPO iteration",
        "",
        f"Command: `python benchmarks/rl_speed.py --write docs/agents.md`. Machine: {cpu_description()}, 2 threads. "
        f"torch {torch.__version__}. Step: median of {a.repeats} acting steps of every environment with a full memory "
        "(the model alone). PPO iteration: 128 steps in every environment (POPGym RepeatPreviousEasy) and 4 epochs x 4 "
        "minibatches over 32-step windows, one iteration after a warm-up one; env steps/s counts the whole iteration.",
        "",
        "| envs N | memory | mem_len | step (ms) | step / GRU's | steps/s acting (model) | PPO iteration env steps/s | "
        "PPO / GRU's | rollout s | update s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gru = {n: (lat, ips) for n, kind, _, lat, _, ips, _, _ in rows if kind == "gru"}
    for n, kind, m, lat, sps, ips, act, upd in rows:
        name = "GTrXL" if kind == "gtrxl" else "GRU (128)"
        lines.append(
            f"| {n} | {name} | {m or '-'} | {lat:.2f} | {lat / gru[n][0]:.1f}x | {sps:,.0f} | {ips:,.0f} | "
            f"{ips / gru[n][1]:.2f}x | {act:.1f} | {upd:.1f} |"
        )
    section = "\n".join(lines) + "\n"
    print(section)
    if a.write:
        replace_section(a.write, "## Speed: acting and a PPO iteration", section, title=AGENTS_TITLE)


if __name__ == "__main__":
    main()
