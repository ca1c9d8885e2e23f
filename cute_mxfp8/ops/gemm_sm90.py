"""The ``sm90`` backend's GEMM op on the WGMMA kernel (:class:`cute_mxfp8.kernels.gemm_sm90.MXGemmSm90`): ``mm``,
same signature and outputs as the reference backend's.

Inputs arrive checked by :mod:`cute_mxfp8.ops.library` (shapes, dtypes, devices, contiguous); :data:`LIMITS` adds
what the kernel needs beyond that (16-byte aligned operands for TMA, K > 0, 32-bit indexing) and refuses the call
with the reason otherwise.  The grouped GEMMs and the fused-epilogue ops have no SM90 kernel yet (the reference runs
them; an explicit ``backend="sm90"`` raises).
"""

from __future__ import annotations

import torch

from ..jit import compile_gemm_sm90

_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_OUT = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_MAX_ELEMENTS = 2**31 - 1  # the kernel's coordinates and scale word offsets are 32-bit
N_TILE = 128


def mm(a, a_scales, b, b_scales, out_dtype, bias=None):
    """With a bias the kernel writes fp32 and the bias is added before the one rounding to ``out_dtype``."""
    acc_dtype = out_dtype if bias is None else torch.float32
    d = torch.empty(a.shape[0], b.shape[0], dtype=acc_dtype, device=a.device)
    if d.numel():
        fn = compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[acc_dtype], N_TILE)
        fn(a, b, a_scales.view(torch.uint8), b_scales.view(torch.uint8), d)
    if bias is not None:
        d = d.add_(bias.float()).to(out_dtype)
    return d


def _mm_limits(a, a_scales, b, b_scales, out_dtype, bias=None):
    from ..kernels.gemm_sm90 import MXGemmSm90

    for name, t in (("a", a), ("b", b), ("a_scales", a_scales), ("b_scales", b_scales)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} must be contiguous with a 16-byte aligned data pointer for TMA (call .contiguous())"
        if t.numel() > _MAX_ELEMENTS:
            return f"{name} has {t.numel()} elements; the kernel indexes with int32 (at most {_MAX_ELEMENTS})"
    if a.shape[0] * b.shape[0] > _MAX_ELEMENTS:
        return f"the output would have {a.shape[0] * b.shape[0]} elements; the kernel indexes with int32: split M"
    if a.shape[1] == 0:
        return "K = 0: nothing to multiply (the reference backend returns zeros)"
    if not a.shape[0] or not b.shape[0]:
        return None  # an empty output launches nothing
    return MXGemmSm90.can_implement(a.shape[0], b.shape[0], a.shape[1])


OPS = {"mm": mm}
LIMITS = {"mm": _mm_limits}
