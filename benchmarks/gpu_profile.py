"""Where a training step's time goes on the GPU, summarised from a torch.profiler trace: the top kernels by device
time, the time per kind of kernel (matrix products, attention, elementwise, reductions, gathers, copies and casts,
the optimizer), the device's idle gaps (when no kernel runs: launches, host work, syncs), the host syncs and the
launches per step. What a change to the step is decided from (issue 68: the bf16 step at 10% MFU).

    python benchmarks/gpu_profile.py --json benchmarks/results/profile_wt103_base_bf16.json      # a CUDA machine
    python benchmarks/gpu_profile.py --device cpu --configs tiny --steps 2 --warmup 1 --json /tmp/p.json  # a smoke run

The step is gpu_paper.py's (``Trainer``: forward, backward, a fused Adam step, the memory carried, one host read of
the loss), at NVIDIA's WT103 base configuration by default, in bf16, for each policy of ``--impls`` (txl: the default
fast paths; txl-fused: the fused Triton attention in training too; txl-layer-graphs: the compiled layers replayed as
CUDA graphs; txl-eager: no compiled layers). On the CPU (smoke
runs) the operators stand in for the kernels. Each summary names the device, torch and the code (commit and tree).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from _report import code_version
from gpu_paper import CONFIGS, POLICIES, ROOT, Trainer, build, sync, zipf_stream
from txl.kernels.backends import use_backends

KINDS = [  # (kind, pattern over a kernel's name, lower case): the first that matches
    ("matrix products", r"gemm|cutlass|xmma|cublas|nvjet|sm\d+_.*_tn|sm\d+_.*_nt|matmul|addmm|aten::mm|aten::bmm"),
    ("attention (Triton/flash)", r"triton_.*attn|_attn_|flash|fmha|_fwd_kernel|_bwd_kernel|rel_attention"),
    ("optimizer", r"multi_tensor|fused_adam|adam"),
    ("softmax", r"softmax"),
    ("reductions", r"reduce|sum|norm|mean|var"),
    ("gathers/scatters/index", r"gather|scatter|index|embedding|take"),
    ("copies/casts", r"copy|cast|convert|to_copy|memcpy|memset|fill"),
    ("compiled pointwise (Triton)", r"^triton_"),
    ("elementwise", r"elementwise|vectorized|unrolled|mul|add|div|exp|where|dropout|relu|threshold"),
]
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
         "aten::item", "aten::nonzero", "cudaMemcpy")  # fmt: skip
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx")


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def merged(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """Busy periods of the device (start, end, first kernel, last kernel) from kernel intervals (us), merged where
    they overlap (several streams)."""
    out: list[list] = []
    for a, b, name in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1][1], out[-1][3] = b, name
        else:
            out.append([a, b, name, name])
    return [tuple(x) for x in out]


def summarise(prof, steps: int, device: torch.device, top: int = 25) -> dict:
    """The summary of a profile of ``steps`` steps (see the module's docstring)."""
    events = list(prof.events())
    gpu = device.type == "cuda"
    if gpu:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in kernels]
        durations = [(e.name, e.time_range.elapsed_us()) for e in kernels]
    else:  # (the CPU's operators stand in: each one's own time, and the top-level ones for the timeline)
        ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(("aten::", "txl::"))]
        durations = [(e.name, e.self_cpu_time_total) for e in ops]
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in ops if e.cpu_parent is None]
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, us in durations:
        by_name[name][0] += 1
        by_name[name][1] += us
    busy_total = sum(us for _, us in durations)
    kinds: dict[str, float] = collections.Counter()
    for name, (_, us) in by_name.items():
        kinds[kind_of(name)] += us
    periods = merged(spans)
    span = (periods[-1][1] - periods[0][0]) if periods else 0.0
    busy = sum(b - a for a, b, _, _ in periods)
    gaps = [(periods[i + 1][0] - periods[i][1], periods[i][3], periods[i + 1][2]) for i in range(len(periods) - 1)]
    gaps.sort(reverse=True)
    host = collections.Counter()
    host_us: dict[str, float] = collections.Counter()
    for e in events:
        if e.device_type == DeviceType.CPU and (e.name in SYNCS or e.name in LAUNCHES):
            host[e.name] += 1
            host_us[e.name] += e.cpu_time_total
    per_step = lambda x: x / steps  # noqa: E731
    return {
        "steps": steps,
        "device_time_per_step_ms": per_step(busy_total) / 1e3,
        "wall_span_per_step_ms": per_step(span) / 1e3,
        "busy_fraction": busy / span if span else None,
        "idle_per_step_ms": per_step(span - busy) / 1e3,
        "gaps_over_10us_per_step": per_step(sum(1 for g, _, _ in gaps if g > 10)),
        "largest_gaps": [{"us": round(g, 1), "after": a[:120], "before": b[:120]} for g, a, b in gaps[:12]],
        "kinds_ms_per_step": {k: round(per_step(v) / 1e3, 4) for k, v in kinds.most_common()},
        "top_kernels": [
            {
                "name": n[:160],
                "kind": kind_of(n),
                "calls_per_step": per_step(c),
                "ms_per_step": per_step(us) / 1e3,
                "share": us / busy_total if busy_total else None,
            }
            for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        ],  # fmt: skip
        "kernels_per_step": per_step(sum(c for c, _ in by_name.values())),
        "host": {n: {"calls_per_step": per_step(host[n]), "ms_per_step": per_step(host_us[n]) / 1e3} for n in host},
    }


