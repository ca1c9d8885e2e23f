"""``torch.autocast`` and this package: MXFP8 arithmetic is fixed by the MX numerics, so autocast changes no byte
of any op, and differentiable functions run in the autocast dtype only where ``F.linear`` would."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["autocast_off", "autocast_input"]


def _autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``.  CPU and CUDA always have autocast, so their check skips
    ``torch.amp.is_autocast_available``, which torch.compile could not trace before torch 2.13 (a graph break,
    and ``fullgraph=True`` failed); other types ask it first (``is_autocast_enabled`` raises for unknown ones)."""
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def autocast_off(device: torch.device):
    """A context with autocast disabled for ``device``'s type (a no-op context for types autocast does not know).

    Inside it the reference's fp32 matmuls stay fp32, and ``torch.cat`` / ``torch.stack`` of fp8 or E8M0 tensors
    never reach autocast's type promotion (which raises "Unexpected floating ScalarType" for them)."""
    if _autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()  # nothing to turn off (and ~15 us of host time per op call saved)


def autocast_input(x: Tensor) -> Tensor:
    """Under autocast, the activation in the autocast dtype, as ``F.linear`` would compute (weights are quantized
    from their own dtype either way); otherwise ``x`` itself.  Raises ValueError for an autocast dtype other than
    bf16 (fp16 has no MXFP8 path here)."""
    dev = x.device.type
    if not _autocast_enabled(dev):
        return x
    dtype = torch.get_autocast_dtype(dev)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"cute_mxfp8 MXFP8 layers run under torch.autocast(dtype=torch.bfloat16) (or without "
                         f"autocast), got autocast dtype {dtype}: use bf16 autocast, or keep this layer out of "
                         "MXFP8 (convert_to_mxfp8(..., filter_fn=...))")
    return x.to(dtype)
