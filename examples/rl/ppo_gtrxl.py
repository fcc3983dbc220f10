"""PPO with a memory (txl's GTrXL) on POPGym's and MiniGrid's memory tasks: one file, CleanRL-style.

    python examples/rl/ppo_gtrxl.py --env repeat_first --memory gtrxl --steps 400000 --seed 1 --out runs/rf-gtrxl

Memories (``--memory``): ``gtrxl`` (txl.rl.MemoryTransformer, GRU gates), ``trxl`` (the same without gates: TrXL-I),
``gru`` (a GRU of similar size) and ``mlp`` (no memory: the floor). Acting runs every environment one step at a time
(``step``: the cached path, memory updated in place); the update replays windows of ``--window`` steps with gradients
from the memory stored at each window's start (``window``: block-diagonal in time, equal to the steps). The run writes
``curve.csv`` (env steps, wall-clock seconds, mean episodic return of the episodes that ended; a row as each
iteration ends) and, at its end, ``summary.json``.
Needs the ``rl`` extra (gymnasium, popgym, minigrid).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.rl import MemoryState, MemoryTransformer, gtrxl_config

ENVS = {
    "repeat_first": "popgym.envs.repeat_first:RepeatFirstEasy",
    "repeat_previous": "popgym.envs.repeat_previous:RepeatPreviousEasy",
    "count_recall": "popgym.envs.count_recall:CountRecallEasy",
    "autoencode": "popgym.envs.autoencode:AutoencodeEasy",
    "position_only_cartpole": "popgym.envs.position_only_cartpole:PositionOnlyCartPoleEasy",
}


@dataclass
class Args:
    env: str = "repeat_first"
    memory: str = "gtrxl"
    steps: int = 400_000
    seed: int = 1
    num_envs: int = 32
    rollout: int = 128
    window: int = 32
    mem_len: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    init_std: float = 0.1  # (txl's default 0.02 left both transformers at chance on RepeatPrevious for 200k steps)
    gate_bias: float = 0.0  # (b_g = 2, the GTrXL paper's and RLlib's, and 1 stayed at chance there too)
    gru_hidden: int = 128
    lr: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    epochs: int = 4
    minibatches: int = 4
    clip: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    threads: int = 1
    device: str = "cpu"  # (cuda: the model, the rollout and the update on the GPU; the environments on the CPU)
    out: str = ""


# MiniGrid's Memory tasks (Chevalier-Boisvert et al.): a cue object in the start room, a corridor, then the two
# objects at its end; success is walking up to the one like the cue (reward 1 - 0.9 * steps / max_steps), the other
# ends the episode with 0, so a policy without memory gets half of what a perfect one does. The view is the
# symbolic one (7 x 7 cells of object, colour and state indices: MultiDiscrete, one-hot encoded below) and the
# actions are the three the task needs (turn left, turn right, forward; MiniGrid's other four do nothing here).
MINIGRID = {
    "minigrid_memory_s7": "MiniGrid-MemoryS7-v0",
    "minigrid_memory_s9": "MiniGrid-MemoryS9-v0",
    "minigrid_memory_s11": "MiniGrid-MemoryS11-v0",
    "minigrid_memory_s13": "MiniGrid-MemoryS13-v0",
}


class MiniGridView(gym.Wrapper):
    """A MiniGrid environment with the symbolic egocentric view as MultiDiscrete and the first ``n_actions``
    actions (its observation: ``image`` [7, 7, 3] of object, colour and state indices, flattened)."""

    def __init__(self, env: gym.Env, n_actions: int = 3):
        super().__init__(env)
        from minigrid.core.constants import COLOR_TO_IDX, OBJECT_TO_IDX, STATE_TO_IDX

        view = env.observation_space["image"].shape  # [7, 7, 3]
        cell = [len(OBJECT_TO_IDX), len(COLOR_TO_IDX), len(STATE_TO_IDX)]
        self.observation_space = gym.spaces.MultiDiscrete(np.tile(cell, view[0] * view[1]))
        self.action_space = gym.spaces.Discrete(n_actions)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs["image"].reshape(-1).astype(np.int64), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(int(action))
        return obs["image"].reshape(-1).astype(np.int64), reward, terminated, truncated, info


def make_env(name: str):
    if name in MINIGRID:
        import minigrid  # noqa: F401  (registers the MiniGrid-* ids)

        return lambda: MiniGridView(gym.make(MINIGRID[name]))
    if name not in ENVS:
        raise ValueError(f"--env must be one of {', '.join([*ENVS, *MINIGRID])}, got {name!r}")
    module, cls = ENVS[name].split(":")
    env_cls = getattr(__import__(module, fromlist=[cls]), cls)
    return lambda: env_cls()


def one_hot_space(space: gym.Space) -> int:
    if isinstance(space, gym.spaces.Discrete):
        return int(space.n)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return int(space.nvec.sum())
    if isinstance(space, gym.spaces.Box):
        return int(np.prod(space.shape))
    if isinstance(space, gym.spaces.Tuple):  # (POPGym's Autoencode: (is the cue phase, the card)): parts side by side
        return sum(one_hot_space(part) for part in space.spaces)
    raise ValueError(f"observation space {space} is not supported (Discrete, MultiDiscrete, Box or a Tuple of them)")


def encode(obs: np.ndarray, space: gym.Space) -> Tensor:
    """Observations of N environments as vectors [N, d]: one-hot for discrete spaces (a Tuple's parts each encoded,
    side by side)."""
    if isinstance(space, gym.spaces.Tuple):
        return torch.cat([encode(part, sub) for part, sub in zip(obs, space.spaces, strict=True)], dim=1)
    if isinstance(space, gym.spaces.Discrete):
        return F.one_hot(torch.as_tensor(obs, dtype=torch.long), int(space.n)).float()
    if isinstance(space, gym.spaces.MultiDiscrete):
        nvec = np.asarray(space.nvec).reshape(-1)
        first = torch.as_tensor(np.concatenate([[0], np.cumsum(nvec)[:-1]]), dtype=torch.long)  # each part's offset
        idx = torch.as_tensor(np.asarray(obs).reshape(len(obs), -1), dtype=torch.long) + first  # [N, parts]
        return torch.zeros(len(obs), int(nvec.sum())).scatter_(1, idx, 1.0)  # every part one-hot, side by side
    return torch.as_tensor(obs, dtype=torch.float32).reshape(obs.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------
# Memories: step(x [N, d], reset [N], state) acts; window(x [N, T, d], resets [N, T], start) replays with gradients.
# ---------------------------------------------------------------------------------------------------------


class TransformerMemory(nn.Module):
    def __init__(self, args: Args, d_input: int, gate: str):
        super().__init__()
        cfg = gtrxl_config(
            d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head, mem_len=args.mem_len, gate=gate,
            gate_bias=args.gate_bias, init_std=args.init_std,
        )  # fmt: skip
        self.net = MemoryTransformer(cfg, d_input)
        self.d_out = args.d_model

    def initial(self, n: int):
        return self.net.initial_memory(n)

    def step(self, x: Tensor, reset: Tensor, memory) -> Tensor:
        return self.net.step(x, reset, memory)

    def snapshot(self, memory) -> MemoryState:
        return memory.state()

    @staticmethod
    def peek(memory):  # (a copy to take the bootstrap step with, leaving the real memory as it is)
        return memory.clone()

    def window(self, x: Tensor, resets: Tensor, start: MemoryState) -> Tensor:
        return self.net.window(x, resets, start)[0]

    @staticmethod
    def stack(starts: list) -> MemoryState:
        return MemoryState.stack(starts)

    @staticmethod
    def index(start: MemoryState, rows: Tensor) -> MemoryState:
        return start.index(rows)


class GRUMemory(nn.Module):
    def __init__(self, args: Args, d_input: int):
        super().__init__()
        self.inp = nn.Linear(d_input, args.gru_hidden)
        self.gru = nn.GRU(args.gru_hidden, args.gru_hidden, batch_first=True)
        self.d_out = args.gru_hidden

    def initial(self, n: int) -> list[Tensor]:
        return [torch.zeros(1, n, self.d_out, device=self.inp.weight.device)]

    @torch.no_grad()
    def step(self, x: Tensor, reset: Tensor, memory: list[Tensor]) -> Tensor:
        h = memory[0] * (~reset).float()[None, :, None]  # a reset starts from zero
        out, memory[0] = self.gru(self.inp(x)[:, None], h)
        return out[:, 0]

    def snapshot(self, memory: list[Tensor]) -> Tensor:
        return memory[0][0].clone()  # [N, H]

    @staticmethod
    def peek(memory: list[Tensor]) -> list[Tensor]:
        return [memory[0].clone()]

    def window(self, x: Tensor, resets: Tensor, start: Tensor) -> Tensor:
        h, outs = start[None], []
        e = self.inp(x)
        for t in range(x.shape[1]):  # (a loop over time, not environments: the resets cut the recurrence)
            h = h * (~resets[:, t]).float()[None, :, None]
            o, h = self.gru(e[:, t : t + 1], h)
            outs.append(o)
        return torch.cat(outs, 1)

    @staticmethod
    def stack(starts: list) -> Tensor:
        return torch.cat(starts)

    @staticmethod
    def index(start: Tensor, rows: Tensor) -> Tensor:
        return start[rows]


class MLPMemory(nn.Module):
    def __init__(self, args: Args, d_input: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_input, args.d_model), nn.ReLU(), nn.Linear(args.d_model, args.d_model))
        self.d_out = args.d_model

    def initial(self, n: int):
        return None

    @torch.no_grad()
    def step(self, x: Tensor, reset: Tensor, memory) -> Tensor:
        return self.net(x)

    def snapshot(self, memory) -> Tensor:
        return torch.zeros(0)

    @staticmethod
    def peek(memory):
        return memory

    def window(self, x: Tensor, resets: Tensor, start) -> Tensor:
        return self.net(x)

    @staticmethod
    def stack(starts: list) -> Tensor:
        return torch.zeros(0)

    @staticmethod
    def index(start, rows: Tensor):
        return start


def make_memory(args: Args, d_input: int) -> nn.Module:
    if args.memory == "gtrxl":
        return TransformerMemory(args, d_input, "gru")
    if args.memory == "trxl":
        return TransformerMemory(args, d_input, "residual")
    if args.memory == "gru":
        return GRUMemory(args, d_input)
    if args.memory == "mlp":
        return MLPMemory(args, d_input)
    raise ValueError(f"--memory must be gtrxl, trxl, gru or mlp, got {args.memory!r}")


class Agent(nn.Module):
    def __init__(self, args: Args, d_input: int, n_actions: int):
        super().__init__()
        self.memory = make_memory(args, d_input)
        self.actor = nn.Linear(self.memory.d_out, n_actions)
        self.critic = nn.Linear(self.memory.d_out, 1)
        nn.init.orthogonal_(self.actor.weight, 0.01)
        nn.init.zeros_(self.actor.bias)

    def heads(self, features: Tensor) -> tuple[Tensor, Tensor]:
        return self.actor(features), self.critic(features).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------------------


def train(args: Args) -> dict:
    if args.rollout % args.window:
        raise ValueError(f"--rollout ({args.rollout}) must be a multiple of --window ({args.window})")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env) for _ in range(args.num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    space = envs.single_observation_space
    dev = torch.device(args.device)
    agent = Agent(args, one_hot_space(space), int(envs.single_action_space.n)).to(dev)
    opt = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    N, R, W = args.num_envs, args.rollout, args.window
    obs_np, _ = envs.reset(seed=args.seed)
    obs = encode(obs_np, space).to(dev)
    reset = torch.ones(N, dtype=torch.bool, device=dev)
    memory = agent.memory.initial(N)
    iterations = max(1, args.steps // (N * R))
    curve, recent, t0, env_steps = [], [], time.perf_counter(), 0
    act_s = update_s = 0.0
    log = None  # curve.csv, a row per iteration as it ends (a long run can be watched; summary.json ends a run)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").unlink(missing_ok=True)
        log = open(Path(args.out) / "curve.csv", "w", newline="")  # noqa: SIM115  (closed at the end of the run)
        csv.writer(log).writerow(["env_steps", "wall_s", "mean_return"])
    timings = []  # (rollout s, update s) per iteration
    for it in range(iterations):
        lr = args.lr * (1 - it / iterations)
        for g in opt.param_groups:
            g["lr"] = lr
        xs, rs, acts, logps, vals, rews, dones, starts = [], [], [], [], [], [], [], []
        a0 = time.perf_counter()
        agent.eval()  # (acting: no dropout, and no mode switch in every step)
        for t in range(R):
            if t % W == 0:
                starts.append(agent.memory.snapshot(memory))
            with torch.no_grad():
                feats = agent.memory.step(obs, reset, memory)
                logits, value = agent.heads(feats)
                dist = torch.distributions.Categorical(logits=logits)
                action = dist.sample()
            xs.append(obs)
            rs.append(reset)
            acts.append(action)
            logps.append(dist.log_prob(action))
            vals.append(value)
            obs_np, reward, term, trunc, info = envs.step(action.cpu().numpy())
            done = np.logical_or(term, trunc)
            rews.append(torch.as_tensor(reward, dtype=torch.float32, device=dev))
            dones.append(torch.as_tensor(done, device=dev))
            obs, reset = encode(obs_np, space).to(dev), torch.as_tensor(done, device=dev)
            if "episode" in info:
                recent.extend(info["episode"]["r"][info["_episode"]].tolist())
        with torch.no_grad():
            next_value = agent.heads(agent.memory.step(obs, reset, agent.memory.peek(memory)))[1]
        act_s += time.perf_counter() - a0
        env_steps += N * R
        u0 = time.perf_counter()
        agent.train()
        x, rs_t = torch.stack(xs, 1), torch.stack(rs, 1)  # [N, R, d], [N, R]
        act_t, logp_t, val_t = torch.stack(acts, 1), torch.stack(logps, 1), torch.stack(vals, 1)
        rew_t, done_t = torch.stack(rews, 1), torch.stack(dones, 1).float()
        adv = torch.zeros(N, R, device=dev)
        last = torch.zeros(N, device=dev)
        for t in reversed(range(R)):  # GAE (a done at t ends the episode: no bootstrap across it)
            nv = next_value if t == R - 1 else val_t[:, t + 1]
            delta = rew_t[:, t] + args.gamma * nv * (1 - done_t[:, t]) - val_t[:, t]
            last = delta + args.gamma * args.gae_lambda * (1 - done_t[:, t]) * last
            adv[:, t] = last
        ret = adv + val_t
        # windows: [N * R/W] sequences of W steps, each with the memory stored at its start
        nw = R // W

        def windows(t: Tensor, nw: int = nw) -> Tensor:
            return t.reshape(N, nw, W, *t.shape[2:]).reshape(N * nw, W, *t.shape[2:])

        wx, wr, wa, wl, wadv, wret = map(windows, (x, rs_t, act_t, logp_t, adv, ret))
        wstart = agent.memory.stack([starts[j] for j in range(nw)])  # [nw * N, ...] window-major
        order = torch.arange(N * nw, device=dev).reshape(nw, N).t().reshape(-1)  # env-major window -> window-major
        for _ in range(args.epochs):
            perm = torch.randperm(N * nw).to(dev)
            for mb in perm.chunk(args.minibatches):
                start = agent.memory.index(wstart, order[mb])
                feats = agent.memory.window(wx[mb], wr[mb], start)
                logits, value = agent.heads(feats)
                dist = torch.distributions.Categorical(logits=logits)
                logp = dist.log_prob(wa[mb])
                ratio = (logp - wl[mb]).exp()
                a = wadv[mb]
                a = (a - a.mean()) / (a.std() + 1e-8)
                pg = torch.max(-a * ratio, -a * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
                vloss = 0.5 * (value - wret[mb]).square().mean()
                loss = pg + args.vf_coef * vloss - args.ent_coef * dist.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                opt.step()
        update_s += time.perf_counter() - u0
        timings.append((u0 - a0, time.perf_counter() - u0))
        mean_ret = float(np.mean(recent)) if recent else float("nan")
        curve.append((env_steps, time.perf_counter() - t0, mean_ret))
        recent = []
        if log is not None:
            csv.writer(log).writerow(curve[-1])
            log.flush()
    if log is not None:
        log.close()
    envs.close()
    final = [r for _, _, r in curve[-max(1, len(curve) // 10) :]]
    summary = {
        "args": asdict(args),
        "final_mean_return": float(np.nanmean(final)),
        "env_steps": env_steps,
        "wall_s": time.perf_counter() - t0,
        "act_s": act_s,
        "update_s": update_s,
        "params": sum(p.numel() for p in agent.parameters()),
        "iterations_s": timings,
    }
    if args.out:
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(Args()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = Args(**vars(p.parse_args()))
    if args.env not in ENVS and args.env not in MINIGRID:
        p.error(f"--env must be one of {', '.join([*ENVS, *MINIGRID])}, got {args.env!r}")
    if args.memory not in ("gtrxl", "trxl", "gru", "mlp"):
        p.error(f"--memory must be gtrxl, trxl, gru or mlp, got {args.memory!r}")
    if args.rollout % args.window:
        p.error(f"--rollout ({args.rollout}) must be a multiple of --window ({args.window})")
    s = train(args)
    print(json.dumps({k: v for k, v in s.items() if k != "args"}))


if __name__ == "__main__":
    main()
