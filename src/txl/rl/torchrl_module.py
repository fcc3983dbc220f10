"""txl's GTrXL as a TorchRL module: TensorDict in, TensorDict out, with the conventions of TorchRL's own recurrent
modules (``torchrl.modules.LSTMModule`` / ``GRUModule``), so that a TorchRL user swaps it in for an LSTM.
Design notes: docs/internals.md#txlrltorchrl_module."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase, dispatch
from torchrl.data.tensor_specs import Unbounded
from torchrl.modules import recurrent_mode

from txl.model.config import TransformerXLConfig
from txl.rl.memory import MemoryState, MemoryTransformer, gtrxl_config


class GTrXLModule(TensorDictModuleBase):
    """A TorchRL module of txl's ``MemoryTransformer`` (GTrXL by default).

    Give ``input_size`` and the model's sizes (``gtrxl_config``'s arguments: d_model, n_layer, n_head, mem_len, gate,
    ...), or a ``config``, or a built ``model``. ``in_key``/``out_key`` name the input and the features;
    ``memory_key``/``valid_key`` the state entries."""

    def __init__(
        self, input_size: int | None = None, *, in_key: str = "observation", out_key: str = "features",
        memory_key: str = "gtrxl_memory", valid_key: str = "gtrxl_valid", config: TransformerXLConfig | None = None,
        model: MemoryTransformer | None = None, default_recurrent_mode: bool | None = None, **sizes,
    ):  # fmt: skip
        super().__init__()
        if model is None:
            if input_size is None:
                raise ValueError("GTrXLModule needs input_size (the width of the input), or a model")
            model = MemoryTransformer(config or gtrxl_config(**sizes), input_size)
        elif config is not None or sizes or (input_size is not None and input_size != model.d_input):
            raise ValueError("GTrXLModule: give a model, or input_size with config / sizes, not both")
        self.model = model
        self.in_keys = [in_key, memory_key, valid_key, "is_init"]
        self.out_keys = [out_key, ("next", memory_key), ("next", valid_key)]
        self._recurrent_mode = default_recurrent_mode

    @property
    def recurrent_mode(self) -> bool:
        """Whether calls take [B, T] windows (TorchRL's ``set_recurrent_mode`` context, or the default given)."""
        mode = recurrent_mode()
        return bool(self._recurrent_mode) if mode is None else mode

    @property
    def memory_shape(self) -> tuple[int, int, int]:
        cfg = self.model.config
        return (cfg.n_layer, cfg.mem_len, cfg.d_model)

    def make_tensordict_primer(self):
        """The ``TensorDictPrimer`` that declares the memory entries to the environment (zeros: empty memory)."""
        from torchrl.envs.transforms.transforms import TensorDictPrimer

        L, M, D = self.memory_shape
        return TensorDictPrimer(
            {self.in_keys[1]: Unbounded(shape=(L, M, D)), self.in_keys[2]: Unbounded(shape=(M,), dtype=torch.bool)},
            expand_specs=True,
        )

    def _state(self, td: TensorDictBase, n: int) -> MemoryState:
        L, M, D = self.memory_shape
        w = self.model.embed.weight
        memory = td.get(self.in_keys[1], None)
        valid = td.get(self.in_keys[2], None)
        memory = torch.zeros(n, L, M, D, device=w.device, dtype=w.dtype) if memory is None else memory
        valid = torch.zeros(n, M, dtype=torch.bool, device=w.device) if valid is None else valid
        if tuple(memory.shape[-3:]) != (L, M, D) or tuple(valid.shape[-1:]) != (M,):
            raise ValueError(
                f"GTrXLModule: {self.in_keys[1]!r} must be [..., {L}, {M}, {D}] and {self.in_keys[2]!r} [..., {M}], "
                f"got {list(memory.shape)} and {list(valid.shape)} (the primer of make_tensordict_primer() makes them)"
            )
        return MemoryState(memory.reshape(n, L, M, D), ~valid.reshape(n, M).to(torch.bool))

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        shape = tensordict.shape
        if self.recurrent_mode:
            if len(shape) == 0:
                raise ValueError("GTrXLModule in recurrent mode needs a time dimension: a [B, T] or [T] tensordict")
            td = tensordict.unsqueeze(0) if len(shape) == 1 else tensordict.reshape(-1, shape[-1])  # [B, T]
            B, T = td.shape
            x, is_init = td.get(self.in_keys[0]), td.get("is_init").reshape(B, T)
            start = self._state(td[:, 0], B)
            feats, after = self.model.window(x, is_init, start, every_step=True)  # [B, T, D], memories [B, T, ...]
        else:
            td = tensordict.reshape(-1)  # [N]
            (N,) = td.shape
            x, is_init = td.get(self.in_keys[0]), td.get("is_init").reshape(N)
            feats, after = self.model.window(x[:, None], is_init[:, None], self._state(td, N))
            feats = feats[:, 0]
        td.set(self.out_keys[0], feats)
        td.set(self.out_keys[1], after.hidden)
        td.set(self.out_keys[2], ~after.invalid)
        if td is not tensordict:
            tensordict.update(td.reshape(shape))
        return tensordict
