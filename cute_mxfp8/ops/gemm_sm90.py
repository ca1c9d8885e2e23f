"""The ``sm90`` backend's GEMM op on the WGMMA kernels (:mod:`cute_mxfp8.kernels.gemm_sm90`): ``mm``, same signature
and outputs as the reference backend's.  :data:`MAINLOOP` picks the kernel: ``"dequant"`` (the default, bf16 WGMMA on
operands scaled on the fly, :class:`~cute_mxfp8.kernels.gemm_sm90.MXGemmSm90Dequant`) or ``"promote"`` (fp8 WGMMA
per MX block, :class:`~cute_mxfp8.kernels.gemm_sm90.MXGemmSm90`); both give the reference's result within the
bound ``tests/test_gemm_sm90.py`` states.

Inputs arrive checked by :mod:`cute_mxfp8.ops.library` (shapes, dtypes, devices, contiguous); :data:`LIMITS` adds
what the kernel needs beyond that (16-byte aligned operands for TMA, K > 0, 32-bit indexing) and refuses the call
with the reason otherwise.  The grouped GEMMs and the fused-epilogue ops have no SM90 kernel yet (the reference runs
them; an explicit ``backend="sm90"`` raises).
"""

from __future__ import annotations

import torch

from ..jit import compile_gemm_sm90
from .gemm_common import MAX_ELEMENTS, mm_with_bias, operand_limits

_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_OUT = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
MAINLOOP = "dequant"


def mm(a, a_scales, b, b_scales, out_dtype, bias=None):
    def run(d):
        fn = compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[d.dtype], MAINLOOP)
        fn(a, b, a_scales.view(torch.uint8), b_scales.view(torch.uint8), d)

    return mm_with_bias(run, a, b, out_dtype, bias)


def _mm_limits(a, a_scales, b, b_scales, out_dtype, bias=None):
    from ..kernels.gemm_sm90 import MXGemmSm90

    why = operand_limits(a, a_scales, b, b_scales)
    if why is None and a.shape[0] * b.shape[0] > MAX_ELEMENTS:
        return f"the output would have {a.shape[0] * b.shape[0]} elements; the kernel indexes with int32: split M"
    if why is None and a.shape[0] and b.shape[0]:  # an empty output launches nothing
        why = MXGemmSm90.can_implement(a.shape[0], b.shape[0], a.shape[1])
    return why


OPS = {"mm": mm}
LIMITS = {"mm": _mm_limits}
