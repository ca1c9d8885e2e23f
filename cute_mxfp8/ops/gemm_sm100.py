"""The ``sm100`` backend's GEMM ops on the tcgen05 kernel (:class:`cute_mxfp8.kernels.gemm_sm100.MXGemmSm100`):
``mm``, ``mm_swiglu_quant``, ``mm_dswiglu_quant`` (dense, and 2d-3d with ``offs``), ``grouped_mm`` (2d-3d) and
``grouped_mm_wgrad`` (2d-2d), offsets read on the device only, same signatures and outputs as the reference
backend's.

Inputs arrive checked by :mod:`cute_mxfp8.ops.library` (shapes, dtypes, devices); :data:`LIMITS` adds what the
kernel needs beyond that (contiguous 16-byte aligned operands for TMA, D's row alignment, K > 0, 32-bit indexing)
and refuses the call with the reason otherwise.  The compiled kernel trusts its arguments, so nothing reaches it
unchecked.  No SM100 GPU has run these yet (``tests/test_gemm_sm100.py`` has the tests for the day one does).
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..jit import SM100_TARGET, compile_gemm_sm100
from .gemm_common import (MAX_ELEMENTS, mm_with_bias, offs_limits, operand_limits, run_grouped_mm,
                          run_mm_dswiglu_quant, run_mm_swiglu_quant, schedule_m)
from .token_layout import run_wgrad, split_halves as _split_halves, wgrad_limits

_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_OUT = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# The configuration the ops run: a 2-CTA MMA (256 x 128 tiles over a CTA pair, each CTA loading half of B) with two
# TMEM accumulator stages, so each tile's epilogue overlaps the next tile's mainloop; the (2, 2) cluster multicasts
# A to two pairs, cutting L2 traffic to the ratio of a 256 x 256 tile (docs/sm100_gemm.md).  Unmeasured: no SM100.
N_TILE, CTA_PAIR, CLUSTER_MN = 128, True, (2, 2)
_MMA_M = 256 if CTA_PAIR else 128  # rows of an MMA tile: each token group starts on a fresh one


# The 2d-2d (wgrad) kernel: 1-CTA MMAs on 128 x 128 tiles (a stage's scales are one 512-byte tile of a group), A
# multicast to the two N-neighbouring CTAs of a (1, 2) cluster; operands gathered to 32-aligned zero-padded groups.
WGRAD_CLUSTER_MN, WGRAD_ALIGN = (1, 2), 32


@functools.lru_cache(maxsize=None)
def max_ctas(device: torch.device, cluster_mn: tuple = CLUSTER_MN) -> int:
    """CTAs of the persistent grid on ``device``: the clusters of ``cluster_mn`` that can be resident at once
    (CUDA's occupancy query for a kernel using all shared memory, through ``cutlass.utils.HardwareInfo``) times the
    cluster size, so no cluster waits for a second wave.  If the query fails, the SM count rounded down to whole
    clusters, with a warning."""
    size = cluster_mn[0] * cluster_mn[1]
    try:
        from cutlass.utils import HardwareInfo

        with torch.cuda.device(device):  # the query runs in the current CUDA context
            clusters = HardwareInfo(device.index).get_max_active_clusters(size)
    except Exception as e:  # noqa: BLE001 -- any driver/DSL failure: fall back to the SM count
        clusters = torch.cuda.get_device_properties(device).multi_processor_count // size
        warnings.warn(f"cute_mxfp8: occupancy query for {size}-CTA clusters failed ({e}); assuming {clusters} "
                      "resident clusters", RuntimeWarning, stacklevel=2)
    return max(1, clusters) * size


def _device(t: torch.Tensor) -> torch.device:
    return t.device if t.device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _kernel(a, b, out_dtype, epilogue="plain", elem_dtype=torch.float8_e4m3fn, scale_mode="rceil", emit_hp=False,
            grouped=False):
    return compile_gemm_sm100(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[out_dtype], N_TILE, SM100_TARGET, False,
                              max_ctas(_device(a)), epilogue, _ELEM[elem_dtype], scale_mode, emit_hp, CTA_PAIR,
                              CLUSTER_MN, "m" if grouped else "none")


def _group_args(a, offs):
    """(extra kernel arguments, group count) of a fused launch: the device-side groups, or none."""
    if offs is None:
        return (), None
    return schedule_m(offs, a.shape[0], _MMA_M), offs.numel()


def mm(a, a_scales, b, b_scales, out_dtype, bias=None, scale_block=32, b_blocks_2d=False):
    """With a bias the kernel stores its fp32 accumulator and the bias is added before the one rounding to
    ``out_dtype`` (the plain epilogue has no bias input yet: an extra pass over D).  ``scale_block`` and
    ``b_blocks_2d`` (the SM90 fast mode's hints, here and in the grouped GEMMs) change nothing: the tcgen05 MMA
    applies every MX scale."""
    return mm_with_bias(lambda d: _kernel(a, b, d.dtype)(a, b, _u8(a_scales), _u8(b_scales), d), a, b, out_dtype,
                        bias)


def grouped_mm(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, b_blocks_2d=False):
    """2d-3d: ``out[rows of group g] = a[rows of g] · b[g]ᵀ``; rows at or past ``offs[-1]`` are zero.  The offsets
    stay on the device (clamped and made non-decreasing there, :func:`.gemm_common.device_offsets`)."""
    return run_grouped_mm(_kernel(a, b, out_dtype, grouped=True), a, a_scales, b, b_scales, offs, out_dtype, _MMA_M)


def grouped_mm_wgrad(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, split_halves=False):
    """2d-2d: ``out[g] = a[:, tokens of g] · b[:, tokens of g]ᵀ`` (G, N, K); an empty group's slice is zero.  The
    token-major operands are first gathered into 32-aligned, zero-padded groups (:mod:`.token_layout`, one pass
    on the device), so every MX block the kernel multiplies holds only its group's tokens."""
    def build():
        return compile_gemm_sm100(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[out_dtype], N_TILE, SM100_TARGET, False,
                                  max_ctas(_device(a), WGRAD_CLUSTER_MN), "plain", "e4m3", "rceil", False, False,
                                  WGRAD_CLUSTER_MN, "k")

    d = run_wgrad(build, a, a_scales, b, b_scales, offs, out_dtype, WGRAD_ALIGN, SM100_TARGET)
    return _split_halves(d) if split_halves else d


def mm_swiglu_quant(a, a_scales, b13, b13_scales, scale_mode, elem_dtype, emit_hp, out_dtype, offs=None):
    """GEMM1 with the SwiGLU + dual-quant epilogue; with ``offs`` the 2d-3d grouped GEMM (b13 (E, 2I, K))."""
    kernel = _kernel(a, b13, out_dtype, "swiglu", elem_dtype, scale_mode, emit_hp, offs is not None)
    return run_mm_swiglu_quant(kernel, a, a_scales, b13, b13_scales, elem_dtype, emit_hp, out_dtype,
                               *_group_args(a, offs))


def mm_dswiglu_quant(a, a_scales, b, b_scales, h13, scale_mode, elem_dtype, emit_hp, offs=None):
    """GEMM3 with the dSwiGLU + dual-quant epilogue; with ``offs`` the 2d-3d grouped GEMM (b (E, I, D))."""
    kernel = _kernel(a, b, h13.dtype, "dswiglu", elem_dtype, scale_mode, emit_hp, offs is not None)
    return run_mm_dswiglu_quant(kernel, a, a_scales, b, b_scales, h13, elem_dtype, emit_hp, *_group_args(a, offs))


def _mm_limits(a, a_scales, b, b_scales, out_dtype, bias=None, scale_block=32, b_blocks_2d=False):
    return _gemm_limits(a, a_scales, b, b_scales, out_dtype if bias is None else torch.float32, "plain")


def _gemm_limits(a, a_scales, b, b_scales, out_dtype, epilogue):
    from ..kernels.gemm_sm100 import MXGemmSm100

    why = operand_limits(a, a_scales, b, b_scales)
    n = b.shape[-2]  # (N, K), or (E, N, K) with token groups
    if why is None and a.shape[0] and n:  # an empty output launches nothing
        why = MXGemmSm100.can_implement(a.shape[0], n, a.shape[1], _OUT[out_dtype], epilogue)
    return why


def _mm_swiglu_limits(a, a_scales, b13, b13_scales, scale_mode, elem_dtype, emit_hp, out_dtype, offs=None):
    why = offs_limits(offs) or _gemm_limits(a, a_scales, b13, b13_scales, out_dtype, "swiglu")
    if why is None and a.shape[0] * b13.shape[-2] > MAX_ELEMENTS:
        return f"h13 would have {a.shape[0] * b13.shape[-2]} elements; the kernel indexes with int32: split M"
    return why


def _mm_dswiglu_limits(a, a_scales, b, b_scales, h13, scale_mode, elem_dtype, emit_hp, offs=None):
    why = offs_limits(offs) or _gemm_limits(a, a_scales, b, b_scales, h13.dtype, "dswiglu")
    if why is None and (not h13.is_contiguous() or h13.data_ptr() % 16):
        return "h13 must be contiguous with a 16-byte aligned data pointer (call .contiguous())"
    if why is None and h13.numel() > MAX_ELEMENTS:
        return f"h13 has {h13.numel()} elements; the kernel indexes with int32: split M"
    return why


def _grouped_mm_limits(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, b_blocks_2d=False):
    why = offs_limits(offs) or _gemm_limits(a, a_scales, b, b_scales, out_dtype, "plain")
    t, n = a.shape[0], b.shape[-2]
    if why is None and t * n > MAX_ELEMENTS:
        return f"the output would have {t * n} elements; the kernel indexes with int32: split the tokens"
    return why


def _grouped_mm_wgrad_limits(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, split_halves=False):
    why = wgrad_limits(a, a_scales, b, b_scales, offs, WGRAD_ALIGN)
    k, vec = b.shape[0], 16 // out_dtype.itemsize
    if why is None and k % vec:
        return f"K = {k} must be a multiple of {vec} for 16-byte aligned rows of the {out_dtype} output"
    return why


FUSED_GROUPED = True  # the fused ops take offs (2d-3d): the grouped SwiGLU MLP fuses too
OPS = {"mm": mm, "mm_swiglu_quant": mm_swiglu_quant, "mm_dswiglu_quant": mm_dswiglu_quant, "grouped_mm": grouped_mm,
       "grouped_mm_wgrad": grouped_mm_wgrad}
LIMITS = {"mm": _mm_limits, "mm_swiglu_quant": _mm_swiglu_limits, "mm_dswiglu_quant": _mm_dswiglu_limits,
          "grouped_mm": _grouped_mm_limits, "grouped_mm_wgrad": _grouped_mm_wgrad_limits}
