"""An agent's acting step in two checkouts side by side (before/after a change): for N = 16 / 64 / 256
environments and memory 64 / 256, the median time of the native attention of one query per head (the step's
attention: 4 heads of 16, keys and values in the cache's buffer) and of the whole acting step of
examples/rl/ppo_gtrxl.py's GTrXL (the memory full), 2 threads. Run it alternately for each tree and compare medians:

    git worktree add /tmp/old BASE
    for r in $(seq 6); do python benchmarks/ab_agent_step.py /tmp/old/src old
                          python benchmarks/ab_agent_step.py src new; done
"""

import sys
from pathlib import Path

import torch

src = str(Path(sys.argv[1]).resolve())
sys.path.insert(0, src)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "rl"))
from ppo_gtrxl import Agent, Args  # noqa: E402

import txl  # noqa: E402
from _report import median_time  # noqa: E402
from txl.kernels import native  # noqa: E402

assert txl.__file__.startswith(src), f"txl from {txl.__file__}, not {src}"
torch.set_num_threads(2)


def median_ms(f, n: int) -> float:
    for _ in range(9):  # (and median_time's own warm-up call)
        f()
    return 1e3 * median_time(f, n)


def configuration(N: int, M: int) -> str:
    """The attention's and the whole step's medians for N environments and memory M."""
    torch.manual_seed(0)
    H, Dh, K = 4, 16, M + 1
    kc, vc = torch.randn(2, N, H, 2 * K, Dh).unbind(0)  # (a KVCache's buffer: 2 (M + 1) positions)
    k, v = kc[:, :, :K], vc[:, :, :K]
    q = torch.randn(N, 1, H, Dh).transpose(1, 2)
    r, u, vb = torch.randn(H, Dh, K + 8), torch.randn(H, Dh), torch.randn(H, Dh)
    op = median_ms(lambda: native.attention(q, k, v, qv=q, r=r, query_bias=(u, vb, 0.25)), 200)
    agent = Agent(Args(memory="gtrxl", num_envs=N, mem_len=M), 4, 4).eval()
    memory = agent.memory.initial(N)
    x = torch.nn.functional.one_hot(torch.randint(0, 4, (N,)), 4).float()
    reset = torch.zeros(N, dtype=torch.bool)
    for _ in range(M):  # (the memory full)
        agent.memory.step(x, reset, memory)
    step = median_ms(lambda: agent.memory.step(x, reset, memory), 100)
    return f"{N}/{M}: attention {op:.3f} step {step:.3f}"


print(sys.argv[2], "ms |", " | ".join(configuration(N, M) for N in (16, 64, 256) for M in (64, 256)))
