"""Agents' speed (txl.rl): the acting step's latency and the environment steps/s of a whole PPO iteration (rollout of
128 steps in every environment, then 4 epochs of 4 minibatches of 32-step windows), GTrXL beside the GRU baseline of
the same example, in one run: on the CPU for N = 16 / 64 / 256 environments and memory 64 / 256; on a GPU
(``--device cuda``) for N = 256 / 1,024 / 4,096 and memory 64, GTrXL acting as one replayed CUDA graph (txl.rl's
RingMemory, the default there) and kernel by kernel (the K/V cache's step), beside cuDNN's GRU.

    python benchmarks/rl_speed.py --write docs/agents.md
    python benchmarks/rl_speed.py --device cuda --json benchmarks/results/rl_gpu.json --write docs/agents.md

The model is the example's (examples/rl/ppo_gtrxl.py): GTrXL d_model 64, 2 layers, 4 heads; GRU 128 hidden units;
on POPGym's RepeatPreviousEasy (an environment step costs ~8 us on the CPU, where the environments always run).
Medians of ``--repeats`` step timings after a warm-up; one PPO iteration per configuration, after a warm-up
iteration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "rl"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ppo_gtrxl import Agent, Args, train  # noqa: E402

from _report import code_version, replace_section  # noqa: E402
from model_speed import cpu_description  # noqa: E402

AGENTS_TITLE = "# Agents: GTrXL in txl\n"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_latency(memory_kind: str, n_envs: int, mem_len: int, repeats: int, device: torch.device,
                 graph: bool | None = None) -> float:  # fmt: skip
    """Median seconds of one acting step of every environment (features of N observations, memory updated);
    ``graph``: GTrXL's memory a ring replayed as a CUDA graph (True), the K/V cache's (False), the default (None)."""
    args = Args(memory=memory_kind, num_envs=n_envs, mem_len=mem_len, device=str(device))
    agent = Agent(args, 4, 4).to(device).eval()  # (as the example acts: no mode switch per step)
    if memory_kind == "gtrxl":
        memory = agent.memory.net.initial_memory(n_envs, graph=graph)
    else:
        memory = agent.memory.initial(n_envs)
    x = torch.nn.functional.one_hot(torch.randint(0, 4, (n_envs,)), 4).float().to(device)
    reset = torch.zeros(n_envs, dtype=torch.bool, device=device)
    times = []
    for i in range(mem_len + 2 * repeats):  # (the memory full first: the step attends mem_len + 1 keys)
        sync(device)
        t = time.perf_counter()
        agent.memory.step(x, reset, memory)
        sync(device)
        if i >= mem_len + repeats:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def ppo_iteration(memory_kind: str, n_envs: int, mem_len: int, device: torch.device) -> dict:
    """The second of two PPO iterations (the first warms up): its rollout and update seconds."""
    args = Args(env="repeat_previous", memory=memory_kind, num_envs=n_envs, mem_len=mem_len, threads=2,
                device=str(device))  # fmt: skip
    args.steps = 2 * n_envs * args.rollout
    act, update = train(args)["iterations_s"][-1]
    return {"act_s": act, "update_s": update, "wall_s": act + update, "env_steps": n_envs * args.rollout}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--envs", type=int, nargs="+", help="default: 16 64 256 (CPU), 256 1024 4096 (GPU)")
    p.add_argument("--mems", type=int, nargs="+", help="default: 64 256 (CPU), 64 (GPU)")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--no_ppo", action="store_true", help="the acting steps only")
    p.add_argument("--gpu_rows", action="store_true", help="the GPU's rows on this device (a smoke run on the CPU)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here (with the device, torch and commit)")
    p.add_argument("--write", type=Path, default=None, help="the results page to update (docs/agents.md)")
    a = p.parse_args()
    device = torch.device(a.device)
    gpu = device.type == "cuda" or a.gpu_rows
    envs = a.envs or ([256, 1024, 4096] if gpu else [16, 64, 256])
    mems = a.mems or ([64] if gpu else [64, 256])
    torch.set_num_threads(2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    commit = code_version(ROOT)
    print(f"device {name}, torch {torch.__version__}, commit {commit}", flush=True)
    # (memory kind, mem_len, graph, label): on a GPU GTrXL as a graph and kernel by kernel; the GRU cuDNN's
    kinds = [("gtrxl", m, True, "GTrXL (graph)") for m in mems] if gpu else [("gtrxl", m, None, "GTrXL") for m in mems]
    kinds += [("gtrxl", m, False, "GTrXL (kernel by kernel)") for m in mems] if gpu else []
    kinds += [("gru", 0, None, "GRU (128)")]
    rows = []
    for n in envs:
        for kind, m, graph, label in kinds:
            lat = step_latency(kind, n, max(m, 1), a.repeats, device, graph)
            torch.set_num_threads(2)
            it = None if a.no_ppo or graph is False else ppo_iteration(kind, n, max(m, 1), device)
            row = dict(envs=n, memory=label, mem_len=m, step_ms=lat * 1e3, acting_steps_per_s=n / lat,
                       ppo_env_steps_per_s=it and it["env_steps"] / it["wall_s"], rollout_s=it and it["act_s"],
                       update_s=it and it["update_s"], device=name, torch=torch.__version__, commit=commit)  # fmt: skip
            rows.append(row)
            print(" | ".join(f"{k} {round(v, 3) if isinstance(v, float) else v}" for k, v in row.items()
                             if k not in ("device", "torch", "commit")), flush=True)  # fmt: skip
            if a.json:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(rows, indent=1) + "\n")
    heading = "## Speed on a GPU: acting and a PPO iteration" if gpu else "## Speed: acting and a PPO iteration"
    command = "python benchmarks/rl_speed.py" + (" --device cuda --json benchmarks/results/rl_gpu.json" if gpu else "")
    lines = [
        heading,
        "",
        f"Command: `{command} --write docs/agents.md`. Machine: {name}{'' if gpu else ', 2 threads'}. "
        f"torch {torch.__version__}, commit {commit}. Step: median of {a.repeats} acting steps of every environment "
        "with a full memory (the model alone). PPO iteration: 128 steps in every environment (POPGym "
        "RepeatPreviousEasy, on the CPU) and 4 epochs x 4 minibatches over 32-step windows, one iteration after a "
        "warm-up one; env steps/s counts the whole iteration."
        + (
            " GTrXL (graph): txl.rl's RingMemory, the step replayed as one CUDA graph (the default on CUDA); kernel "
            "by kernel: the K/V cache's step (`initial_memory(graph=False)`)."
            if gpu
            else ""
        ),
        "",
        "| envs N | memory | mem_len | step (ms) | step / GRU's | steps/s acting (model) | PPO iteration env steps/s | "
        "PPO / GRU's | rollout s | update s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gru = {r["envs"]: r for r in rows if r["memory"].startswith("GRU")}
    for r in rows:
        g = gru[r["envs"]]
        ppo = r["ppo_env_steps_per_s"]
        ratio = f"{ppo / g['ppo_env_steps_per_s']:.2f}x" if ppo and g["ppo_env_steps_per_s"] else "-"
        ppo_cells = f"{ppo:,.0f} | {ratio} | {r['rollout_s']:.1f} | {r['update_s']:.1f}" if ppo else "- | - | - | -"
        lines.append(
            f"| {r['envs']} | {r['memory']} | {r['mem_len'] or '-'} | {r['step_ms']:.2f} | "
            f"{r['step_ms'] / g['step_ms']:.1f}x | {r['acting_steps_per_s']:,.0f} | {ppo_cells} |"
        )
    section = "\n".join(lines) + "\n"
    print(section)
    if a.write:
        replace_section(a.write, heading, section, title=AGENTS_TITLE)


if __name__ == "__main__":
    main()
