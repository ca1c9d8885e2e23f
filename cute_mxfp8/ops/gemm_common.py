"""What the kernel backends' GEMM ops share: the operand limits of TMA-fed kernels and the bias rule (one rounding
after an fp32 bias add) for kernels whose epilogue has no bias input."""

from __future__ import annotations

from typing import Callable

import torch

MAX_ELEMENTS = 2**31 - 1  # the kernels' coordinates and scale offsets are 32-bit


def operand_limits(a, a_scales, b, b_scales) -> str | None:
    """Why a TMA-fed GEMM kernel cannot take these operands (None: it can)."""
    for name, t in (("a", a), ("b", b), ("a_scales", a_scales), ("b_scales", b_scales)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} must be contiguous with a 16-byte aligned data pointer for TMA (call .contiguous())"
        if t.numel() > MAX_ELEMENTS:
            return f"{name} has {t.numel()} elements; the kernel indexes with int32 (at most {MAX_ELEMENTS})"
    if a.shape[1] == 0:
        return "K = 0: nothing to multiply (the reference backend returns zeros, plus the bias if given)"
    return None


def mm_with_bias(run: Callable[[torch.Tensor], None], a, b, out_dtype, bias) -> torch.Tensor:
    """D (M, N) in ``out_dtype`` written by ``run(d)``; with a bias the kernel writes fp32 and the bias is added
    before the one rounding to ``out_dtype`` (as the reference and cuBLAS's bias epilogue)."""
    d = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype if bias is None else torch.float32, device=a.device)
    if d.numel():
        run(d)
    if bias is not None:
        d = d.add_(bias.float()).to(out_dtype)
    return d
