"""11. GTrXL (Parisotto et al., "Stabilizing Transformers for Reinforcement Learning", 2020): the gating layers that
replace the residual additions. With the identity-map reordering (``identity_map``: LayerNorm at each sub-module's
input, ReLU on its output) each layer computes, for its sub-modules f (the attention, then the feed-forward),
Design notes: docs/internals.md#txlmodelgating."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from txl.kernels.admission import stock
from txl.kernels.linear import project
from txl.model.config import TransformerXLConfig


@stock
class _Gate(nn.Module):
    """g(x, y) for x, y [B, T, D]; ``b_g`` [D] is learnt, initialised to ``cfg.gate_bias``."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.b_g = nn.Parameter(torch.full((cfg.d_model,), float(cfg.gate_bias)))


@stock
class GRUGate(_Gate):
    """r = σ(W_r y + U_r x), z = σ(W_z y + U_z x − b_g), ĥ = tanh(W_g y + U_g (r ⊙ x)), g = (1 − z) ⊙ x + z ⊙ ĥ."""

    formula = "gru"  # (what this class computes, for a kernel that computes it: this class's own, not a subclass's)

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        D = cfg.d_model
        self.w = nn.Linear(D, 3 * D, bias=False)  # rows [W_r; W_z; W_g], of y
        self.u = nn.Linear(D, 2 * D, bias=False)  # rows [U_r; U_z], of x
        self.u_g = nn.Linear(D, D, bias=False)  # U_g, of r ⊙ x

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        wr, wz, wg = project(self.w, y).chunk(3, dim=-1)  # [B, T, D] each
        ur, uz = project(self.u, x).chunk(2, dim=-1)
        r = torch.sigmoid(wr + ur)
        z = torch.sigmoid(wz + uz - self.b_g)
        h = torch.tanh(wg + project(self.u_g, r * x))
        return (1 - z) * x + z * h


@stock
class InputGate(nn.Module):
    """g = σ(W_g x) ⊙ x + y (no bias: it cannot start as the identity)."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.w = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return torch.sigmoid(project(self.w, x)) * x + y


@stock
class OutputGate(_Gate):
    """g = x + σ(W_g x − b_g) ⊙ y."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.w = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return x + torch.sigmoid(project(self.w, x) - self.b_g) * y


@stock
class HighwayGate(_Gate):
    """g = σ(W_g x + b_g) ⊙ x + (1 − σ(W_g x + b_g)) ⊙ y."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.w = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        c = torch.sigmoid(project(self.w, x) + self.b_g)
        return c * x + (1 - c) * y


@stock
class SigmoidTanhGate(_Gate):
    """g = x + σ(W_g y − b_g) ⊙ tanh(U_g y)."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.w = nn.Linear(cfg.d_model, 2 * cfg.d_model, bias=False)  # rows [W_g; U_g], of y

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        wg, ug = project(self.w, y).chunk(2, dim=-1)
        return x + torch.sigmoid(wg - self.b_g) * torch.tanh(ug)


GATES: dict[str, type[nn.Module]] = {
    "gru": GRUGate,
    "input": InputGate,
    "output": OutputGate,
    "highway": HighwayGate,
    "sigmoid_tanh": SigmoidTanhGate,
}


def make_gate(cfg: TransformerXLConfig) -> nn.Module | None:
    """The gate that joins a sub-module's output to the residual stream (None: the plain sum x + y)."""
    return None if cfg.gate == "residual" else GATES[cfg.gate](cfg)
