"""MXFP8 device math for CuTe DSL kernels and GEMM epilogues: E8M0 block scales, the element scaling, amax
reductions across lanes, token-group lookups and the SwiGLU forward/backward.  Device functions only (``@cute.jit``,
inlined where called), no kernel or launch code, so the standalone kernels (:mod:`.quantize`,
:mod:`.quantize_tile`) and later GEMM epilogues call the very same code.

The numerics are those of ``cute_mxfp8.formats`` (OCP MX v1.0), computed with integer
operations on fp32 bits so they are exact and NaN-safe:

* ``amax_bits = max(bits(x) & 0x7FFFFFFF)`` over the block: for non-negative floats the integer order is the float
  order, and any NaN payload compares above +Inf, so a block with a NaN or an Inf has exponent field 255.
* With ``E`` the exponent field and ``Mt`` the mantissa field of ``amax_bits`` and ``emax`` = 8 (e4m3) / 15
  (e5m2), both element maxima being ``1.75 * 2**emax``:
  ``floor``: ``byte = E - emax``;  ``rceil``: ``byte = E - emax + (Mt > 0x600000)`` (the smallest power of two
  >= amax / max); both clamped below at 0 (so 0 when ``E == 0``: zero or subnormal amax), 255 when ``E == 255``.
  A finite block's byte is at most 247, so ``2**(127 - byte)`` is a normal fp32 number.
* Elements ``x * 2**(127 - byte)`` (one exact multiply), converted with ``cvt.rn.satfinite`` (round to nearest
  even, saturating to +-max, which is the clamp); a 255 block multiplies by NaN, so every element is NaN (0x7F).

SwiGLU (``cute_mxfp8.swiglu``): ``s = 1 / (1 + exp(-g))``, ``h = (g * s) * u``; backward
``dg = (dh * u) * (s * (1 + g * (1 - s)))``, ``du = dh * (g * s)``, in fp32 in the reference's operation order
(the reciprocal correctly rounded without a branch, :func:`sigmoid`; ``exp`` is the DSL's, not torch's, so an
element may land one fp8 code away from the reference's, rarely: the bound the GPU tests hold).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

BLOCK = 32  # MX block size (OCP MX v1.0)
ELEM_DTYPES = {"e4m3": (cutlass.Float8E4M3FN, 8), "e5m2": (cutlass.Float8E5M2, 15)}  # dtype, emax
GEMM_OUT_DTYPES = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}


def gemm_dtypes(a_elem: str, b_elem: str, out_dtype: str):
    """(A, B, D) DSL dtypes of an MXFP8 GEMM from their names (host side, for the kernel classes' constructors).
    Raises ValueError naming the choices."""
    if a_elem not in ELEM_DTYPES or b_elem not in ELEM_DTYPES:
        raise ValueError(f"A/B element types must be in {sorted(ELEM_DTYPES)}, got {a_elem!r}, {b_elem!r}")
    if out_dtype not in GEMM_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {sorted(GEMM_OUT_DTYPES)}, got {out_dtype!r}")
    return ELEM_DTYPES[a_elem][0], ELEM_DTYPES[b_elem][0], GEMM_OUT_DTYPES[out_dtype]


def blocked_scale_offset(r, c, cols):
    """Byte offset of scale (r, c) of an (R, cols) scale matrix in the blocked tcgen05/cuBLAS layout."""
    return ((r // 128) * ((cols + 3) // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def grouped_k_scale_offset(r, b, tile0, tiles, rows):
    """Byte offset of the scale of row ``r`` and block ``b`` of a token group in the grouped-K blocked layout
    (:func:`cute_mxfp8.formats.to_blocked_scales_grouped_k`, the order of ``torch._scaled_grouped_mm``): the group's
    (``rows``, 4 * ``tiles``) scale matrix blocked on its own, from tile ``ceil(rows / 128) * tile0``; ``tile0`` is
    the group's ``group_tile_starts`` entry, ``tiles`` = ceil(size / 128)."""
    return ((rows + 127) // 128) * tile0 * 512 + blocked_scale_offset(r, b, 4 * tiles)


@cute.jit
def block_scale(amax_bits: cutlass.Int32, emax: cutlass.Constexpr[int], rceil: cutlass.Constexpr[bool]):
    """E8M0 scale of a block from ``amax_bits`` (the largest ``bits(x) & 0x7FFFFFFF`` of the block) ->
    (scale byte as Int32, fp32 factor ``2**(127 - byte)``, or NaN for byte 255).

    For a finite block the byte is at most 254 - emax + 1 (<= 247), so the factor is a normal fp32 number and one
    multiply scales an element exactly (up to results below 2**-126, which round to zero in fp8 either way)."""
    e = amax_bits >> 23
    byte = e - emax
    if cutlass.const_expr(rceil):
        byte = byte + cutlass.Int32((amax_bits & 0x7FFFFF) > 0x600000)
    byte = cutlass.max(byte, cutlass.Int32(0))  # zero / subnormal amax (e == 0) lands here too
    factor_bits = (254 - byte) << 23
    if e == 255:
        byte = cutlass.Int32(255)
        factor_bits = cutlass.Int32(0x7FC00000)  # NaN: every element of a poisoned block becomes NaN
    return byte, factor_bits.bitcast(cutlass.Float32)


@cute.jit
def e8m0_to_f32(byte: cutlass.Int32):
    """The fp32 value ``2**(byte - 127)`` of an E8M0 scale byte (0..255), as ``formats.e8m0_to_float``: byte 0 is
    ``2**-127`` (a subnormal, never 0.0), byte 255 NaN; every other byte is the exponent field of a normal float."""
    bits = byte << 23
    if byte == 0:
        bits = cutlass.Int32(0x00400000)
    if byte == 255:
        bits = cutlass.Int32(0x7FC00000)
    return bits.bitcast(cutlass.Float32)


@cute.jit
def apply_scale(xv: cute.TensorSSA, factor: cutlass.Float32):
    """Scaled fp32 elements of a block, ready for the fp8 conversion.  No clamp is needed: the conversion is
    ``cvt.rn.satfinite`` (round to nearest even, finite overflow saturates to +-max, NaN stays NaN)."""
    return xv * factor


@cute.jit
def abs_bits_max(xv: cute.TensorSSA, n: cutlass.Constexpr[int]):
    """``max(bits(x) & 0x7FFFFFFF)`` over the ``n`` fp32 elements of ``xv`` (integer order == float order for
    magnitudes; NaN payloads compare above +Inf)."""
    mag = xv.bitcast(cutlass.Int32) & 0x7FFFFFFF
    amax_bits = cutlass.Int32(0)
    for i in cutlass.range_constexpr(n):
        amax_bits = cutlass.max(amax_bits, cutlass.Int32(mag[i]))
    return amax_bits


@cute.jit
def quantize_block(xv: cute.TensorSSA, emax: cutlass.Constexpr[int], rceil: cutlass.Constexpr[bool]):
    """MXFP8-quantize one block: ``xv`` a 32-element fp32 TensorSSA -> (fp32 TensorSSA of the scaled elements, NaN
    for a poisoned block, for the saturating fp8 conversion; E8M0 scale byte as Int32).  Device code, inlined where it is called; the
    rules are in this module's docstring."""
    byte, factor = block_scale(abs_bits_max(xv, BLOCK), emax, rceil)
    return apply_scale(xv, factor), byte


@cute.jit
def group_of_row(r: cutlass.Int32, offs: cute.Tensor, num_groups: cutlass.Int32):
    """Index of the token group holding row ``r`` (``num_groups`` if ``r >= offs[-1]``): the smallest g with
    ``offs[g] > r``, a binary search over the cumulative ends, 17 fixed steps (up to 131071 groups; the ops layer
    allows 65536).  Any non-decreasing cumulative ends serve: the grouped GEMMs pass per-group tile counts (tile
    ``r``'s group) or 16-aligned column ends (column ``r``'s group)."""
    lo = cutlass.Int32(0)
    hi = num_groups
    for _ in cutlass.range_constexpr(17):
        if lo < hi:
            mid = (lo + hi) // 2
            if offs[mid] <= r:
                lo = mid + 1
            else:
                hi = mid
    return lo


@cute.jit
def group_start(offs: cute.Tensor, g: cutlass.Int32):
    """First row (token) of token group ``g``: ``offs[g - 1]``, 0 for the first group (``offs`` holds the groups'
    cumulative END offsets)."""
    start = cutlass.Int32(0)
    if g > 0:
        start = offs[g - 1]
    return start


@cute.jit
def group_origin(g: cutlass.Int32, offs: cute.Tensor, sched: cute.Tensor):
    """2d-3d grouped GEMMs: (first row, M tiles of the groups before it) of group ``g`` in ``[0, size(offs)]``,
    with ``sched[0]`` the groups' cumulative tile counts; ``g = size(offs)`` is the tail past the last group,
    starting at ``offs[-1]`` (0 without groups)."""
    start = cutlass.Int32(0)
    before = cutlass.Int32(0)
    if g > 0:
        start = offs[g - 1]
        before = sched[0, g - 1]
    return start, before


@cute.jit
def group_of_tile(tile: cutlass.Int32, offs: cute.Tensor, sched: cute.Tensor):
    """2d-3d grouped GEMMs: (g, :func:`group_origin` of g) of M tile ``tile``; ``g = size(offs)`` for the tail
    tiles past the last group."""
    g = group_of_row(tile, sched[0, None], cute.size(offs))
    start, before = group_origin(g, offs, sched)
    return g, start, before


@cute.jit
def last_group_at_or_below(vb: cutlass.Int32, tile_starts: cute.Tensor, num_groups: cutlass.Int32):
    """Largest g with ``4 * tile_starts[g] <= vb`` (tile_starts non-decreasing, tile_starts[0] == 0): 17 fixed
    binary-search steps (up to 131072 groups; the ops layer allows 65536)."""
    lo = cutlass.Int32(0)
    hi = num_groups - 1
    for _ in cutlass.range_constexpr(17):
        if lo < hi:
            mid = (lo + hi + 1) // 2
            if tile_starts[mid] * 4 <= vb:
                lo = mid
            else:
                hi = mid - 1
    return lo


@cute.jit
def reduce_scatter_max(a: cute.Tensor, n: cutlass.Constexpr[int], low_bit: cutlass.Constexpr[int], lane):
    """Max-reduce the ``n`` Int32 values ``a[0..n)`` of every lane over the ``log2(n)`` lanes that differ in lane
    bits ``[low_bit, low_bit + log2(n))``, leaving in ``a[0]`` of each lane the total of value index
    ``(lane >> low_bit) % n``.  Each step halves the values: a lane keeps the half its bit selects and sends the
    other half to its partner (``n - 1`` shuffles in all, instead of ``n * log2(n)`` for a butterfly of each)."""
    cnt = n
    bit = n.bit_length() - 2 + low_bit  # highest lane bit first
    for _ in cutlass.range_constexpr(n.bit_length() - 1):
        half = cnt // 2
        upper = (lane >> bit) & 1
        for j in cutlass.range_constexpr(half):
            lo, hi = a[j], a[j + half]
            send = hi
            keep = lo
            if upper == 1:
                send = lo
                keep = hi
            a[j] = cutlass.max(keep, cute.arch.shuffle_sync_bfly(send, offset=1 << bit))
        cnt = half
        bit -= 1


@cute.jit
def swiglu_fwd(g: cute.TensorSSA, u: cute.TensorSSA):
    """``h = silu(g) * u`` elementwise in fp32 (``silu(g) = g * sigmoid(g)``), the reference's operation order."""
    s = sigmoid(g)
    return (g * s) * u


def _f32_asm(asm: str, *args, loc=None, ip=None) -> cutlass.Float32:
    return cutlass.Float32(llvm.inline_asm(
        T.f32(), [cutlass.Float32(a).ir_value(loc=loc, ip=ip) for a in args], asm, "=f" + ",f" * len(args),
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def rcp_approx_ftz(x: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """``rcp.approx.ftz.f32``: the hardware reciprocal estimate (MUFU.RCP)."""
    return _f32_asm("rcp.approx.ftz.f32 $0, $1;", x, loc=loc, ip=ip)


@dsl_user_op
def fma_rn(a: cutlass.Float32, b: cutlass.Float32, c: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """``a * b + c`` rounded once (``fma.rn.f32``)."""
    return _f32_asm("fma.rn.f32 $0, $1, $2, $3;", a, b, c, loc=loc, ip=ip)


_RCP_BIG = 2.0 ** 126  # from here on 1/d is subnormal: scale d into range first
_RCP_SHIFT = 2.0 ** -64


@cute.jit
def sigmoid(g: cute.TensorSSA):
    """``1 / (1 + exp(-g))`` elementwise in fp32, with the division done without a branch.

    The reciprocal is the hardware estimate refined by one FMA Newton step, the sequence the compiler emits for a
    correctly rounded ``rcp.rn.f32`` in its fast path (there it is guarded by a branch to a slow path for huge,
    tiny or special inputs).  Here ``d = 1 + exp(-g) >= 1``, so only ``d >= 2**126`` (g < -87.3, where
    ``1/d`` is subnormal) and ``d = inf`` leave that path: the first is scaled by 2**-64 before and after (one
    extra rounding, in the subnormal range only, so the result can be one subnormal ulp off the correctly rounded
    one), the second takes the estimate itself (exactly 0).  NaN stays NaN."""
    d = 1.0 + cute.math.exp(-g)
    out = cute.make_rmem_tensor(g.shape, cutlass.Float32)
    dv = cute.make_rmem_tensor(g.shape, cutlass.Float32)
    dv.store(d)
    for i in cutlass.range_constexpr(cute.size(g.shape)):
        x = dv[i]
        c = cutlass.Float32(1.0)
        if x >= _RCP_BIG:
            c = cutlass.Float32(_RCP_SHIFT)
        xs = x * c
        r0 = rcp_approx_ftz(xs)
        r = fma_rn(r0, fma_rn(-xs, r0, cutlass.Float32(1.0)), r0)
        if xs == float("inf"):
            r = r0
        out[i] = r * c
    return out.load()


@dsl_user_op
def mul_rn(a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """``a * b`` rounded to nearest even as its own instruction (``mul.rn.f32``): the compiler may not fuse it into
    a following add (an FMA rounds once, where the reference's separate ops round twice)."""
    return _f32_asm("mul.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@cute.jit
def swiglu_bwd(dh: cute.TensorSSA, g: cute.TensorSSA, u: cute.TensorSSA):
    """``(dg, du)`` of ``h = silu(g) * u`` for upstream ``dh``, elementwise in fp32, the reference's operation
    order and roundings: ``dg = (dh * u) * (s * (1 + g * (1 - s)))``, ``du = dh * (g * s)``.  The product
    ``g * (1 - s)`` is rounded before the add (:func:`mul_rn`); fused into an FMA it would differ from the
    reference wherever ``1 + g * (1 - s)`` cancels (near g = -1.28, the zero of silu')."""
    s = sigmoid(g)
    one_minus_s = 1.0 - s
    p = cute.make_rmem_tensor(g.shape, cutlass.Float32)
    for i in cutlass.range_constexpr(cute.size(g.shape)):
        p[i] = mul_rn(g[i], one_minus_s[i])
    dg = (dh * u) * (s * (1.0 + p.load()))
    du = dh * (g * s)
    return dg, du


class MXCastParams:
    """Compile-time parameters every MXFP8 cast shares: element dtype (``"e4m3"``/``"e5m2"``), ``scale_mode``
    (``"floor"``/``"rceil"``) and ``blocked`` scales.  Raises ValueError for anything else."""

    def __init__(self, elem: str, scale_mode: str, blocked: bool = False):
        if elem not in ELEM_DTYPES or scale_mode not in ("floor", "rceil"):
            raise ValueError(f"unsupported elem {elem!r} / scale_mode {scale_mode!r}")
        self.elem_dtype, self.emax = ELEM_DTYPES[elem]
        self.elem = elem
        self.rceil = scale_mode == "rceil"
        self.blocked = blocked


_CVT_FP8X2 = {"e4m3": "cvt.rn.f16x2.e4m3x2", "e5m2": "cvt.rn.f16x2.e5m2x2"}


def _dequant_pair_asm(elem: str, upper: bool) -> str:
    return ("{ .reg .b16 p0, p1, h0, h1; .reg .b32 h, z; .reg .f32 f0, f1;\n"
            " mov.b32 {p0, p1}, $1;\n"
            f" {_CVT_FP8X2[elem]} h, {'p1' if upper else 'p0'};\n"
            " mov.b32 {h0, h1}, h;\n"
            " cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1;\n"
            " cvt.rn.bf16x2.f32 z, f1, f0;\n"
            " mul.rn.bf16x2 $0, z, $2; }")


@cute.jit
def e8m0_bf16x2(byte: cutlass.Int32):
    """The factor ``2**(byte - 127)`` of an E8M0 scale byte (0..255) as a bf16x2 pair (both halves equal), for
    :func:`dequant_pair_bf16`; the values of :func:`e8m0_to_f32`: byte 0 is ``2**-127`` (bf16 subnormal 0x0040),
    byte 255 NaN, every other byte the exponent field of a normal bf16."""
    pair = byte * 0x00800080
    if byte == 0:
        pair = cutlass.Int32(0x00400040)
    if byte == 255:
        pair = cutlass.Int32(0x7FC07FC0)
    return cutlass.Uint32(pair)


@dsl_user_op
def dequant_pair_bf16(word: cutlass.Uint32, factor2: cutlass.Uint32, elem: cutlass.Constexpr[str],
                      upper: cutlass.Constexpr[bool], *, loc=None, ip=None) -> cutlass.Uint32:
    """Two fp8 elements of ``word`` (bytes 0, 1, or 2, 3 if ``upper``; ``elem`` "e4m3"/"e5m2") times the E8M0
    factor ``2**(byte - 127)`` (``factor2``: :func:`e8m0_bf16x2`), as a packed bf16x2 (the lower byte in the lower
    half).

    fp8 -> f16 (exact) -> fp32 -> bf16x2 (exact: an fp8 value has at most 4 significant bits; NaN and e5m2's Inf
    carried) -> one ``mul.rn.bf16x2`` by the power of two.  bf16 has fp32's exponent range, so this is the
    reference's fp32 dequantization bit for bit, overflow to +-inf and NaN included, except where a product falls
    below 2**-126 (factors under 2**-117): there bf16's subnormals keep fewer bits than fp32's."""
    return cutlass.Uint32(llvm.inline_asm(
        T.i32(), [cutlass.Uint32(word).ir_value(loc=loc, ip=ip), cutlass.Uint32(factor2).ir_value(loc=loc, ip=ip)],
        _dequant_pair_asm(elem, upper), "=r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


_CVT_F32X2 = {"e4m3": "cvt.rn.satfinite.e4m3x2.f32", "e5m2": "cvt.rn.satfinite.e5m2x2.f32"}


@dsl_user_op
def pack_fp8x4(x0: cutlass.Float32, x1: cutlass.Float32, x2: cutlass.Float32, x3: cutlass.Float32,
               elem: cutlass.Constexpr[str], *, loc=None, ip=None) -> cutlass.Uint32:
    """Four fp32 values converted to fp8 (``elem`` "e4m3"/"e5m2") with ``cvt.rn.satfinite`` and packed into one
    word, ``x0`` in byte 0 (the lowest address of a little-endian store): the conversion the DSL's ``.to`` makes,
    two ``cvt...x2`` and one byte permute instead of the byte-by-byte reassembly its vector lowering emits."""
    cvt = _CVT_F32X2[elem]
    return cutlass.Uint32(llvm.inline_asm(
        T.i32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3)],
        "{ .reg .b16 lo, hi;\n"
        f" {cvt} lo, $2, $1;\n"
        f" {cvt} hi, $4, $3;\n"
        " mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def pack_fp8x8(xs, elem: cutlass.Constexpr[str], *, loc=None, ip=None) -> cutlass.Uint64:
    """Eight fp32 values ``xs`` as :func:`pack_fp8x4` packs four: ``xs[0]`` in byte 0 of the 64-bit word."""
    cvt = _CVT_F32X2[elem]
    return cutlass.Uint64(llvm.inline_asm(
        T.i64(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in xs],
        "{ .reg .b16 b0, b1, b2, b3;\n"
        f" {cvt} b0, $2, $1;\n {cvt} b1, $4, $3;\n {cvt} b2, $6, $5;\n {cvt} b3, $8, $7;\n"
        " mov.b64 $0, {b0, b1, b2, b3}; }", "=l" + ",f" * 8, has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def pack_bf16x2(lo: cutlass.Float32, hi: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Uint32:
    """``lo`` and ``hi`` rounded to nearest-even bf16 and packed (``lo`` in the lower half): ``cvt.rn.bf16x2.f32``."""
    return cutlass.Uint32(llvm.inline_asm(
        T.i32(), [cutlass.Float32(hi).ir_value(loc=loc, ip=ip), cutlass.Float32(lo).ir_value(loc=loc, ip=ip)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