def markdown(label: str, s: dict) -> str:
    lines = [
        f"### {label}",
        "",
        f"Device time {s['device_time_per_step_ms']:.2f} ms per step over a span of "
        f"{s['wall_span_per_step_ms']:.2f} ms "
        f"(busy {100 * (s['busy_fraction'] or 0):.0f}%; idle {s['idle_per_step_ms']:.2f} ms in "
        f"{s['gaps_over_10us_per_step']:.0f} gaps over 10 us); {s['kernels_per_step']:.0f} kernels per step.",
        "",
        "| kind | ms per step |",
        "|---|---:|",
        *[f"| {k} | {v:.3f} |" for k, v in s["kinds_ms_per_step"].items()],
        "",
        "| kernel | kind | calls/step | ms/step | share |",
        "|---|---|---:|---:|---:|",
        *[
            f"| `{k['name'][:90]}` | {k['kind']} | {k['calls_per_step']:.0f} | {k['ms_per_step']:.3f} | "
            f"{100 * (k['share'] or 0):.1f}% |"
            for k in s["top_kernels"]
        ],  # fmt: skip
        "",
        "Host: "
        + (
            ", ".join(f"{n} {v['calls_per_step']:.0f}/step ({v['ms_per_step']:.2f} ms)" for n, v in s["host"].items())
            or "no syncs or launches recorded"
        ),  # fmt: skip
        "",
        "Largest idle gaps (us, the kernel before, the one after): "
        + "; ".join(f"{g['us']:.0f} ({g['after'][:40]} -> {g['before'][:40]})" for g in s["largest_gaps"][:6]),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", nargs="+", default=["wt103-base-nvidia"], choices=list(CONFIGS))
    ap.add_argument("--impls", nargs="+", default=["txl", "txl-fused", "txl-layer-graphs"], choices=list(POLICIES))
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--warmup", type=int, default=8, help="steps before the profiled ones (the compiler's graphs)")
    ap.add_argument("--steps", type=int, default=4, help="steps profiled")
    ap.add_argument("--json", type=Path, help="write the summaries here (and a .md beside it)")
    ap.add_argument("--trace", type=Path, help="also export each profile's Chrome trace into this folder")
    args = ap.parse_args()
    device = torch.device(args.device)
    from torch.profiler import ProfilerActivity, profile

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": name, "torch": torch.__version__, "commit": code_version(ROOT), "summaries": {}}
    print(f"device {name}, torch {out['torch']}, commit {out['commit']}", flush=True)
    md = [f"# Profiles of the training step ({name}, torch {out['torch']}, {out['commit']})", ""]
    for cfg in args.configs:
        c = CONFIGS[cfg]
        stream = zipf_stream(c["hf"]["vocab_size"], c["batch"], c["tgt"] * (args.warmup + args.steps + 2) + 1)
        base, _ = build(cfg, device, False)
        for impl in args.impls:
            label = f"{cfg} train-{args.precision} {impl}"
            t0 = time.perf_counter()
            try:
                with use_backends(POLICIES[impl]):
                    tr = Trainer("txl", base, stream.to(device), c["tgt"], c["mem"], args.precision, device)
                    for _ in range(args.warmup):
                        tr.step()
                    sync(device)
                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                    with profile(activities=activities) as prof:
                        for _ in range(args.steps):
                            tr.step()
                        sync(device)
            except Exception as e:  # (one failing policy, e.g. a Triton kernel on a new card, must not cost the rest)
                print(f"{label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                continue
            s = summarise(prof, args.steps, device)
            s["tokens_per_step"] = c["batch"] * c["tgt"]
            out["summaries"][label] = s
            md.append(markdown(label, s))
            print(md[-1], flush=True)
            print(f"{label}: profiled in {time.perf_counter() - t0:.1f} s", flush=True)
            if args.trace:
                args.trace.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.trace / f"trace-{cfg}-{impl}.json"))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(out, indent=1) + "\n")
                args.json.with_suffix(".md").write_text("\n".join(md))
            del tr


if __name__ == "__main__":
    main()
