"""Memory for agents: Transformer-XL (or GTrXL) over any vectors, the memory of N parallel environments with their
episode boundaries, a one-step acting path and a window path for training.
Design notes: docs/internals.md#txlrlmemory."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels.registry import admitted
from txl.kernels.runtime import functorch_wrapped
from txl.model.cache import KVCache
from txl.model.config import TransformerXLConfig
from txl.model.pretrained import (
    WEIGHTS_NAME,
    CheckpointError,
    check_config_fits_weights,
    load_weights,
    read_config,
    read_safetensors,
    safetensors_index,
    unique_state_dict,
    write_config,
)
from txl.model.transformer import TransformerXL
from txl.rl.acting import RingMemory
from txl.rl.state import MemoryState, check_fits, element_size
from txl.util.fileio import save_safetensors


class AgentMemory:
    """The memory of N parallel environments for acting: each layer's keys and values (a ``KVCache``, updated in
    place) and each layer's inputs (what a training window starts from, ``state()``), over the last ``mem_len``
    steps. Made by ``MemoryTransformer.initial_memory``; every environment starts with an empty memory."""

    def __init__(self, config: TransformerXLConfig, n_envs: int, mem_len: int, device, dtype: torch.dtype):
        self.n_envs, self.mem_len = n_envs, mem_len
        check_fits(self.bytes_per_env(config, mem_len, element_size(dtype)) * n_envs, device, n_envs, mem_len)
        self.cache = KVCache(config, n_envs, mem_len, 1, inputs=True, device=device, dtype=dtype)
        self.weights: tuple | None = None  # (the key of the weights the cached keys and values were computed with)

    @staticmethod
    def bytes_per_env(config: TransformerXLConfig, mem_len: int, element_size: int = 4) -> int:
        """Bytes one environment's acting memory takes: keys, values and layer inputs of 2 (mem_len + 1) positions,
        and a flag each."""
        capacity = KVCache.capacity_for(mem_len)
        per_position = config.n_layer * (2 * config.n_head * config.d_head + config.d_model) * element_size + 1
        return capacity * per_position

    @property
    def hidden(self) -> Tensor:
        """Each layer's input at each position of the cache's buffer, [L, N, capacity, D] (the cache keeps them and
        moves them with its window)."""
        return self.cache.hidden[:, :, 0]

    def _begin(self, reset: Tensor) -> None:
        """Before a step: forget the memory of the environments that start an episode (masked, and zeroed with
        their layer inputs: nothing of a past episode, a NaN included, reaches the new one)."""
        if self.cache.length:
            self.cache.forget(reset)

    def _record(self, inputs: list[Tensor]) -> None:
        """After a step: each layer's input at this step ([N, 1, D] each) at the position the cache wrote."""
        self.hidden[:, :, self.cache.end - 1] = torch.stack(inputs)[:, :, 0]  # [L, N, D]

    def recompute(self, model: MemoryTransformer) -> None:
        """The weights changed (an update, a loaded state): the cached keys and values from the kept layer inputs,
        and W_kR R (the cache forgets its tables)."""
        layers = model.core.layers
        self.cache.weights_changed(lambda i, at: layers[i].attn.memory_keys_values(self.hidden[i, :, at]))

    def clone(self) -> AgentMemory:
        """An independent copy (e.g. to take a step for a bootstrap value without moving this memory on)."""
        copy = object.__new__(AgentMemory)
        copy.n_envs, copy.mem_len, copy.weights = self.n_envs, self.mem_len, self.weights
        copy.cache = self.cache.take(list(range(self.n_envs)))  # (its layer inputs too)
        return copy

    def state(self, dtype: torch.dtype | None = None) -> MemoryState:
        """A copy of the memory now, ``mem_len`` steps per environment (fewer steps than that: the first ones are
        invalid), each layer's input stored as ``dtype`` (e.g. torch.bfloat16 halves a rollout's memory)."""
        c, M = self.cache, self.mem_len
        m = c.length
        hidden = self.hidden[:, :, c.start : c.end].transpose(0, 1)  # [N, L, m, D]
        invalid = c.padding[:, c.start : c.end]  # [N, m]
        hidden = F.pad(hidden, (0, 0, M - m, 0)).to(dtype or hidden.dtype, copy=True)  # [N, L, M, D]
        invalid = F.pad(invalid, (M - m, 0), value=True)  # [N, M]
        return MemoryState(hidden, invalid)


