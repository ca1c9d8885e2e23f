"""SwiGLU math and the fused gate/up layout, in plain torch (the reference the fused kernels are tested against).

Fused layout ("h13" / "W13"): the gate and up projections are concatenated along the feature dim, gate first:
``h13[..., :I]`` is the gate pre-activation g = x·w1ᵀ and ``h13[..., I:]`` the up projection u = x·w3ᵀ; likewise
``W13 = [w1; w3]`` stacked along the output-feature dim, shape (2I, D) (or (E, 2I, D) per expert).
:func:`pack_gate_up` and :func:`split_gate_up` are the only places that know this layout.

Math (fp32): ``h = silu(g) * u`` with ``silu(g) = g * sigmoid(g)``; backward with upstream ``dh``:
``dg = dh * u * silu'(g)``, ``silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))``, ``du = dh * silu(g)``.
"""

from __future__ import annotations

import torch

__all__ = ["pack_gate_up", "split_gate_up", "swiglu", "dswiglu"]


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack gate and up tensors of equal shape into the fused layout along ``dim``: ``dim=-1`` for activations
    (..., I) -> (..., 2I), ``dim=-2`` for weights (I, D) -> (2I, D) / (E, I, D) -> (E, 2I, D)."""
    return torch.cat([gate, up], dim=dim)


def split_gate_up(h13: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a fused tensor into (gate, up) views along ``dim`` (size 2I)."""
    n = h13.shape[dim]
    if n % 2:
        raise ValueError(f"fused gate/up dim must have even size 2I, got {n}")
    return h13.narrow(dim, 0, n // 2), h13.narrow(dim, n // 2, n // 2)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32 (returns fp32)."""
    g = gate.float()
    return g * torch.sigmoid(g) * up.float()


def dswiglu(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dgate, dup)`` of ``h = silu(gate) * up`` for upstream ``dh``, computed in fp32."""
    g, u, d = gate.float(), up.float(), dh.float()
    s = torch.sigmoid(g)
    silu = g * s
    dg = d * u * (s * (1.0 + g * (1.0 - s)))
    du = d * silu
    return dg, du
