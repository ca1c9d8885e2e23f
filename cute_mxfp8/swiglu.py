"""SwiGLU math and the fused gate/up layout, in plain torch (the reference the fused kernels are tested against).

Fused layout ("h13" / "W13"), two variants, both gate first:

* concatenated (``tile=None``, what the unfused MLP and the reference use): ``h13[..., :I]`` is the gate
  pre-activation g = x·w1ᵀ and ``h13[..., I:]`` the up projection u = x·w3ᵀ; likewise ``W13 = [w1; w3]`` stacked
  along the output-feature dim, shape (2I, D) (or (E, 2I, D) per expert).
* interleaved per tile (``tile=T``, the SM90 and SM100 GEMMs' fused SwiGLU epilogues, dense and grouped,
  ``T =`` :data:`GATE_UP_TILE`):
  feature chunk t of width 2T holds gate features ``[T t, T t + T)`` then the matching up features, so every
  GEMM N-tile of 128 (or 256) columns holds the gate and up columns of the same 64 (128) h columns.  Needs
  I % T == 0.  W13 rows, h13 / dh13 columns and W13-colwise columns all use it on that path.

:func:`pack_gate_up` and :func:`split_gate_up` are the only places that know these layouts.

Math (fp32): ``h = silu(g) * u`` with ``silu(g) = g * sigmoid(g)``; backward with upstream ``dh``:
``dg = dh * u * silu'(g)``, ``silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))``, ``du = dh * silu(g)``.
"""

from __future__ import annotations

import torch

from .formats import _as_int

__all__ = ["GATE_UP_TILE", "pack_gate_up", "split_gate_up", "convert_gate_up", "swiglu", "dswiglu"]

GATE_UP_TILE = 64  # h columns per gate (and per up) run of the interleaved layout; kernels/gemm_epilogue.py agrees


def _dim(t: torch.Tensor, dim: int) -> int:
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def _check_tile(n: int, tile: int | None, what: str) -> None:
    if tile is None:
        return
    tile = _as_int(tile, "the gate/up tile", "an int or None")  # (numpy / torch integers too)
    if tile <= 0:
        raise ValueError(f"the gate/up tile must be positive, got {tile}: the concatenated layout is tile=None here "
                         f"(ops.quantize_gate_up spells it gate_up_tile=0)")
    if n % tile:
        raise ValueError(f"{what} = {n} must be a multiple of the gate/up tile {tile} for the interleaved layout; "
                         f"pad I to a multiple of {tile} or use the concatenated layout (tile=None)")


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor, dim: int = -1, tile: int | None = None) -> torch.Tensor:
    """Pack gate and up tensors of equal shape into the fused layout along ``dim``: ``dim=-1`` for activations
    (..., I) -> (..., 2I), ``dim=-2`` for weights (I, D) -> (2I, D) / (E, I, D) -> (E, 2I, D).  ``tile=None``
    concatenates; ``tile=T`` interleaves runs of T gate and T up features (raises ValueError unless I % T == 0)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    dim = _dim(gate, dim)
    if tile is None:
        return torch.cat([gate, up], dim=dim)
    i = gate.shape[dim]
    _check_tile(i, tile, "I")
    chunks = (i // tile, tile)
    return torch.cat([gate.unflatten(dim, chunks), up.unflatten(dim, chunks)], dim=dim + 1).flatten(dim, dim + 1)


def split_gate_up(h13: torch.Tensor, dim: int = -1, tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a fused tensor (size 2I along ``dim``) into (gate, up): views for ``tile=None``, copies for the
    interleaved layout ``tile=T`` (raises ValueError unless I % T == 0)."""
    dim = _dim(h13, dim)
    n = h13.shape[dim]
    if n % 2:
        raise ValueError(f"fused gate/up dim must have even size 2I, got {n}")
    if tile is None:
        return h13.narrow(dim, 0, n // 2), h13.narrow(dim, n // 2, n // 2)
    _check_tile(n // 2, tile, "I")
    runs = h13.unflatten(dim, (n // (2 * tile), 2 * tile))
    return (runs.narrow(dim + 1, 0, tile).flatten(dim, dim + 1),
            runs.narrow(dim + 1, tile, tile).flatten(dim, dim + 1))


def convert_gate_up(w13: torch.Tensor, dim: int = -2, from_tile: int | None = None,
                    to_tile: int | None = GATE_UP_TILE) -> torch.Tensor:
    """Re-pack a fused gate/up tensor between layouts: concatenated (``None``: Hugging Face's ``gate_up_proj``,
    torchtitan, our reference), interleaved in runs of 64 (our SM100 fused GEMM, :data:`GATE_UP_TILE`) or of 32
    (cuDNN-frontend's fused SwiGLU GEMM).  ``dim=-2`` for weights (E, 2I, D) / (2I, D), ``-1`` for activations
    (..., 2I).  Exact (a permutation).  Raises ValueError if I is not a multiple of a tile."""
    return pack_gate_up(*split_gate_up(w13, dim, from_tile), dim, to_tile)


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
