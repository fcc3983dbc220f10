"""Acting with every shape and address fixed: the step of N environments replayed on CUDA as one graph.
Design notes: docs/internals.md#txlrlacting."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from txl.kernels.graphs import module_state
from txl.kernels.registry import admitted
from txl.model.attention import RelPartialLearnableMultiHeadAttn
from txl.model.cache import Ring
from txl.model.config import Reading, TransformerXLConfig
from txl.rl.state import MemoryState, check_fits, element_size


class RingMemory(Ring):
    """The memory of N parallel environments for acting as a ring of fixed shape (see the module's docstring): a
    :class:`~txl.model.cache.Ring` that also keeps each layer's input (``hidden``, for ``state()`` and a weight
    update's recompute) and forgets an environment's memory when it resets. Its ``model`` arguments are the
    ``MemoryTransformer`` that made it (``embed``, ``core``, ``d_input``, ``config``). Made by
    ``MemoryTransformer.initial_memory(n, graph=True)`` (the default on CUDA); ``MemoryTransformer.step`` takes it as it
    takes an ``AgentMemory``, and ``state()`` / ``clone()`` are the same."""

    def __init__(self, model: nn.Module, n_envs: int, mem_len: int, device, dtype: torch.dtype, graph: bool):
        cfg: TransformerXLConfig = model.config
        dev = torch.device(device)
        check_fits(self.bytes_per_env(cfg, mem_len, element_size(dtype)) * n_envs, dev, n_envs, mem_len)
        read = Reading.of(None, cfg)
        super().__init__(cfg, n_envs, mem_len, dev, dtype, read.same_length, read.clamp_len, graph)
        self.n_envs, self.mem_len = n_envs, mem_len
        self.hidden = torch.zeros(cfg.n_layer, n_envs, self.slots, cfg.d_model, device=dev, dtype=dtype)  # [L, N, C, D]
        self.x = torch.zeros(n_envs, model.d_input, device=dev, dtype=dtype)  # the step's inputs (fixed buffers)
        self.reset = torch.zeros(n_envs, dtype=torch.bool, device=dev)
        self.weights: tuple | None = None  # (the key of the weights the keys, values and r_k were computed with)
        self.made_for = (cfg, model.d_input)  # (a model of this configuration may step it: a target network)

    @staticmethod
    def bytes_per_env(config: TransformerXLConfig, mem_len: int, element_size: int = 4) -> int:
        """Bytes one environment's ring takes: keys, values and layer inputs of mem_len + 1 slots, and a flag each."""
        per_slot = config.n_layer * (2 * config.n_head * config.d_head + config.d_model) * element_size + 1
        return (mem_len + 1) * per_slot

    # -- what MemoryTransformer calls ------------------------------------------------------------------------------

    def recompute(self, model: nn.Module) -> None:
        """The weights changed (an update, a loaded state, the first step): every slot's keys and values from the
        kept layer inputs, and W_kR R, by the attention's own modules, written in place (the graph reads these
        buffers)."""
        with torch.no_grad():
            for i, layer in enumerate(model.core.layers):
                kv = layer.attn.memory_keys_values(self.hidden[i])  # [2, N, H, C, Dh]
                self.k[i].copy_(kv[0])
                self.v[i].copy_(kv[1])
            self.positions(model.core.layers)

    def act(self, model: nn.Module, x: Tensor, reset: Tensor) -> Tensor:
        """One step of every environment (``x`` [N, d_input], ``reset`` [N] bool, checked by the caller, the model in
        eval mode and its cached terms fresh): the features [N, D]. A replay of the captured graph where it applies."""
        self.x.copy_(x)
        self.reset.copy_(reset)
        if not admitted("graph_act", model.core.layers, "layers"):
            return self._reference(model)
        # (the input layer is called by the step: a replay would not call a hook or an adapter put on it since)
        if not self.graph or torch.is_autocast_enabled(self.k.device.type) or not admitted("graph_act", model.embed):
            # (under autocast a weight's cast can be cached from before the capture: a replay would read it stale)
            return self.step(model)
        state = module_state(model)  # (the weights' addresses: a model moved by .to() or .data = is captured again)
        return self.replayed(lambda: self.step(model), state)

    def state(self, dtype: torch.dtype | None = None) -> MemoryState:
        """A copy of the memory now: each layer's input at the last ``mem_len`` steps, oldest first, and which of them
        are never attended (before the episode's start, or before the first step): ``AgentMemory.state()``'s."""
        M, C = self.mem_len, self.slots
        p = self.pos - M + torch.arange(M, device=self.pos.device)  # [M], the steps remembered
        idx = p.remainder(C)
        held = (p >= 0) & (self.slot_pos[idx] == p) & self.valid[:, idx]  # [N, M]
        hidden = self.hidden[:, :, idx].transpose(0, 1).masked_fill(~held[:, None, :, None], 0)  # [N, L, M, D]
        return MemoryState(hidden.to(dtype or hidden.dtype), ~held)

    def clone(self) -> RingMemory:
        """An independent copy (e.g. a step for a bootstrap value without moving this memory on); it steps eagerly
        (a graph captured for one step would cost more than it saves)."""
        copy = object.__new__(RingMemory)
        copy.__dict__.update(self.__dict__)
        for name in ("k", "v", "hidden", "slot_pos", "valid", "pos", "x", "reset", "r_k"):
            setattr(copy, name, getattr(self, name).clone())
        copy.graph, copy._replay, copy._captured, copy._out = False, None, None, None
        return copy

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.hidden, self.valid))

    # -- the step --------------------------------------------------------------------------------------------------

    def advance(self) -> Tensor:
        """The bookkeeping of a step: the environments that reset forget their memory (masked, and zeroed), then the
        newest slot ([1], on the device) takes step ``pos``."""
        gone = self.reset[:, None]  # [N, 1]
        self.valid.masked_fill_(gone, False)
        self.k.masked_fill_(gone[None, :, :, None, None], 0)  # (a masked key adds exactly 0, not 0 x NaN)
        self.v.masked_fill_(gone[None, :, :, None, None], 0)
        self.hidden.masked_fill_(gone[None, :, :, None], 0)
        return super().advance()

    @torch.no_grad()
    def step(self, model: nn.Module) -> Tensor:
        """The step on the buffers ``x`` and ``reset``: every layer over the ring, ``pos`` advanced; the features
        [N, D]. Only device tensors change (nothing is read back to the host): what the graph records."""
        core = model.core
        slot = self.advance()
        h = core.drop(model.embed(self.x))[:, None]  # [N, 1, D]
        biases = RelPartialLearnableMultiHeadAttn.biases(core)

        def keep(i: int, h: Tensor) -> None:  # (each layer's input, for state() and an update's recompute)
            self.hidden[i].index_copy_(1, slot, h)

        return core.drop(self.run(h, core.layers, biases, slot, before=keep))[:, 0]  # [N, D]

    def _reference(self, model: nn.Module) -> Tensor:
        """The step by the model's own modules (layers not stock: a hook, an adapter): ``window`` of one step from
        ``state()``, which computes what ``step`` computes; then the ring takes the new layer inputs, and the newest
        slot's keys and values by the attention's own ``memory_keys_values``."""
        with torch.no_grad():
            start = self.state()
            feats, end = model.window(self.x[:, None], self.reset[:, None], start, every_step=True)
            new = end.hidden[:, 0, :, -1].transpose(0, 1)  # [L, N, D], each layer's input at this step
            slot = self.advance()
            self.hidden.index_copy_(2, slot, new[:, :, None])
            for i, layer in enumerate(model.core.layers):
                kv = layer.attn.memory_keys_values(new[i][:, None])  # [2, N, H, 1, Dh]
                self.k[i].index_copy_(2, slot, kv[0])
                self.v[i].index_copy_(2, slot, kv[1])
            self.pos.add_(1)
        return feats[:, 0]
