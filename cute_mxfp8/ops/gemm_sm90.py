"""The ``sm90`` backend's GEMM ops on the WGMMA kernels (:mod:`cute_mxfp8.kernels.gemm_sm90`): ``mm``, ``grouped_mm``
(2d-3d) and ``grouped_mm_wgrad`` (2d-2d), same signatures and outputs as the reference backend's. :data:`MAINLOOP`
picks the dense kernel: ``"dequant"`` (the default, bf16 WGMMA on operands scaled on the fly,
:class:`~cute_mxfp8.kernels.gemm_sm90.MXGemmSm90Dequant`) or ``"promote"`` (fp8 WGMMA per MX block,
:class:`~cute_mxfp8.kernels.gemm_sm90.MXGemmSm90`); both give the reference's result within the bound
``tests/test_gemm_sm90.py`` states.  The grouped GEMMs run the dequantize mainloop with its token-group scheduling
(``grouping="m"`` / ``"k"``), or with ``scale_block=128`` the promote kernel's grouped builds; the group offsets stay
on the device (no host sync in the launch path), so their values are not checked there:
:func:`~.gemm_common.device_offsets` clamps them into [0, T] and makes them non-decreasing first, which leaves valid
offsets unchanged and keeps every access in bounds for invalid ones (the reference backend and the modules validate
them and raise).

Inputs arrive checked by :mod:`cute_mxfp8.ops.library` (shapes, dtypes, devices, contiguous); :data:`LIMITS` adds
what the kernels need beyond that (16-byte aligned operands for TMA, K > 0, 32-bit indexing) and refuses the call
with the reason otherwise.  ``mm(..., scale_block=128)`` (the Hopper fast mode's operands, issue 16) runs
:class:`~cute_mxfp8.kernels.gemm_sm90.MXGemmSm90` with ``block_k=128`` (fp8 WGMMA, one promotion per 128 of K, 128 x
:data:`FAST_N_TILE` tiles), and so do ``grouped_mm(..., scale_block=128)`` (2d-3d, 128-row group tiles) and
``grouped_mm_wgrad(..., scale_block=128)`` (2d-2d on 128-aligned token groups).  The fused-epilogue ops
:func:`mm_swiglu_quant` / :func:`mm_dswiglu_quant` (dense and 2d-3d grouped) run the dequantize mainloop with the
same epilogue code as the SM100 kernel (:mod:`cute_mxfp8.kernels.gemm_epilogue`), so the SwiGLU MLP and the grouped
experts fuse on SM90 too.
"""

from __future__ import annotations

import functools

import torch

from ..swiglu import GATE_UP_TILE
from ..jit import compile_gemm_sm90
from .gemm_common import (MAX_ELEMENTS, mm_with_bias, offs_limits, operand_limits, run_grouped_mm,
                          run_mm_dswiglu_quant, run_mm_swiglu_quant, schedule_m, sm_count as _sm_count)
from .token_layout import run_wgrad, split_halves as _split_halves, wgrad_limits

_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_OUT = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
MAINLOOP = "dequant"
FAST_N_TILE = 192  # the fast mode's output tile N (128 x 192, two warpgroups in pingpong; measured fastest)
# with 128 x 128 B blocks the consumer warpgroups split M (each 64 x 192: one m64n192 WGMMA per K step), measured
# 4-5 % faster than splitting N (H200, 2026-12-02: 976 / 846 / 956 vs 933 / 812 / 919 TFLOP/s at 8192^3,
# 16384x7168x2048, 16384x2048x7168)
B2D_SPLIT = "m"
# the last round of tiles split along K when the tile count is not a multiple of the SMs (H200: 704 tiles of
# an M=8192 N=2048 GEMM ran 6 rounds for 5.33 rounds of work): kernels.tile_scheduler.tail_split
SPLIT_TAIL = True
_TILE_M = 256  # MXGemmSm90Dequant.TILE_M: the 2d-3d schedule counts each group's M tiles of this many rows
_FAST_TILE_M = 128  # MXGemmSm90.TILE_M: the fast mode's 2d-3d tiles
_MAX_GRID = 65535  # CUDA's grid y / z limit (N tiles; 2d-2d groups)
ALIGN = 16  # the 2d-2d kernel's token alignment of group starts (TMA; it masks past a group's end itself)


@functools.lru_cache(maxsize=None)
def _placeholders(device: torch.device):
    """(offs, sched) arguments of a dense launch (read by no thread)."""
    return torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(2, 1, dtype=torch.int32, device=device)


def _device(a: torch.Tensor) -> torch.device:
    return a.device if a.device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _persistent(a: torch.Tensor) -> dict:
    """The compile argument of the persistent plain-epilogue kernels: one CTA per SM of ``a``'s GPU."""
    return {"max_ctas": _sm_count(_device(a))}