class MemoryTransformer(nn.Module):
    """Transformer-XL as an agent's memory: observations (any vectors) in, one feature vector per step out.

    ``config`` is a ``TransformerXLConfig``; GTrXL is ``pre_lnorm=True, identity_map=True, gate="gru"`` (see
    :func:`gtrxl_config`). A linear layer maps ``d_input`` to ``d_model``; the model itself takes them as
    ``inputs_embeds`` (no vocabulary, no softmax)."""

    def __init__(self, config: TransformerXLConfig, d_input: int):
        super().__init__()
        if config.attn_type != 0:
            raise ValueError(
                f"MemoryTransformer needs attn_type 0 (relative positions, cached), not {config.attn_type}"
            )
        if config.cmem_len:
            raise ValueError(
                f"cmem_len = {config.cmem_len}: an agent's memory (its episode masks, the acting ring, the windows "
                "it trains on) has no compressed memory yet: use cmem_len 0"
            )
        self.config, self.d_input = config, d_input
        self.embed = nn.Linear(d_input, config.d_model)
        self.core = TransformerXL(config)
        self._watched: tuple | None = None  # (the modules the cached keys depend on, their parameters)
        self._token = object()  # (which model computed a memory's cached keys; a copy of the model gets its own)

    @property
    def d_model(self) -> int:
        return self.config.d_model

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (no pickle) into ``directory``."""
        out = Path(directory)
        if out.exists() and not out.is_dir():
            raise ValueError(f"save_pretrained: {out} is a file, not a folder; give a folder to write the model into")
        out.mkdir(parents=True, exist_ok=True)
        save_safetensors(unique_state_dict(self), out / WEIGHTS_NAME, {"format": "pt"})
        write_config(self.config, out, type(self).__name__)
        return out

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> MemoryTransformer:
        """The model ``save_pretrained`` wrote (d_input is read from the input layer's weight)."""
        config = read_config(TransformerXLConfig, directory)
        path = Path(directory) / WEIGHTS_NAME
        if path.exists() and not path.is_file():
            raise CheckpointError(f"{path}: not a file (a model folder holds its weights in this file)")
        shapes = {k: e[1] for k, e in safetensors_index(path)[0].items()}  # (the header only: nothing allocated)
        check_config_fits_weights(config, shapes, str(Path(directory) / "config.json"), str(path))
        embed = shapes.get("embed.weight")
        if embed is None:
            raise CheckpointError(f"{directory}: no embed.weight in {WEIGHTS_NAME}: not a MemoryTransformer's folder")
        if len(embed) != 2 or min(embed) < 1 or embed[0] != config.d_model:
            raise CheckpointError(
                f"{path}: embed.weight is {embed}; a MemoryTransformer's is [d_model={config.d_model}, d_input >= 1]"
            )
        model = cls(config, embed[1])
        load_weights(model, read_safetensors(path), str(directory))
        return model

    def initial_memory(
        self, n_envs: int, mem_len: int | None = None, device=None, dtype: torch.dtype | None = None, *,
        graph: bool | None = None,
    ) -> AgentMemory | RingMemory:  # fmt: skip
        """An empty memory for ``n_envs`` environments (``mem_len``: the config's by default); device and dtype
        of the model's weights by default. Raises ValueError if it does not fit the device's free memory.

        ``graph``: a :class:`~txl.rl.acting.RingMemory`, whose step is replayed on CUDA as one graph (True), or an
        :class:`AgentMemory` (False). None (default): the ring where the device is in ``Backends.graph_act`` (CUDA)
        and the layers are stock; both compute the same features."""
        mem_len = self.config.mem_len if mem_len is None else mem_len
        if isinstance(n_envs, bool) or not isinstance(n_envs, int) or n_envs < 1:
            raise ValueError(f"n_envs must be a positive integer, got {n_envs!r}")
        if isinstance(mem_len, bool) or not isinstance(mem_len, int) or mem_len < 1:
            raise ValueError(f"mem_len must be a positive integer (steps remembered), got {mem_len!r}")
        w = self.embed.weight
        if dtype is not None and dtype != w.dtype:  # (probes rl19, rl20: a matmul error deep in the first step)
            raise ValueError(
                f"initial_memory: dtype {dtype} differs from the model's weights ({w.dtype}): the memory is attended "
                f"with them; leave dtype out, or cast the model first (model.to({dtype}))"
            )
        device, dtype = torch.device(device or w.device), dtype or w.dtype
        if graph is None:
            graph = admitted("graph_act", self.core.layers, "layers", device.type)
        if not graph:
            return AgentMemory(self.config, n_envs, mem_len, device, dtype)
        return RingMemory(self, n_envs, mem_len, device, dtype, graph=True)

    def _inputs(self, x: Tensor, shape: tuple[int, ...], what: str) -> Tensor:
        if not isinstance(x, Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{what} must be {list(shape)} (environments, [steps,] d_input), got {got}")
        return x.to(self.embed.weight.dtype)

    @staticmethod
    def _resets(reset: Tensor, shape: tuple[int, ...], what: str) -> Tensor:
        if not isinstance(reset, Tensor) or tuple(reset.shape) != shape:
            got = list(reset.shape) if isinstance(reset, Tensor) else type(reset).__name__
            raise ValueError(f"{what} must be {list(shape)} (one flag per environment [and step]), got {got}")
        return reset.to(torch.bool)

    @torch.no_grad()
    def step(self, x: Tensor, reset: Tensor, memory: AgentMemory | RingMemory) -> Tensor:
        """Act: one step of every environment, ``x`` [N, d_input] (observations), ``reset`` [N] (True: this step
        starts the environment's episode, its memory is masked). Updates ``memory`` in place; returns the features
        [N, d_model]. No gradient, no dropout (acting; in eval mode no mode switch per step: faster)."""
        N, ring = memory.n_envs, isinstance(memory, RingMemory)
        if (memory.made_for != (self.config, self.d_input)) if ring else (memory.cache.config != self.config):
            raise ValueError(
                "step: this memory was made by a model of another configuration (initial_memory of this one makes one)"
            )
        w = self.embed.weight
        if ring and (memory.k.dtype, memory.k.device) != (w.dtype, w.device):
            raise ValueError(
                f"step: this memory holds {memory.k.dtype} on {memory.k.device} and the model's weights are "
                f"{w.dtype} on {w.device}: make a new one with initial_memory after moving or casting the model"
            )
        x = self._inputs(x, (N, self.d_input), "step: x")
        reset = self._resets(reset, (N,), "step: reset")
        if ring:
            self._refresh(memory)
            with _evaluating(self):
                return memory.act(self, x, reset)
        reset = reset.to(memory.cache.padding.device)
        memory._begin(reset)
        self._refresh(memory)
        with _evaluating(self):
            out = self.core(
                inputs_embeds=self.embed(x)[:, None], cache=memory.cache, mem_len=memory.mem_len,
                output_hidden_states=True,
            )  # fmt: skip
        memory._record(out.hidden_states[:-1])
        return out.last_hidden_state[:, 0]  # [N, D]

    def _refresh(self, memory: AgentMemory | RingMemory) -> None:
        """If the weights the cache depends on changed since its keys and values were computed (an update, a loaded
        state, a target network's copy), compute them again from the kept layer inputs, and W_kR R too: acting then
        computes what the window replays. Those weights are the attention's input norm, QKV and position projections
        (whatever modules hold them: an adapter's too). Optimizers and loading write in place, which bumps the
        tensors' version counters; a write through ``.data`` (``p.data.copy_(q.data)``, ``p.data.add_(...)``,
        ``p.data = t``) bumps none, so the weights' contents are also compared with a copy taken when they were
        last read (about 3% of a step: 33 us of 1.1 ms at d_model 64, 0.2 ms of 5 ms at d_model 256)."""
        parts = tuple(  # (read from the modules' own dicts: this runs at every step)
            a[name]
            for layer in self.core.layers._modules.values()
            for a in (layer._modules["attn"]._modules,)
            for name in ("layer_norm", "qkv_net", "r_net")
        )
        if self._watched is None or self._watched[0] != tuple(map(id, parts)):
            params = [p for m in parts for p in m.parameters()]
            self._watched = (tuple(map(id, parts)), params, [p.detach().clone() for p in params], 0)
        ids, params, seen, generation = self._watched
        # the weights' generation: a new one whenever their contents differ from the copy (whatever wrote them: an
        # optimizer, loading, a write through .data, a new storage)
        if not all(map(_same, params, seen)):
            generation += 1
            self._watched = (ids, params, [p.detach().clone() for p in params], generation)
        # the key: this model (another model of the same config has other weights: probes rl13), the modules, and
        # their weights' generation
        key = (self._token, ids, generation)
        if memory.weights == key:
            return
        memory.recompute(self)
        memory.weights = key

    def window(
        self, x: Tensor, resets: Tensor, state: MemoryState, every_step: bool = False
    ) -> tuple[Tensor, MemoryState]:
        """Replay T steps of N environments with gradients: ``x`` [N, T, d_input], ``resets`` [N, T] (True: the step
        starts an episode), ``state`` the memory at the window's start (``AgentMemory.state()``, detached). Returns
        the features [N, T, d_model], what T calls of :meth:`step` return, and the memory at the window's end
        (``every_step``: after each step, hidden [N, T, L, M, D] and invalid [N, T, M], views where they can be)."""
        if x.dim() != 3:
            raise ValueError(f"window: x must be [N, T, d_input={self.d_input}], got {tuple(x.shape)}")
        N, T = x.shape[:2]
        x = self._inputs(x, (N, T, self.d_input), "window: x")
        resets = self._resets(resets, (N, T), "window: resets").to(x.device)
        L, D = self.config.n_layer, self.config.d_model
        if state.hidden.dim() != 4 or tuple(state.hidden.shape[:2]) != (N, L) or state.hidden.shape[3] != D:
            raise ValueError(f"window: state.hidden must be [N={N}, L={L}, M, D={D}], got {tuple(state.hidden.shape)}")
        M = state.hidden.shape[2]
        if tuple(state.invalid.shape) != (N, M) or state.invalid.dtype != torch.bool:
            raise ValueError(
                f"window: state.invalid must be [N={N}, M={M}] bool, got {tuple(state.invalid.shape)} "
                f"{state.invalid.dtype}"
            )
        if T == 0 or M == 0:  # (probes rl21, rl23)
            raise ValueError(f"window: needs at least one step (T = {T}) and a memory of at least one step (M = {M})")
        if not (functorch_wrapped(x) or torch.compiler.is_compiling()):  # (a host read: not under vmap, not compiled)
            apart = ~torch.isfinite(x).flatten(1).all(1) & resets[:, 1:].any(1)  # [N]
            if bool(apart.any()):
                return self._window_apart(x, resets, state, every_step, apart)
        episode, keys, unfilled = _episodes(resets, state.invalid.to(x.device))
        blocked = _blocked(episode, keys, unfilled)  # [N, T, M + T]
        # the memory's invalid steps are never attended, nor any step of it when the window starts an episode: zeroed,
        # they add exactly 0 (not 0 x NaN)
        unseen = state.invalid.to(x.device) | resets[:, :1]  # [N, M]
        held = state.hidden.to(x).detach().masked_fill(unseen[:, None, :, None], 0)
        mems = list(held.unbind(1))  # L x [N, M, D]
        out = self.core(
            inputs_embeds=self.embed(x), mems=mems, key_mask=blocked, mem_len=M, output_hidden_states=every_step
        )
        if not every_step:
            invalid = (unfilled | (keys != episode[:, -1:]))[:, -M:]
            return out.last_hidden_state, MemoryState(torch.stack(out.mems, 1), invalid)
        # after step t the memory is keys t + 1 .. t + M of [memory; window]: windows of M over the keys
        layer_inputs = torch.stack(out.hidden_states[:-1], 1).detach()  # [N, L, T, D]
        every = torch.cat([held, layer_inputs], 2)  # [N, L, M + T, D]
        hidden = every.unfold(2, M, 1)[:, :, 1:].permute(0, 2, 1, 4, 3)  # [N, T, L, M, D]
        invalid = unfilled.unfold(1, M, 1)[:, 1:] | (keys.unfold(1, M, 1)[:, 1:] != episode[:, :, None])  # [N, T, M]
        return out.last_hidden_state, MemoryState(hidden, invalid)

    def _window_apart(
        self, x: Tensor, resets: Tensor, state: MemoryState, every_step: bool, apart: Tensor
    ) -> tuple[Tensor, MemoryState]:
        """:meth:`window` where some environments (``apart`` [N]) hold a non-finite observation and a reset after the
        window's first step: one window would reach the later episode through its masked keys of the earlier one
        (0 x NaN). Each such environment's window runs in pieces cut at its resets (a piece that starts an episode
        attends nothing before it, and its memory is zeroed), the others together as one window: each computes what
        T calls of :meth:`step` compute. The gradients are the one window's: nothing crosses a reset."""
        N, T = resets.shape
        rows: dict[int, tuple[Tensor, MemoryState]] = {}
        together = (~apart).nonzero().flatten()
        if len(together):
            feats, end = self.window(x[together], resets[together], state.index(together.to(state.hidden.device)),
                                     every_step)  # fmt: skip
            for i, n in enumerate(together.tolist()):
                rows[n] = feats[i : i + 1], end.index(slice(i, i + 1))
        for n in apart.nonzero().flatten().tolist():
            cuts = [0, *(1 + resets[n, 1:].nonzero().flatten()).tolist(), T]
            now, pieces, ends = state.index(slice(n, n + 1)), [], []
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                feats, end = self.window(x[n : n + 1, a:b], resets[n : n + 1, a:b], now, every_step)
                pieces.append(feats)
                ends.append(end)
                now = MemoryState(end.hidden[:, -1], end.invalid[:, -1]) if every_step else end
            joined = MemoryState(torch.cat([e.hidden for e in ends], 1), torch.cat([e.invalid for e in ends], 1))
            rows[n] = torch.cat(pieces, 1), joined if every_step else now
        return torch.cat([rows[n][0] for n in range(N)]), MemoryState.stack([rows[n][1] for n in range(N)])

    @staticmethod
    def window_mask(resets: Tensor, invalid: Tensor) -> Tensor:
        """[N, T, M + T] bool, True = not attended: for each query, the keys more than M steps back, the memory's
        invalid steps and every key of an earlier episode (block-diagonal in time; built without a loop)."""
        return _blocked(*_episodes(resets, invalid))


def _episodes(resets: Tensor, invalid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A window's episodes: of each step [N, T] (0: the memory's), of each key [N, M + T], and the keys never
    attended for being unfilled or before an episode's start in the memory [N, M + T]."""
    M, T = invalid.shape[1], resets.shape[1]
    episode = resets.long().cumsum(1)  # [N, T]
    return episode, F.pad(episode, (M, 0)), F.pad(invalid, (0, T), value=False)


def _blocked(episode: Tensor, keys: Tensor, unfilled: Tensor) -> Tensor:
    """[N, T, M + T], True = not attended: keys more than M steps back, unfilled, or of another episode."""
    T, K = episode.shape[1], keys.shape[1]
    M = K - T
    i = torch.arange(T, device=keys.device)[:, None] + M
    too_old = torch.arange(K, device=keys.device)[None, :] < i - M  # [T, M + T]
    other = keys[:, None, :] != episode[:, :, None]  # [N, T, M + T]
    return other | too_old | unfilled[:, None, :]


@contextlib.contextmanager
def _evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block (acting: no dropout), its mode restored after (nothing to do, and nothing
    spent walking the modules, when it is in eval mode already: act in eval mode for the fastest steps)."""
    was = module.training
    if not was:
        yield
        return
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def _same(p: Tensor, copy: Tensor) -> bool:
    """Whether a weight still holds what ``copy`` holds (on the same device, in the same dtype and shape)."""
    return p.shape == copy.shape and p.dtype == copy.dtype and p.device == copy.device and torch.equal(p, copy)


def gtrxl_config(
    d_model: int = 64, n_layer: int = 2, n_head: int = 4, d_head: int | None = None, d_inner: int | None = None,
    mem_len: int = 64, gate: str = "gru", gate_bias: float = 2.0, dropout: float = 0.0, **overrides,
) -> TransformerXLConfig:  # fmt: skip
    """A GTrXL configuration (identity-map reordering, pre-LN, gates; ``gate="residual"``: TrXL-I) over vectors;
    ``overrides``: any other ``TransformerXLConfig`` field."""
    return TransformerXLConfig(
        n_token=1, d_model=d_model, n_layer=n_layer, n_head=n_head, d_head=d_head or d_model // n_head,
        d_inner=d_inner or 4 * d_model, mem_len=mem_len, pre_lnorm=True, identity_map=True, gate=gate,
        gate_bias=gate_bias, dropout=dropout, dropatt=0.0, untie_r=True, **overrides,
    )  # fmt: skip
