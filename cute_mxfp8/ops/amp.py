"""``torch.autocast`` and this package: MXFP8 arithmetic is fixed by the MX numerics, so autocast changes no byte
of any op, and differentiable functions run in the autocast dtype only where ``F.linear`` would."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["autocast_off", "autocast_input"]


def autocast_off(device: torch.device):
    """A context with autocast disabled for ``device``'s type (a no-op context for types autocast does not know).

    Inside it the reference's fp32 matmuls stay fp32, and ``torch.cat`` / ``torch.stack`` of fp8 or E8M0 tensors
    never reach autocast's type promotion (which raises "Unexpected floating ScalarType" for them)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def autocast_input(x: Tensor) -> Tensor:
    """Under autocast, the activation in the autocast dtype, as ``F.linear`` would compute (weights are quantized
    from their own dtype either way); otherwise ``x`` itself."""
    dev = x.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x