def mm(a, a_scales, b, b_scales, out_dtype, bias=None, scale_block=32, b_blocks_2d=False):
    def run(d):
        if scale_block == 128:  # the fast mode: fp8 WGMMA, one promotion per 128 of K
            ctas = _sm_count(_device(a))
            tail, parts = _tail_split(a.shape[0], d.shape[1], a.shape[1], ctas)
            fn = compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[d.dtype], "promote", block_k=128,
                                   n_tile=FAST_N_TILE, max_ctas=ctas, **_b_blocks(b_blocks_2d),
                                   **_tma_store(b_blocks_2d, d.dtype, d.shape[1]),
                                   **({"split_tail": True} if parts > 1 else {}))
            scales = (a_scales.view(torch.uint8), b_scales.view(torch.uint8))
            if parts > 1:
                fn(a, b, *scales, d, *_split_buffers(d.device, tail * parts), tail, parts)
            else:
                fn(a, b, *scales, d)
            return
        fn = compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[d.dtype], MAINLOOP, **_persistent(a))
        if MAINLOOP == "promote":
            fn(a, b, a_scales.view(torch.uint8), b_scales.view(torch.uint8), d)
        else:
            fn(a, b, a_scales.view(torch.uint8), b_scales.view(torch.uint8), d, *_placeholders(a.device))

    return mm_with_bias(run, a, b, out_dtype, bias)


def grouped_mm(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, b_blocks_2d=False):
    """2d-3d: ``out[rows of group g] = a[rows of g] · b[g]ᵀ``; rows at or past ``offs[-1]`` are zero.  With
    ``scale_block=128`` the fast mode's kernel (fp8 WGMMA, one promotion per 128 of K, 128-row group tiles;
    ``b_blocks_2d``: the experts' 128 x 128 scale blocks, one FFMA per element and stage)."""
    if scale_block == 128:
        kernel = compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[out_dtype], "promote", grouping="m",
                                   block_k=128, n_tile=FAST_N_TILE, **_b_blocks(b_blocks_2d), **_persistent(a),
                                   **_tma_store(b_blocks_2d, out_dtype, b.shape[1]))
        return run_grouped_mm(kernel, a, a_scales, b, b_scales, offs, out_dtype, _FAST_TILE_M)
    kernel = compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[out_dtype], "dequant", grouping="m",
                               **_persistent(a))
    return run_grouped_mm(kernel, a, a_scales, b, b_scales, offs, out_dtype, _TILE_M)


def _tail_split(m: int, n: int, k: int, ctas: int) -> tuple[int, int]:
    """(tail tiles, parts) of the fast dense GEMM's split last round (:func:`~cute_mxfp8.kernels.tile_scheduler.
    tail_split`; (0, 1): the unsplit build) for an (M, K) x (N, K) problem on ``ctas`` SMs; :data:`SPLIT_TAIL` off:
    (0, 1)."""
    if not SPLIT_TAIL:
        return 0, 1
    from ..kernels.tile_scheduler import tail_split  # (the kernels import the DSL: not at this module's import)

    tiles = -(-m // _FAST_TILE_M) * -(-n // FAST_N_TILE)
    return tail_split(tiles, ctas, -(-k // 128))


_SPLIT_FLAGS: dict = {}  # (device, stream) -> int32 counters of the split tiles, all 0 between launches


def _split_buffers(device: torch.device, units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split tail's fp32 workspace (one 128 x FAST_N_TILE partial tile per unit; from the caching allocator,
    so stream- and graph-safe) and its counters: zeros made once per device and stream (the kernel leaves them
    0; launches on one stream never overlap, those on two streams get their own).  While a CUDA graph is being
    captured the counters are a fresh zeroed tensor of the call (the graph replays their fill), never the cache:
    a graph may replay on any stream."""
    ws = torch.empty(units * _FAST_TILE_M * FAST_N_TILE, dtype=torch.float32, device=device)
    if torch.cuda.is_current_stream_capturing():
        return ws, torch.zeros(_sm_count(device), dtype=torch.int32, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    flags = _SPLIT_FLAGS.get(key)
    if flags is None:
        flags = _SPLIT_FLAGS[key] = torch.zeros(_sm_count(device), dtype=torch.int32, device=device)
    return ws, flags


def _b_blocks(b_blocks_2d: bool) -> dict:
    """The fast GEMM's compile arguments for B's scale blocks: 1x128, or 128 x 128 (split M, :data:`B2D_SPLIT`)."""
    return {"b_block_n": 128, "consumer_split": B2D_SPLIT} if b_blocks_2d else {}


def _tma_store(b_blocks_2d: bool, out_dtype: torch.dtype, n: int) -> dict:
    """The split-M build's epilogue (dense and 2d-3d): the output tile staged in shared memory and TMA-stored
    (overlapping the next tile's mainloop) when D is bf16 with a 16-byte row pitch (``n`` columns, N % 8 == 0; D
    is a fresh allocation, so 16-byte aligned); else each thread stores its elements."""
    staged = b_blocks_2d and B2D_SPLIT == "m" and out_dtype == torch.bfloat16 and n % 8 == 0
    return {"tma_store": True} if staged else {}


# the fast 2d-2d wgrad (split N) stages its output tile in shared memory and TMA-stores it (bf16 output with a
# 16-byte row pitch), overlapping the next tile's mainloop; False: per-thread stores (tools/fast_mode_gemm.py times
# both)
WGRAD_TMA_STORE = True


def _wgrad_store(out_dtype: torch.dtype, k: int) -> dict:
    """The fast 2d-2d build's epilogue for a (G N, ``k``) output of ``out_dtype`` (:data:`WGRAD_TMA_STORE`)."""
    return {"tma_store": True} if WGRAD_TMA_STORE and out_dtype == torch.bfloat16 and k % 8 == 0 else {}


def _schedule_m(offs, t):
    """(safe offs, (2, G) schedule) of a 2d-3d launch over T = ``t`` rows, once per offsets tensor."""
    return schedule_m(offs, t, _TILE_M)


def grouped_mm_wgrad(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, split_halves=False):
    """2d-2d: ``out[g] = a[:, tokens of g] · b[:, tokens of g]ᵀ`` (G, N, K); an empty group's slice is zero.

    The token-major operands are first gathered so that every group starts on a 16-aligned column
    (:mod:`.token_layout`; one pass over both, on the device): the kernel's TMA loads need it and group sizes are
    arbitrary.  Operands whose groups already are aligned (``token_align`` casts on their padded offsets, with
    known host values) are read as they are.  ``scale_block=128``: the fast mode's kernel on 128-aligned groups (fp8 WGMMA, one promotion per
    128 tokens).  ``split_halves``: the fast mode's kernel writes the (2, G, N / 2, K) layout directly; the
    dequantize kernel's output is rearranged by one copy (its 256-row tiles would straddle the halves)."""
    def build():
        if scale_block == 128:
            return compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[out_dtype], "promote", grouping="k",
                                     block_k=128, n_tile=FAST_N_TILE, split_halves=split_halves, **_persistent(a),
                                     **_wgrad_store(out_dtype, b.shape[0]))
        return compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[out_dtype], "dequant", grouping="k",
                                 **_persistent(a))

    d = run_wgrad(build, a, a_scales, b, b_scales, offs, out_dtype, _align(scale_block), "sm_90a")
    if not split_halves:
        return d
    if scale_block == 128:  # the same buffer, written in the halves' layout (zeros for T = 0 or G = 0 either way)
        g, n, k = d.shape
        return d.view(2, g, n // 2, k)
    return _split_halves(d)


def _align(scale_block: int) -> int:
    """Token alignment of the 2d-2d operands' groups: :data:`ALIGN`, or 128 in the fast mode (every 128-deep
    stage then holds one scale block of one group; the columns past a group's end are zeros)."""
    return 128 if scale_block == 128 else ALIGN


def mm_swiglu_quant(a, a_scales, b13, b13_scales, scale_mode, elem_dtype, emit_hp, out_dtype, offs=None):
    """GEMM1 with the SwiGLU + dual-quant epilogue (W13 interleaved in runs of 64; with ``offs`` the 2d-3d
    grouped GEMM, b13 (E, 2I, K)): the outputs of the reference's ``mm_swiglu_quant``."""
    kernel = _fused_kernel(a, b13, out_dtype, "swiglu", elem_dtype, scale_mode, emit_hp, offs is not None)
    return run_mm_swiglu_quant(kernel, a, a_scales, b13, b13_scales, elem_dtype, emit_hp, out_dtype,
                               *_group_args(a, offs))


def mm_dswiglu_quant(a, a_scales, b, b_scales, h13, scale_mode, elem_dtype, emit_hp, offs=None):
    """w2 dgrad with the dSwiGLU + dual-quant epilogue (with ``offs`` 2d-3d, b (E, I, K)): the outputs of the
    reference's ``mm_dswiglu_quant``."""
    kernel = _fused_kernel(a, b, h13.dtype, "dswiglu", elem_dtype, scale_mode, emit_hp, offs is not None)
    return run_mm_dswiglu_quant(kernel, a, a_scales, b, b_scales, h13, elem_dtype, emit_hp, *_group_args(a, offs))


def _group_args(a, offs):
    """(extra kernel arguments, group count) of a fused launch: the device-side groups, or placeholders."""
    if offs is None:
        return _placeholders(a.device), None
    return _schedule_m(offs, a.shape[0]), offs.numel()


def _fused_kernel(a, b, out_dtype, epilogue, elem_dtype, scale_mode, emit_hp, grouped=False):
    return compile_gemm_sm90(_ELEM[a.dtype], _ELEM[b.dtype], _OUT[out_dtype], "dequant",
                             grouping="m" if grouped else "none", epilogue=epilogue, cast_elem=_ELEM[elem_dtype],
                             scale_mode=scale_mode, emit_hp=emit_hp)


def _mm_limits(a, a_scales, b, b_scales, out_dtype, bias=None, scale_block=32, b_blocks_2d=False):
    from ..kernels.gemm_sm90 import MXGemmSm90

    why = operand_limits(a, a_scales, b, b_scales)
    if why is None and a.shape[0] * b.shape[0] > MAX_ELEMENTS:
        return f"the output would have {a.shape[0] * b.shape[0]} elements; the kernel indexes with int32: split M"
    if why is None and a.shape[0] and b.shape[0]:  # an empty output launches nothing
        why = MXGemmSm90.can_implement(a.shape[0], b.shape[0], a.shape[1])
    return why


def _grouped_mm_limits(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, b_blocks_2d=False):
    why = offs_limits(offs) or operand_limits(a, a_scales, b, b_scales)
    t, n = a.shape[0], b.shape[1]
    if why is None and t * n > MAX_ELEMENTS:
        return f"the output would have {t * n} elements; the kernel indexes with int32: split the tokens"
    if why is None and (n + 127) // 128 > _MAX_GRID:
        return f"N = {n} needs more than {_MAX_GRID} 128-column tiles"
    return why


def _grouped_mm_wgrad_limits(a, a_scales, b, b_scales, offs, out_dtype, scale_block=32, split_halves=False):
    why = wgrad_limits(a, a_scales, b, b_scales, offs, _align(scale_block))
    g, k = offs.shape[0], b.shape[0]
    if why is None and (g > _MAX_GRID or (k + 127) // 128 > _MAX_GRID):
        return f"{g} groups or K = {k} exceed the grid limit ({_MAX_GRID} groups, 128-column tiles)"
    return why


def _fused_limits(a, a_scales, b, b_scales, n_out: int, out_rows_elems: int) -> str | None:
    why = operand_limits(a, a_scales, b, b_scales)
    if why is None and n_out % (2 * GATE_UP_TILE):
        return (f"the fused SwiGLU epilogues need I % {GATE_UP_TILE} == 0 (one 128-column tile = 64 gate + 64 up "
                f"features), got 2I = {n_out}")
    if why is None and out_rows_elems > MAX_ELEMENTS:
        return f"an output would have {out_rows_elems} elements; the kernel indexes with int32: split M"
    return why


def _mm_swiglu_limits(a, a_scales, b13, b13_scales, scale_mode, elem_dtype, emit_hp, out_dtype, offs=None):
    return offs_limits(offs) or _fused_limits(a, a_scales, b13, b13_scales, b13.shape[-2],
                                              a.shape[0] * b13.shape[-2])


def _mm_dswiglu_limits(a, a_scales, b, b_scales, h13, scale_mode, elem_dtype, emit_hp, offs=None):
    why = offs_limits(offs) or _fused_limits(a, a_scales, b, b_scales, 2 * b.shape[-2], 2 * a.shape[0] * b.shape[-2])
    if why is None and (not h13.is_contiguous() or h13.data_ptr() % 16):
        return "h13 must be contiguous with a 16-byte aligned data pointer (call .contiguous())"
    return why


FUSED_OPS = {"mm_swiglu_quant": mm_swiglu_quant, "mm_dswiglu_quant": mm_dswiglu_quant}
FUSED_GROUPED = True  # they take offs (2d-3d): the grouped SwiGLU MLP fuses too
FUSED_LIMITS = {"mm_swiglu_quant": _mm_swiglu_limits, "mm_dswiglu_quant": _mm_dswiglu_limits}
OPS = {"mm": mm, "grouped_mm": grouped_mm, "grouped_mm_wgrad": grouped_mm_wgrad, **FUSED_OPS}
LIMITS = {"mm": _mm_limits, "grouped_mm": _grouped_mm_limits, "grouped_mm_wgrad": _grouped_mm_wgrad_limits,
          **FUSED_LIMITS}
