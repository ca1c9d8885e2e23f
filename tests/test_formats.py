"""Tests of the MX numerics reference ``cute_mxfp8.formats`` against REAL values.

* Sections A-D of ``/work/shared/cases/mx_cases.md`` bit for bit (bytes compared via ``.view(torch.uint8)``).
* Property tests on fresh random data against an *independent* reference written here: E8M0 scale bytes from exact
  float64 threshold counting (no log2 / frexp), elements by round-to-nearest-even over a table of every finite fp8
  value decoded from its bit fields, plus the dequantization error bound derived below.
* Errors, grouped layouts (M and K), and (when torchao is importable) bit-exact parity with torchao ``to_mx``.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from cute_mxfp8 import formats as F
from cute_mxfp8.formats import (
    amax_to_e8m0,
    blocked_scales_numel,
    dequantize_mxfp8,
    dequantize_mxfp8_grouped_k,
    e8m0_to_float,
    from_blocked_scales,
    from_blocked_scales_grouped_k,
    from_blocked_scales_grouped_m,
    group_tile_starts,
    grouped_scale_tiles,
    quantize_mxfp8,
    quantize_mxfp8_grouped_k,
    to_blocked_scales,
    to_blocked_scales_grouped_k,
    grouped_k_scale_offset,
    to_blocked_scales_grouped_m,
    validate_offsets,
)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu
ELEMS = [E4M3, E5M2]
MODES = ["floor", "rceil"]

# element format facts, independent of formats.py: (max, mantissa bits, emin (exponent of the smallest normal))
ELEM_FACTS = {E4M3: (448.0, 3, -6), E5M2: (57344.0, 2, -14)}


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------

def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def bits_of_f32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_tensor_from_bits(bits, shape=None) -> torch.Tensor:
    signed = [b - (1 << 32) if b >= (1 << 31) else b for b in bits]
    t = torch.tensor(signed, dtype=torch.int32).view(torch.float32)
    return t.reshape(shape) if shape is not None else t


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def f32_bits(t: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns of an fp32 tensor (NaN-safe, -0.0-safe exact comparison)."""
    return t.float().contiguous().view(torch.int32)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str = ""):
    got, want = u8(got), u8(want)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got != want).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} byte(s) differ, first at {i}: "
                             f"got 0x{int(got[i]):02X}, want 0x{int(want[i]):02X}")


def is_nan_byte(b: torch.Tensor, elem_dtype) -> torch.Tensor:
    b = b.to(torch.int32) & 0x7F
    return b == 0x7F if elem_dtype == E4M3 else b > 0x7C


def is_inf_byte(b: torch.Tensor, elem_dtype) -> torch.Tensor:
    if elem_dtype == E4M3:  # e4m3fn has no Inf
        return torch.zeros_like(b, dtype=torch.bool)
    return (b.to(torch.int32) & 0x7F) == 0x7C


# ---------------------------------------------------------------------------------------------------------
# independent reference (does not call formats.py)
# ---------------------------------------------------------------------------------------------------------

def ref_scale_bytes(amax: torch.Tensor, mode: str, elem_dtype) -> torch.Tensor:
    """E8M0 byte for block maxima ``amax`` by exact float64 threshold counting (powers of two and
    max_elem * 2**k are exact in float64, fp32 amax too).

    floor: largest b in [1, 254] with 2**(b - 127 + emax_elem) <= amax, else 0 (= clamp(floor(log2 amax) - emax + 127)).
    rceil: smallest b in [0, 254] with max_elem * 2**(b - 127) >= amax, 254 if none.
    Non-finite amax -> 255.
    """
    fmax = ELEM_FACTS[elem_dtype][0]
    emax = int(math.floor(math.log2(fmax)))  # 8 for e4m3, 15 for e5m2
    a = amax.double().unsqueeze(-1)
    two = torch.tensor(2.0, dtype=torch.float64)
    if mode == "floor":
        thr = two ** (torch.arange(1, 255, dtype=torch.float64) - 127 + emax)
        byte = (thr <= a).sum(-1)
    else:
        thr = fmax * two ** (torch.arange(0, 255, dtype=torch.float64) - 127)
        byte = (thr < a).sum(-1).clamp(max=254)
    return torch.where(torch.isfinite(amax.double()), byte, torch.full_like(byte, 255)).to(torch.uint8)


def ref_scale_value(byte: torch.Tensor) -> torch.Tensor:
    """float64 2**(b-127); NaN for 255."""
    b = byte.to(torch.float64)
    v = torch.tensor(2.0, dtype=torch.float64) ** (b - 127)
    return torch.where(byte.to(torch.int32) == 255, torch.full_like(v, float("nan")), v)


_TABLES = {}


def fp8_table(elem_dtype):
    """(ascending float64 values, int64 codes) of every non-negative finite fp8 value, decoded from bit fields."""
    if elem_dtype not in _TABLES:
        vals, codes = [], []
        if elem_dtype == E4M3:
            for c in range(0x7F):  # 0x7F is NaN
                e, m = c >> 3, c & 7
                vals.append(math.ldexp(m, -9) if e == 0 else math.ldexp(8 + m, e - 10))
                codes.append(c)
        else:
            for c in range(0x7C):  # 0x7C Inf, 0x7D-0x7F NaN
                e, m = c >> 2, c & 3
                vals.append(math.ldexp(m, -16) if e == 0 else math.ldexp(4 + m, e - 17))
                codes.append(c)
        assert vals == sorted(vals) and vals[-1] == ELEM_FACTS[elem_dtype][0]
        _TABLES[elem_dtype] = (torch.tensor(vals, dtype=torch.float64), torch.tensor(codes, dtype=torch.int64))
    return _TABLES[elem_dtype]


def ref_round_fp8(v: torch.Tensor, elem_dtype) -> torch.Tensor:
    """Bytes of float64 finite ``v`` rounded to nearest (ties to even code = even mantissa), saturated to +-max,
    sign kept (also for results that round to zero)."""
    vals, codes = fp8_table(elem_dtype)
    a = v.abs().clamp(max=float(vals[-1])).contiguous()
    hi_i = torch.searchsorted(vals, a).clamp(max=len(vals) - 1)
    lo_i = (hi_i - 1).clamp(min=0)
    dhi, dlo = vals[hi_i] - a, a - vals[lo_i]
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi_i] % 2 == 0))
    code = torch.where(pick_hi, codes[hi_i], codes[lo_i])
    code = code | torch.where(torch.signbit(v), 0x80, 0)
    return code.to(torch.uint8)


def check_quantization(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, dim: int, mode: str, elem_dtype):
    """Check ``(data, scales) = quantize_mxfp8(x, dim=dim, ...)`` against the independent reference, and the
    dequantization error bound.

    Error bound.  Let s = 2**k be the block scale and v = x / s (exact).  If |v| <= max_elem, v is rounded to
    nearest in the element format with m mantissa bits (m = 3 e4m3, 2 e5m2) and smallest normal exponent emin
    (-6 e4m3, -14 e5m2):
      * v normal (|v| >= 2**emin): the spacing around v is 2**(floor(log2|v|) - m), so |v - q| <= 2**(floor(log2|v|) - m - 1);
        times s (exact): |x - deq| <= 2**(floor(log2|x|) - m - 1)  (relative error <= 2**-(m+1)).
      * v subnormal: spacing 2**(emin - m) (the element's smallest subnormal), |v - q| <= 2**(emin - m - 1);
        times s: |x - deq| <= 2**(emin - m - 1) * s.
    So |x - deq| <= max(2**(floor(log2|x|) - m - 1), 2**(emin - m - 1) * s), and deq has x's sign (or is zero).
    If |v| > max_elem (only possible in floor mode: v < 2**(emax+1)), the element saturates: deq == sign(x) * max * s.
    """
    fmax, mbits, emin = ELEM_FACTS[elem_dtype]
    dim = dim % x.dim()
    n = x.shape[dim]
    assert data.dtype == elem_dtype and scales.dtype == E8M0
    assert data.shape == x.shape and data.is_contiguous() and scales.is_contiguous()
    exp_sshape = list(x.shape)
    exp_sshape[dim] = n // 32
    assert list(scales.shape) == exp_sshape

    xb = x.double().movedim(dim, -1).reshape(*[s for i, s in enumerate(x.shape) if i != dim], n // 32, 32)
    db = u8(data).movedim(dim, -1).reshape(xb.shape)
    sb = u8(scales).movedim(dim, -1)

    finite_blk = torch.isfinite(xb).all(-1)
    amax = torch.where(finite_blk, xb.abs().amax(-1), torch.full_like(xb[..., 0], float("inf")))
    want_s = ref_scale_bytes(amax, mode, elem_dtype)
    assert_bytes_equal(sb, want_s, f"scale bytes ({mode}, {elem_dtype})")

    # poisoned blocks: all elements NaN
    assert bool(is_nan_byte(db[~finite_blk], elem_dtype).all()), "non-finite block must be all NaN"
    # finite blocks: element bytes == RNE(x / s) saturated, no NaN / Inf ever
    s = ref_scale_value(want_s).unsqueeze(-1)
    v = torch.where(finite_blk.unsqueeze(-1), xb / s, torch.zeros_like(xb))
    want_d = ref_round_fp8(v, elem_dtype)
    got_d = torch.where(finite_blk.unsqueeze(-1), db, want_d)
    assert_bytes_equal(got_d, want_d, f"element bytes ({mode}, {elem_dtype})")
    fin_bytes = db[finite_blk]
    assert not bool(is_nan_byte(fin_bytes, elem_dtype).any()) and not bool(is_inf_byte(fin_bytes, elem_dtype).any())

    # dequantize: the fp32 result is exactly element * 2**(b-127) rounded to fp32 (exact, except that a value of
    # 2**128 -- rceil rounds an element up to it for |x| >= 2**128 * (1 - 2**-(m+2)) -- overflows fp32 to +-Inf)
    deq = dequantize_mxfp8(data, scales, dim=dim)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    deqb = deq.double().movedim(dim, -1).reshape(xb.shape)
    assert bool(torch.isnan(deqb[~finite_blk]).all())
    vals, codes = fp8_table(elem_dtype)
    lut = torch.full((256,), float("nan"), dtype=torch.float64)
    lut[codes] = vals
    lut[codes | 0x80] = -vals
    exact = lut[db.to(torch.int64)] * s  # float64, exact
    assert torch.equal(f32_bits(deqb[finite_blk].float()), f32_bits(exact[finite_blk].float())), \
        "dequantized fp32 != element * scale"
    # error bound on the exact dequantized value
    xf, df = xb[finite_blk], exact[finite_blk]
    sf = s.expand_as(xb)[finite_blk]
    err = (xf - df).abs()
    _, e = torch.frexp(xf.abs())
    bound_norm = torch.where(xf == 0, torch.zeros_like(xf), torch.ldexp(torch.ones_like(xf), e - 1 - mbits - 1))
    bound = torch.maximum(bound_norm, math.ldexp(1.0, emin - mbits - 1) * sf)
    sat = (xf / sf).abs() > fmax
    if mode == "rceil":
        assert not bool(sat.any()), "rceil never needs to saturate"
    ok = torch.where(sat, df == torch.sign(xf) * fmax * sf, err <= bound)
    if not bool(ok.all()):
        i = (~ok).nonzero()[0]
        raise AssertionError(f"error bound violated: x={xf[tuple(i)]!r} deq={df[tuple(i)]!r} bound={bound[tuple(i)]!r}")
    assert bool(((df == 0) | (torch.sign(df) == torch.sign(xf))).all()), "dequantized value changed sign"
    # finite unless the exact value is 2**128 (see above)
    assert bool((torch.isfinite(deqb[finite_blk]) | (df.abs() >= 2.0**128)).all())
    return want_s


def random_mx_input(shape, dim, dtype, gen, wide=True):
    """Normal data with a random power-of-two magnitude per block along ``dim`` (mostly moderate, some extreme
    incl. fp32 subnormals and values near the fp32 max), a few exact zeros / signed zeros and all-zero blocks."""
    dim = dim % len(shape)
    xs = list(shape)
    xs.append(xs.pop(dim))
    n = xs[-1]
    x = torch.randn(*xs[:-1], n // 32, 32, generator=gen)
    nb = x.shape[:-1]
    e = torch.randint(-20, 21, nb, generator=gen)
    if wide:
        extreme = torch.rand(nb, generator=gen) < 0.2
        e = torch.where(extreme, torch.randint(-145, 126, nb, generator=gen), e)
    x = x * torch.ldexp(torch.ones(nb), e).unsqueeze(-1)
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.05, torch.zeros_like(x), x)
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.03, -torch.zeros_like(x), x)
    x = torch.where((torch.rand(nb, generator=gen) < 0.05).unsqueeze(-1), torch.zeros_like(x), x)
    x = x.reshape(xs).movedim(-1, dim).to(dtype)
    assert bool(torch.isfinite(x).all())
    return x


# ---------------------------------------------------------------------------------------------------------
# mx_cases.md section A: one (1, 32) block, e4m3, rowwise
# ---------------------------------------------------------------------------------------------------------

ONE, INF, NAN = 0x3F800000, 0x7F800000, 0x7FC00000

# (id, 32 fp32 bit patterns, input dtype, floor expect, rceil expect);
# expect = (scale byte, first element byte, last element byte or None, all elements NaN 0x7F)
# For uniform blocks ("all X") every element byte equals the first one.
CASES_A = [
    ("all_zero", [0] * 32, torch.float32, (0, 0x00, None, False), (0, 0x00, None, False)),
    ("all_2^-126", [0x00800000] * 32, torch.float32, (0, 0x40, None, False), (0, 0x40, None, False)),
    ("inf_then_ones", [INF] + [ONE] * 31, torch.float32, (255, 0x7F, None, True), (255, 0x7F, None, True)),
    ("all_nan", [NAN] * 32, torch.float32, (255, 0x7F, None, True), (255, 0x7F, None, True)),
    ("all_448", [0x43E00000] * 32, torch.float32, (127, 0x7E, None, False), (127, 0x7E, None, False)),
    ("all_480", [0x43F00000] * 32, torch.float32, (127, 0x7E, None, False), (128, 0x77, None, False)),
    ("all_bf16_max", [0x7F7F0000] * 32, torch.bfloat16, (246, 0x7E, None, False), (247, 0x78, None, False)),
    ("min_subnormal_then_ones", [0x00000001] + [ONE] * 31, torch.float32,
     (119, 0x00, 0x78, False), (119, 0x00, 0x78, False)),
    ("neg_min_subnormal_then_ones", [0x80000001] + [ONE] * 31, torch.float32,
     (119, 0x80, 0x78, False), (119, 0x80, 0x78, False)),
    ("all_3.5_plus_ulp", [0x40600001] * 32, torch.float32, (120, 0x7E, None, False), (121, 0x76, None, False)),
    ("all_just_below_512", [0x43FFFFFF] * 32, torch.float32, (127, 0x7E, None, False), (128, 0x78, None, False)),
    ("500_then_ones", [0x43FA0000] + [ONE] * 31, torch.float32, (127, 0x7E, 0x38, False), (128, 0x78, 0x30, False)),
]


def _case_a_input(bits, dtype):
    x = f32_tensor_from_bits(bits, (1, 32))
    if dtype == torch.bfloat16:
        xb = x.to(torch.bfloat16)
        assert bool((f32_bits(xb.float()) == f32_bits(x)).all()), "bf16 case value must be exact"
        return xb
    return x


@pytest.mark.parametrize("layout", ["rowwise", "colwise"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES_A, ids=[c[0] for c in CASES_A])
def test_cases_A(case, mode, layout):
    name, bits, dtype, floor_exp, rceil_exp = case
    scale_b, first_b, last_b, all_nan = floor_exp if mode == "floor" else rceil_exp
    x = _case_a_input(bits, dtype)
    if layout == "rowwise":
        data, scales = quantize_mxfp8(x, scale_mode=mode, elem_dtype=E4M3)
        assert data.shape == (1, 32) and scales.shape == (1, 1)
        d, s = u8(data).reshape(32), u8(scales).reshape(1)
    else:  # the same block as a (32, 1) column, blocks along dim 0
        data, scales = quantize_mxfp8(x.t().contiguous(), dim=0, scale_mode=mode, elem_dtype=E4M3)
        assert data.shape == (32, 1) and scales.shape == (1, 1)
        d, s = u8(data).reshape(32), u8(scales).reshape(1)
    assert data.dtype == E4M3 and scales.dtype == E8M0
    assert int(s[0]) == scale_b, f"{name} {mode}: scale byte {int(s[0])}, want {scale_b}"
    assert int(d[0]) == first_b, f"{name} {mode}: first element 0x{int(d[0]):02X}, want 0x{first_b:02X}"
    if all_nan:
        assert d.tolist() == [0x7F] * 32, f"{name} {mode}: want all NaN (0x7F), got {[hex(b) for b in d.tolist()]}"
    elif last_b is not None:
        assert int(d[-1]) == last_b, f"{name} {mode}: last element 0x{int(d[-1]):02X}, want 0x{last_b:02X}"
        assert d[1:].tolist() == [last_b] * 31  # the 31 trailing values are all equal
    else:
        assert len(set(bits)) == 1
        assert d.tolist() == [first_b] * 32, f"{name} {mode}: uniform block gives {[hex(b) for b in d.tolist()]}"


def test_cases_A_scalar_values():
    # the fp32 values the table names, so a typo in a bit pattern cannot hide
    assert f32_from_bits(0x00800000) == 2.0**-126
    assert f32_from_bits(0x43E00000) == 448.0 and f32_from_bits(0x43F00000) == 480.0
    assert f32_from_bits(0x43FA0000) == 500.0 and f32_from_bits(0x00000001) == 2.0**-149
    assert f32_from_bits(0x7F7F0000) == torch.finfo(torch.bfloat16).max
    assert f32_from_bits(0x40600001) == 3.5 + 2.0**-22
    assert f32_from_bits(0x43FFFFFF) == 512.0 - 2.0**-15
    # and the element bytes the table uses
    assert torch.tensor([0x7E, 0x77, 0x78, 0x76, 0x38, 0x30, 0x40], dtype=torch.uint8).view(E4M3).float().tolist() \
        == [448.0, 240.0, 256.0, 224.0, 1.0, 0.5, 2.0]


# ---------------------------------------------------------------------------------------------------------
# section B: amax -> E8M0 under rceil with max_elem = 1
# ---------------------------------------------------------------------------------------------------------

CASES_B = [
    (0x00000000, 0), (0x00400000, 0), (0x00400001, 1), (0x00800000, 1),
    (0x3F800000, 127), (0x3F800001, 128), (0x7F000000, 254), (0x7F800000, 255),
]


@pytest.mark.parametrize("elem_dtype", ELEMS)
@pytest.mark.parametrize("bits,want", CASES_B, ids=[f"0x{b:08X}" for b, _ in CASES_B])
def test_cases_B(bits, want, elem_dtype):
    amax = f32_tensor_from_bits([bits])
    got = amax_to_e8m0(amax, "rceil", elem_dtype, max_elem=1.0)
    assert got.dtype == torch.uint8
    assert got.tolist() == [want], f"amax bits 0x{bits:08X}: got {got.tolist()}, want {want}"


@pytest.mark.parametrize("bits", [0x7F000001, 0x7F7FFFFF])
def test_rceil_unit_max_clamps_to_254(bits):
    """Above 2**127 the round-up would need byte 255 (NaN): the byte clamps to 254 (design: clamp to [0, 254])."""
    got = amax_to_e8m0(f32_tensor_from_bits([bits]), "rceil", max_elem=1.0)
    assert got.tolist() == [254]


def test_cases_B_batched():
    amax = f32_tensor_from_bits([b for b, _ in CASES_B] + [NAN], (3, 3))
    got = amax_to_e8m0(amax, "rceil", max_elem=1.0)
    assert got.shape == (3, 3)
    assert got.reshape(-1).tolist() == [w for _, w in CASES_B] + [255]


# hypothesis: amax_to_e8m0 on arbitrary non-negative fp32 (subnormals, Inf, NaN) against the threshold reference
_amax_strategy = st.one_of(
    st.floats(min_value=0.0, width=32, allow_infinity=True),
    st.just(float("nan")),
    st.integers(0, 0x7F800000).map(f32_from_bits),  # uniform over bit patterns: lots of subnormals / huge values
)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(vals=st.lists(_amax_strategy, min_size=1, max_size=16), mode=st.sampled_from(MODES),
       elem=st.sampled_from(ELEMS))
def test_amax_to_e8m0_matches_reference(vals, mode, elem):
    amax = torch.tensor([abs(v) if v == v else v for v in vals], dtype=torch.float32)
    got = amax_to_e8m0(amax, mode, elem)
    want = ref_scale_bytes(amax, mode, elem)
    assert got.tolist() == want.tolist(), f"amax {amax.tolist()}"


@settings(max_examples=200, deadline=None, database=None)
@given(bits=st.integers(0, 0x7F800000))
def test_amax_to_e8m0_rceil_unit_max_is_ceil_pow2(bits):
    """rceil with max_elem=1: smallest b with 2**(b-127) >= amax, via Python exact math (frexp)."""
    a = f32_from_bits(bits)
    got = int(amax_to_e8m0(torch.tensor([a], dtype=torch.float32), "rceil", max_elem=1.0)[0])
    if math.isinf(a):
        want = 255
    elif a == 0:
        want = 0
    else:
        m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
        ceil_log2 = e - 1 if m == 0.5 else e
        want = min(max(ceil_log2 + 127, 0), 254)
    assert got == want, f"amax {a!r} (0x{bits:08X})"


# ---------------------------------------------------------------------------------------------------------
# section C: blocked (tcgen05) scale layout
# ---------------------------------------------------------------------------------------------------------

def blocked_offset(r, c, cols):
    """The blocked layout's offset formula (cuBLAS block-scaling docs; :mod:`cute_mxfp8.formats`)."""
    tile = (r // 128) * math.ceil(cols / 4) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _locate_positions(rows, cols, fn):
    """Run ``fn`` (plain (rows, cols) uint8/e8m0 scales -> 1-D blocked buffer) on byte planes that encode each
    position uniquely: (r & 0x7F) + 1, (r >> 7) + 1, c + 1.  Returns ({offset: (r, c)}, set of zero offsets)."""
    r = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    assert rows < 128 * 255 and cols < 255
    planes = [((r & 0x7F) + 1), ((r >> 7) + 1), (c + 1)]
    outs = [u8(fn(p.to(torch.uint8).contiguous().view(E8M0))).to(torch.int64) for p in planes]
    lo, hi, cc = outs
    assert lo.shape == hi.shape == cc.shape and lo.dim() == 1
    where = {}
    zero = set()
    for off in range(lo.numel()):
        if int(lo[off]) == 0:
            assert int(hi[off]) == 0 and int(cc[off]) == 0, f"offset {off} half-filled"
            zero.add(off)
        else:
            where[off] = ((int(lo[off]) - 1) | ((int(hi[off]) - 1) << 7), int(cc[off]) - 1)
    return where, zero


def test_cases_C_offsets_and_size():
    data, scales = quantize_mxfp8(torch.ones(129, 160), scale_mode="floor")
    assert scales.shape == (129, 5)
    assert blocked_scales_numel(129, 5) == 2048
    blocked = to_blocked_scales(scales)
    assert blocked.dtype == E8M0 and blocked.shape == (2048,) and blocked.is_contiguous()

    where, zero = _locate_positions(129, 5, to_blocked_scales)
    assert len(where) == 129 * 5 and len(zero) == 2048 - 129 * 5  # every position once, the rest is padding
    pos = {rc: off for off, rc in where.items()}
    for rc, off in [((0, 0), 0), ((1, 0), 16), ((32, 0), 4), ((0, 1), 1), ((127, 3), 511)]:
        assert pos[rc] == off, f"scale {rc} at byte {pos[rc]}, want {off}"

    # padding is zero even when every real scale byte is non-zero (here 0xFF)
    full = torch.full((129, 5), 255, dtype=torch.uint8).view(E8M0)
    b = u8(to_blocked_scales(full))
    assert int((b == 255).sum()) == 129 * 5 and int((b == 0).sum()) == 2048 - 129 * 5


def test_cases_C_round_trip(rng):
    s = torch.randint(0, 256, (129, 5), generator=rng, dtype=torch.uint8).view(E8M0)
    blocked = to_blocked_scales(s)
    back = from_blocked_scales(blocked, 129, 5)
    assert back.dtype == E8M0 and back.shape == (129, 5)
    assert_bytes_equal(back, s, "blocked -> plain round trip")
    # and the real quantized scales of (129, 160) data
    x = random_mx_input((129, 160), -1, torch.float32, rng)
    _, sc = quantize_mxfp8(x)
    assert_bytes_equal(from_blocked_scales(to_blocked_scales(sc), 129, 5), sc, "quantized scales round trip")


@pytest.mark.parametrize("shape", [(300, 7), (1, 1), (128, 4), (257, 9)])
def test_blocked_general_formula(shape):
    rows, cols = shape
    n = blocked_scales_numel(rows, cols)
    assert n == math.ceil(rows / 128) * 128 * math.ceil(cols / 4) * 4
    where, zero = _locate_positions(rows, cols, to_blocked_scales)
    assert len(where) + len(zero) == n and len(where) == rows * cols
    for off, (r, c) in where.items():
        assert off == blocked_offset(r, c, cols), f"scale ({r}, {c}) at byte {off}, want {blocked_offset(r, c, cols)}"


def test_blocked_formula_random_bytes(rng):
    """Independent construction of the whole buffer from the formula, with random bytes (incl. 0 and 255)."""
    rows, cols = 300, 7
    s = torch.randint(0, 256, (rows, cols), generator=rng, dtype=torch.uint8)
    want = torch.zeros(blocked_scales_numel(rows, cols), dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            want[blocked_offset(r, c, cols)] = s[r, c]
    got = to_blocked_scales(s.view(E8M0))
    assert_bytes_equal(got, want, "blocked buffer (300, 7)")
    assert_bytes_equal(from_blocked_scales(got, rows, cols), s, "round trip (300, 7)")
    # non-contiguous input gives the same buffer
    st_ = s.t().contiguous().t()
    assert not st_.is_contiguous()
    assert_bytes_equal(to_blocked_scales(st_.view(E8M0)), want, "non-contiguous input")


def test_blocked_per_expert(rng):
    s = torch.randint(0, 256, (3, 129, 5), generator=rng, dtype=torch.uint8).view(E8M0)
    b = to_blocked_scales(s)
    assert b.shape == (3, 2048)
    for e in range(3):
        assert_bytes_equal(b[e], to_blocked_scales(s[e]), f"expert {e}")
    assert_bytes_equal(from_blocked_scales(b, 129, 5), s, "per-expert round trip")
    # tile-aligned (no padding), a non-contiguous stack of experts, and no experts at all
    s = torch.randint(0, 256, (2, 4, 256), generator=rng, dtype=torch.uint8).transpose(1, 2).view(E8M0)
    b = to_blocked_scales(s)
    assert b.shape == (2, 1024) and b.is_contiguous()
    for e in range(2):
        assert_bytes_equal(b[e], to_blocked_scales(s[e].contiguous()), f"aligned expert {e}")
    assert to_blocked_scales(torch.zeros(0, 129, 5, dtype=torch.uint8).view(E8M0)).shape == (0, 2048)


def test_blocked_errors():
    with pytest.raises(ValueError):
        from_blocked_scales(torch.zeros(2047, dtype=torch.uint8).view(E8M0), 129, 5)
    with pytest.raises(ValueError):
        to_blocked_scales(torch.zeros(4, dtype=torch.uint8).view(E8M0))


# ---------------------------------------------------------------------------------------------------------
# section D: decode
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_e8m0", [False, True])
def test_cases_D_decode(as_e8m0):
    b = torch.tensor([0, 127, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float(b.view(E8M0) if as_e8m0 else b)
    assert v.dtype == torch.float32
    bits = f32_bits(v).tolist()
    assert bits[:3] == [0x00400000, 0x3F800000, 0x7F000000]
    assert math.isnan(v[3].item())


def test_decode_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_to_float(b)
    for i in range(255):
        want = math.ldexp(1.0, i - 127)
        assert v[i].item() == want and bits_of_f32(v[i].item()) == bits_of_f32(want), f"byte {i}"
    assert math.isnan(v[255].item())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cases_D_dequantize_scale_byte_0(out_dtype):
    data = torch.full((1, 32), 0x40, dtype=torch.uint8).view(E4M3)  # element 2.0
    assert data.float()[0, 0].item() == 2.0
    scales = torch.zeros((1, 1), dtype=torch.uint8).view(E8M0)
    out = dequantize_mxfp8(data, scales, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert f32_bits(out).unique().tolist() == [0x00800000]  # 2**-126, not 0
    # byte 255 -> NaN, byte 127 -> unscaled
    scales2 = torch.tensor([[255, 127]], dtype=torch.uint8).view(E8M0)
    out2 = dequantize_mxfp8(torch.full((1, 64), 0x40, dtype=torch.uint8).view(E4M3), scales2)
    assert bool(torch.isnan(out2[0, :32]).all()) and out2[0, 32:].tolist() == [2.0] * 32



@pytest.mark.parametrize("out_dtype, err", [("float32", TypeError), (None, TypeError), (torch.int32, ValueError)])
def test_dequantize_refuses_an_out_dtype_that_is_no_floating_dtype_by_name(out_dtype, err):
    data, scales = quantize_mxfp8(torch.randn(2, 64))
    with pytest.raises(err, match="out_dtype"):
        dequantize_mxfp8(data, scales, out_dtype=out_dtype)
    with pytest.raises(IndexError, match="out of range"):
        dequantize_mxfp8(data, scales, dim=2)
    with pytest.raises(ValueError, match="do not match"):  # blocked scales are not the plain layout
        dequantize_mxfp8(data, to_blocked_scales(scales))

# ---------------------------------------------------------------------------------------------------------
# property tests on random data
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 32), (127, 96), (129, 160), (3, 5, 64), (64,)])
def test_quantize_random_matches_reference(shape, dtype, mode, elem_dtype, rng):
    x = random_mx_input(shape, -1, dtype, rng)
    data, scales = quantize_mxfp8(x, scale_mode=mode, elem_dtype=elem_dtype)
    check_quantization(x, data, scales, -1, mode, elem_dtype)


@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_scale_uses_element_range(mode, elem_dtype, rng):
    """On moderate data (no byte clamping) the block's max element lands in the top binade(s) of the format:
    floor: amax / s in [2**emax, 2**(emax+1)) -> magnitude byte in [0x78, max code] (saturating above max);
    rceil: amax / s in (max/2, max] -> magnitude byte in [code(max/2), max code]."""
    x = random_mx_input((64, 256), -1, torch.float32, rng, wide=False)
    x[0, :32] = torch.linspace(-1.0, 1.999, 32) * 2.0**10  # mantissa of amax near 2 -> floor saturates
    data, scales = quantize_mxfp8(x, scale_mode=mode, elem_dtype=elem_dtype)
    xb = x.reshape(64, 8, 32)
    nz = xb.abs().amax(-1) > 0
    arg = xb.abs().argmax(-1, keepdim=True)
    top = (u8(data).reshape(64, 8, 32).gather(-1, arg).squeeze(-1).to(torch.int32) & 0x7F)[nz]
    maxcode = 0x7E if elem_dtype == E4M3 else 0x7B
    if mode == "floor":
        lo = 0x78  # 256 (e4m3) / 32768 (e5m2)
    else:
        lo = 0x76 if elem_dtype == E4M3 else 0x77  # 224 / 28672 = max / 2
    assert int(top.min()) >= lo and int(top.max()) <= maxcode
    if mode == "floor":
        assert int(u8(data)[0, 31]) == maxcode  # 1.999 * 2**10 / 2**(10 - emax) = 1.999 * 2**emax > max: saturated


@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_scales_match_frexp_on_a_few_blocks(mode, elem_dtype, rng):
    """Second, scalar opinion on the scale: Python math.frexp on a few blocks."""
    fmax, _, _ = ELEM_FACTS[elem_dtype]
    emax = 8 if elem_dtype == E4M3 else 15
    x = random_mx_input((4, 128), -1, torch.float32, rng)
    _, scales = quantize_mxfp8(x, scale_mode=mode, elem_dtype=elem_dtype)
    for r in range(4):
        for b in range(4):
            amax = max(abs(v) for v in x[r, 32 * b: 32 * b + 32].tolist())
            if amax == 0:
                want = 0
            elif mode == "floor":
                want = min(max(math.frexp(amax)[1] - 1 - emax + 127, 0), 254)
            else:
                q = amax / fmax  # float64: exact enough to tell a power of two (fp32 amax has 24 bits)
                m, e = math.frexp(q)
                want = min(max((e - 1 if m == 0.5 else e) + 127, 0), 254)
            assert int(u8(scales)[r, b]) == want, f"block ({r}, {b}) amax {amax!r}"


@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cases_E_dim0_equals_dim1_transposed(dtype, mode, elem_dtype, rng):
    x = random_mx_input((128, 256), 0, dtype, rng)
    d0, s0 = quantize_mxfp8(x, dim=0, scale_mode=mode, elem_dtype=elem_dtype)
    assert d0.shape == (128, 256) and s0.shape == (4, 256)
    check_quantization(x, d0, s0, 0, mode, elem_dtype)
    for xt in (x.t(), x.t().contiguous()):
        d1, s1 = quantize_mxfp8(xt, dim=-1, scale_mode=mode, elem_dtype=elem_dtype)
        assert d1.shape == (256, 128) and s1.shape == (256, 4)
        assert_bytes_equal(d0, d1.t().contiguous(), "dim0 data vs dim1 data transposed")
        assert_bytes_equal(s0, s1.t().contiguous(), "dim0 scales vs dim1 scales transposed")
        y0 = dequantize_mxfp8(d0, s0, dim=0)
        y1 = dequantize_mxfp8(d1, s1, dim=-1)
        assert torch.equal(f32_bits(y0), f32_bits(y1.t())), "dequantized values differ"


@pytest.mark.parametrize("mode", MODES)
def test_middle_dim_equals_movedim(mode, rng):
    x = random_mx_input((2, 64, 3), 1, torch.float32, rng)
    d, s = quantize_mxfp8(x, dim=1, scale_mode=mode)
    assert s.shape == (2, 2, 3)
    check_quantization(x, d, s, 1, mode, E4M3)
    d2, s2 = quantize_mxfp8(x.movedim(1, -1), scale_mode=mode)
    assert_bytes_equal(d, d2.movedim(-1, 1).contiguous(), "data")
    assert_bytes_equal(s, s2.movedim(-1, 1).contiguous(), "scales")
    assert torch.equal(f32_bits(dequantize_mxfp8(d, s, dim=1)), f32_bits(dequantize_mxfp8(d2, s2).movedim(-1, 1)))


@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_saturation_never_inf(dtype, mode, elem_dtype, rng):
    fmax, _, _ = ELEM_FACTS[elem_dtype]
    maxcode = 0x7E if elem_dtype == E4M3 else 0x7B
    big = torch.finfo(dtype).max
    x = torch.empty(4, 64, dtype=torch.float32)
    x[0] = big
    x[1] = -big
    x[2] = torch.linspace(-0.92, 0.92, 64, dtype=torch.float64) * big  # < 1.875 * 2**127
    x[3] = torch.randn(64, generator=rng).clamp(-3.6, 3.6) * 2.0**126  # < 1.875 * 2**127
    x = x.to(dtype)
    assert bool(torch.isfinite(x).all())
    data, scales = quantize_mxfp8(x, scale_mode=mode, elem_dtype=elem_dtype)
    b = u8(data)
    assert not bool(is_nan_byte(b, elem_dtype).any()) and not bool(is_inf_byte(b, elem_dtype).any())
    assert not bool((u8(scales) == 255).any())
    y = dequantize_mxfp8(data, scales)
    check_quantization(x, data, scales, -1, mode, elem_dtype)
    # floor saturates to max * 2**(floor(log2 amax) - emax) <= 1.75 * 2**127: dequantization is finite.  rceil
    # rounds |x| >= 1.9375 * 2**127 up to an element * scale of 2**128 (case A "bf16 max": scale 247, element
    # 0x78 = 256), which does not fit fp32: the quantized bytes are finite, the fp32 dequantization is +-Inf.
    assert bool(torch.isfinite(y[2:]).all()) if mode == "rceil" else bool(torch.isfinite(y).all())
    if mode == "rceil":
        if elem_dtype == E4M3:
            assert int(u8(scales)[0, 0]) == 247 and set(b[0].tolist()) == {0x78}
        assert y[0].tolist() == [float("inf")] * 64 and y[1].tolist() == [float("-inf")] * 64
    if mode == "floor":
        # mantissa of the max near 2 -> saturates to +-max (never Inf / NaN)
        assert set(b[0].tolist()) == {maxcode} and set(b[1].tolist()) == {0x80 | maxcode}
    # floor mode, e4m3, mantissa >= 1.6875 saturates to byte 0x7E (448) for every binade
    if elem_dtype == E4M3:
        k = torch.randint(-100, 100, (16,), generator=rng)
        v = torch.ldexp(torch.full((16,), 1.9375), k).unsqueeze(-1).expand(16, 32).contiguous()
        d, s = quantize_mxfp8(v, scale_mode="floor")
        assert set(u8(d).reshape(-1).tolist()) == {0x7E}
        assert u8(s).reshape(-1).tolist() == (k - 8 + 127).tolist()
        assert torch.equal(dequantize_mxfp8(d, s)[:, 0], torch.ldexp(torch.full((16,), 1.75), k))


@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_signed_zeros(dtype, mode, elem_dtype):
    x = torch.zeros(4, 32, dtype=torch.float32)
    x[0] = -0.0
    x[1, ::2] = -0.0
    x[2] = torch.arange(32) - 16.0
    x[2, 16] = -0.0  # a -0 among normal values
    x[3] = 1.0
    x[3, 5] = -1e-30  # rounds to zero in the element format, sign kept
    x = x.to(dtype)
    data, scales = quantize_mxfp8(x, scale_mode=mode, elem_dtype=elem_dtype)
    b, s = u8(data), u8(scales)
    assert s[0, 0] == 0 and s[1, 0] == 0
    assert b[0].tolist() == [0x80] * 32
    assert b[1].tolist() == [0x80, 0x00] * 16
    assert int(b[2, 16]) == 0x80 and int(b[3, 5]) == 0x80
    y = dequantize_mxfp8(data, scales)
    assert bool(torch.signbit(y[0]).all()) and (y[0] == 0).all()
    assert torch.signbit(y[1]).tolist() == [True, False] * 16
    assert torch.signbit(y[2, 16]) and y[2, 16] == 0 and torch.signbit(y[3, 5]) and y[3, 5] == 0
    check_quantization(x, data, scales, -1, mode, elem_dtype)


@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_nan_inf_poison_only_their_block(dim, mode, elem_dtype, rng):
    clean = random_mx_input((128, 128), dim, torch.float32, rng, wide=False)
    x = clean.clone()
    specials = [(1, 37, float("nan")), (40, 100, float("inf")), (99, 0, float("-inf")), (127, 127, -float("nan"))]
    for r, c, v in specials:
        x[r, c] = v
    data, scales = quantize_mxfp8(x, dim=dim, scale_mode=mode, elem_dtype=elem_dtype)
    cd, cs = quantize_mxfp8(clean, dim=dim, scale_mode=mode, elem_dtype=elem_dtype)
    poisoned = torch.zeros(128, 128, dtype=torch.bool)
    spoison = torch.zeros_like(u8(scales), dtype=torch.bool)
    for r, c, _ in specials:
        if dim == -1:
            poisoned[r, c // 32 * 32: c // 32 * 32 + 32] = True
            spoison[r, c // 32] = True
        else:
            poisoned[r // 32 * 32: r // 32 * 32 + 32, c] = True
            spoison[r // 32, c] = True
    assert bool((u8(scales)[spoison] == 255).all())
    assert bool(is_nan_byte(u8(data)[poisoned], elem_dtype).all())
    if elem_dtype == E4M3:
        assert bool((u8(data)[poisoned] == 0x7F).all())
    assert torch.equal(u8(data)[~poisoned], u8(cd)[~poisoned]), "a NaN/Inf leaked into another block"
    assert torch.equal(u8(scales)[~spoison], u8(cs)[~spoison])
    y = dequantize_mxfp8(data, scales, dim=dim)
    assert bool(torch.isnan(y[poisoned]).all()) and not bool(torch.isnan(y[~poisoned]).any())
    check_quantization(x, data, scales, dim, mode, elem_dtype)


def test_empty_and_rank1():
    d, s = quantize_mxfp8(torch.zeros(0, 64))
    assert d.shape == (0, 64) and s.shape == (0, 2)
    d, s = quantize_mxfp8(torch.full((64,), 3.0))
    assert d.shape == (64,) and s.shape == (2,)
    assert dequantize_mxfp8(d, s).tolist() == [3.0] * 64


def test_constants():
    assert F.BLOCK_SIZE == 32 and set(F.SCALE_MODES) == {"floor", "rceil"}
    assert F.elem_max(E4M3) == 448.0 and F.elem_max(E5M2) == 57344.0
    assert F.elem_max(E4M3) == torch.finfo(E4M3).max and F.elem_max(E5M2) == torch.finfo(E5M2).max
    with pytest.raises(ValueError):
        F.elem_max(torch.float16)


def test_default_mode_is_rceil_e4m3():
    x = torch.full((1, 32), 480.0)
    d, s = quantize_mxfp8(x)
    assert d.dtype == E4M3 and int(u8(s)[0, 0]) == 128 and int(u8(d)[0, 0]) == 0x77


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dim", [((4, 48), -1), ((4, 33), 1), ((48, 64), 0), ((2, 3, 40), -1)])
def test_error_not_multiple_of_32(shape, dim):
    with pytest.raises(ValueError, match="32"):
        quantize_mxfp8(torch.ones(shape), dim=dim)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.float64, torch.uint8, E4M3])
def test_error_bad_input_dtype(dtype):
    with pytest.raises(ValueError):
        quantize_mxfp8(torch.ones(2, 32).to(dtype))


def test_error_not_a_tensor():
    with pytest.raises(TypeError, match="takes a torch.Tensor, got list"):
        quantize_mxfp8([[1.0] * 32])
    with pytest.raises(TypeError, match="data must be a torch.Tensor"):
        dequantize_mxfp8([[0] * 32], torch.zeros(1, 1, dtype=torch.uint8))


@pytest.mark.parametrize("mode", ["round", "", "ceil", "even", None])
def test_error_bad_scale_mode(mode):
    with pytest.raises(ValueError):
        quantize_mxfp8(torch.ones(2, 32), scale_mode=mode)
    with pytest.raises(ValueError):
        amax_to_e8m0(torch.ones(2), mode)


@pytest.mark.parametrize("elem", [torch.float16, torch.bfloat16, E8M0, torch.float8_e4m3fnuz, torch.uint8, "e4m3"])
def test_error_bad_elem_dtype(elem):
    with pytest.raises(ValueError):
        quantize_mxfp8(torch.ones(2, 32), elem_dtype=elem)
    with pytest.raises(ValueError):
        amax_to_e8m0(torch.ones(2), "rceil", elem)


def test_error_dequantize_shapes():
    d, s = quantize_mxfp8(torch.ones(4, 64))
    with pytest.raises(ValueError, match=r"scales of shape \(4, 1\) do not match data \(4, 64\)"):
        dequantize_mxfp8(d, s[:, :1])
    with pytest.raises(ValueError, match="has 4 elements along dim 0, not a multiple of the block size 32"):
        dequantize_mxfp8(d, s, dim=0)
    with pytest.raises(ValueError):
        dequantize_mxfp8(d.view(torch.uint8), s)


# ---------------------------------------------------------------------------------------------------------
# grouped along M (2d-3d operand, blocks along K)
# ---------------------------------------------------------------------------------------------------------

def ceil4(c):
    return -(-c // 4) * 4


def ref_group_tile_starts(offs_list):
    starts, t, prev = [], 0, 0
    for o in offs_list:
        starts.append(t)
        t += -(-(o - prev) // 128)
        prev = o
    return starts


def ref_blocked_grouped_m(scales_u8: torch.Tensor, offs_list) -> torch.Tensor:
    """Whole expected buffer from the formula: group g's local row l sits in row-tile tile_start[g] + l // 128."""
    m, c = scales_u8.shape
    ct = ceil4(c) // 4
    out = torch.zeros(grouped_scale_tiles(m, len(offs_list)) * 128 * ceil4(c), dtype=torch.uint8)
    vals = scales_u8.tolist()
    prev = 0
    for o, t0 in zip(offs_list, ref_group_tile_starts(offs_list)):
        for r in range(prev, o):
            l = r - prev
            for cc in range(c):
                tile = (t0 + l // 128) * ct + cc // 4
                out[tile * 512 + (l % 32) * 16 + ((l % 128) // 32) * 4 + cc % 4] = vals[r][cc]
        prev = o
    return out


def random_offsets(gen, max_groups=6):
    g = int(torch.randint(1, max_groups + 1, (1,), generator=gen))
    menu = [0, 0, 1, 5, 31, 32, 33, 37, 127, 128, 129, 200, 255, 256, 257]
    sizes = [menu[int(i)] if bool(torch.rand(1, generator=gen) < 0.7) else int(torch.randint(0, 300, (1,), generator=gen))
             for i in torch.randint(0, len(menu), (g,), generator=gen)]
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    m = int(offs[-1]) + int(torch.randint(0, 50, (1,), generator=gen))
    return offs, max(m, 1)


def _grouped_m_cases(rng):
    yield torch.tensor([5, 5, 42, 170], dtype=torch.int32), 200
    for _ in range(4):
        yield random_offsets(rng)


def test_group_tile_starts_fixed():
    offs = torch.tensor([5, 5, 42, 170], dtype=torch.int32)
    starts = group_tile_starts(offs)
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 1, 1, 2]
    assert grouped_scale_tiles(200, 4) == 5
    offs2 = torch.tensor([0, 128, 129, 129, 385], dtype=torch.int32)
    assert group_tile_starts(offs2).tolist() == [0, 0, 1, 2, 2]


@pytest.mark.parametrize("cols", [7, 4, 1])
def test_grouped_m_layout(cols, rng):
    for offs, m in _grouped_m_cases(rng):
        ol = offs.tolist()
        g = len(ol)
        starts = group_tile_starts(offs).tolist()
        assert starts == ref_group_tile_starts(ol), f"offs {ol}"
        last = ol[-1] - (ol[-2] if g > 1 else 0)
        assert starts[-1] + -(-last // 128) <= grouped_scale_tiles(m, g)  # the static buffer is big enough
        scales = torch.randint(1, 256, (m, cols), generator=rng, dtype=torch.uint8)
        blocked = to_blocked_scales_grouped_m(scales.view(E8M0), offs)
        assert blocked.dtype == E8M0 and blocked.dim() == 1
        assert blocked.numel() == grouped_scale_tiles(m, g) * 128 * ceil4(cols), f"offs {ol}, M {m}"
        want = ref_blocked_grouped_m(scales, ol)
        assert_bytes_equal(blocked, want, f"grouped-M buffer, offs {ol}, M {m}, C {cols}")
        # first row of each non-empty group lands at byte tile_start * 128 * ceil4(C)
        prev = 0
        for gi, o in enumerate(ol):
            if o > prev:
                assert int(u8(blocked)[starts[gi] * 128 * ceil4(cols)]) == int(scales[prev, 0]), f"group {gi}"
            prev = o
        # rows past offs[-1] are not read
        garbage = scales.clone()
        garbage[ol[-1]:] = torch.randint(0, 256, garbage[ol[-1]:].shape, generator=rng, dtype=torch.uint8)
        assert_bytes_equal(to_blocked_scales_grouped_m(garbage.view(E8M0), offs), blocked, "rows past offs[-1] read")
        # round trip; rows past offs[-1] come back zero
        back = from_blocked_scales_grouped_m(blocked, offs, m, cols)
        assert back.dtype == E8M0 and back.shape == (m, cols)
        expect = scales.clone()
        expect[ol[-1]:] = 0
        assert_bytes_equal(back, expect, f"grouped-M round trip, offs {ol}")


def test_grouped_m_from_quantized_scales(rng):
    """End to end with real data: (200, 224) quantized rowwise, offs [5, 5, 42, 170]; each group's slice of the
    buffer equals to_blocked_scales of the group's own scales."""
    offs = torch.tensor([5, 5, 42, 170], dtype=torch.int32)
    x = random_mx_input((200, 224), -1, torch.bfloat16, rng)
    _, s = quantize_mxfp8(x)
    blocked = u8(to_blocked_scales_grouped_m(s, offs))
    tile_bytes = 128 * ceil4(7)
    prev = 0
    for gi, (o, t) in enumerate(zip(offs.tolist(), group_tile_starts(offs).tolist())):
        if o > prev:
            own = u8(to_blocked_scales(s[prev:o]))
            assert_bytes_equal(blocked[t * tile_bytes: t * tile_bytes + own.numel()], own, f"group {gi}")
        prev = o


def test_grouped_m_errors():
    s = torch.zeros(200, 7, dtype=torch.uint8).view(E8M0)
    with pytest.raises(ValueError):
        to_blocked_scales_grouped_m(s, torch.tensor([5, 201], dtype=torch.int32))
    with pytest.raises(ValueError):
        to_blocked_scales_grouped_m(s, torch.tensor([5, 42], dtype=torch.int64))
    offs = torch.tensor([5, 5, 42, 170], dtype=torch.int32)
    b = to_blocked_scales_grouped_m(s, offs)
    with pytest.raises(ValueError):
        from_blocked_scales_grouped_m(b[:-1], offs, 200, 7)


# ---------------------------------------------------------------------------------------------------------
# grouped along K (2d-2d wgrad operand, blocks along the token dim)
# ---------------------------------------------------------------------------------------------------------

def _grouped_k_cases(rng):
    yield torch.tensor([5, 5, 42, 170], dtype=torch.int32), 200
    for _ in range(3):
        yield random_offsets(rng, max_groups=5)


@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_grouped_k(mode, elem_dtype, rng):
    n = 48
    for offs, m in _grouped_k_cases(rng):
        ol = offs.tolist()
        g = len(ol)
        x = random_mx_input((-(-m // 32) * 32, n), 0, torch.bfloat16, rng, wide=False)[:m]
        x_garbage = x.clone()
        x_garbage[ol[-1]:] = float("nan")  # rows past offs[-1] must not be read
        x_garbage[ol[-1]:, ::3] = 1e30
        data, scales = quantize_mxfp8_grouped_k(x_garbage, offs, scale_mode=mode, elem_dtype=elem_dtype)
        assert data.dtype == elem_dtype and data.shape == (m, n)
        assert scales.dtype == E8M0 and scales.shape == (4 * grouped_scale_tiles(m, g), n)
        d2, s2 = quantize_mxfp8_grouped_k(x, offs, scale_mode=mode, elem_dtype=elem_dtype)
        assert_bytes_equal(d2, data, "garbage past offs[-1] changed data")
        assert_bytes_equal(s2, scales, "garbage past offs[-1] changed scales")
        du, su = u8(data), u8(scales)
        assert bool((du[ol[-1]:] == 0).all()), "data rows past offs[-1] must be zero"

        used = torch.zeros(su.shape[0], dtype=torch.bool)
        prev = 0
        for gi, (o, t) in enumerate(zip(ol, ref_group_tile_starts(ol))):
            size = o - prev
            if size:
                nb = -(-size // 32)
                padded = torch.zeros(nb * 32, n, dtype=x.dtype)
                padded[:size] = x[prev:o]
                rd, rs = quantize_mxfp8(padded, dim=0, scale_mode=mode, elem_dtype=elem_dtype)
                check_quantization(padded, rd, rs, 0, mode, elem_dtype)
                assert_bytes_equal(du[prev:o], u8(rd)[:size], f"group {gi} data (offs {ol})")
                assert_bytes_equal(su[4 * t: 4 * t + nb], u8(rs), f"group {gi} scales (offs {ol})")
                used[4 * t: 4 * t + nb] = True
            prev = o
        assert bool((su[~used] == 0).all()), f"scale rows outside the groups must be zero (offs {ol})"

        # dequantize round trip: per group equal to dequantizing the padded group; zero past offs[-1]
        y = dequantize_mxfp8_grouped_k(data, scales, offs)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert bool((y[ol[-1]:] == 0).all())
        prev = 0
        for o, t in zip(ol, ref_group_tile_starts(ol)):
            size = o - prev
            if size:
                nb = -(-size // 32)
                pd = torch.zeros(nb * 32, n, dtype=torch.uint8)
                pd[:size] = du[prev:o]
                ref = dequantize_mxfp8(pd.view(elem_dtype), scales[4 * t: 4 * t + nb], dim=0)[:size]
                assert torch.equal(f32_bits(y[prev:o]), f32_bits(ref))
            prev = o
        yb = dequantize_mxfp8_grouped_k(data, scales, offs, out_dtype=torch.bfloat16)
        assert yb.dtype == torch.bfloat16 and torch.equal(f32_bits(yb.float()), f32_bits(y.to(torch.bfloat16).float()))

        # blocked layout of the GEMM operand's scale matrix scales.t() (N <= 128: one row tile, so the per-group
        # order is the whole matrix's; test_grouped_k_blocked_is_per_group covers N > 128)
        bk = to_blocked_scales_grouped_k(scales.t(), offs)
        assert_bytes_equal(bk, to_blocked_scales(scales.t().contiguous()), "grouped-K blocked")
        assert bk.numel() == blocked_scales_numel(n, 4 * grouped_scale_tiles(m, g))
        assert_bytes_equal(from_blocked_scales_grouped_k(bk, offs, n, 4 * grouped_scale_tiles(m, g)),
                           scales.t().contiguous(), "grouped-K round trip")


@pytest.mark.parametrize("n", [129, 300, 512])
def test_grouped_k_blocked_is_per_group(n, rng):
    """The grouped-K blocked buffer is the ecosystem's (``torch._scaled_grouped_mm`` 2d-2d, torchao, FBGEMM,
    cuDNN-frontend): each group's (N, ceil(size/32)) scales blocked on their own, zero-padded to whole 128 x 4
    tiles, and the non-empty groups' buffers concatenated; our buffer is that followed by zeros.  Also the byte
    map grouped_k_scale_offset, and the round trip."""
    for offs, m in [(torch.tensor([0, 31, 31, 200, 233, 600], dtype=torch.int32), 640),
                    *[random_offsets(rng, max_groups=6) for _ in range(3)]]:
        g = offs.numel()
        x = torch.randn(m, n, generator=rng)
        _, scales = quantize_mxfp8_grouped_k(x, offs)
        st = scales.t().contiguous()  # (N, 4 * tiles): the GEMM operand's scale matrix
        got = u8(to_blocked_scales_grouped_k(st, offs))
        parts, prev = [], 0
        for o, t in zip(offs.tolist(), ref_group_tile_starts(offs.tolist())):
            if o > prev:
                nb = -(-(o - prev) // 32)
                parts.append(u8(to_blocked_scales(st[:, 4 * t: 4 * t + nb].contiguous())))
            prev = o
        want = torch.cat(parts) if parts else got[:0]
        assert_bytes_equal(got[: want.numel()], want, f"per-group blocked order (offs {offs.tolist()}, N {n})")
        assert bool((got[want.numel():] == 0).all()), "bytes past the last group must be zero"
        prev = 0
        for o, t in zip(offs.tolist(), ref_group_tile_starts(offs.tolist())):
            tiles = -(-(o - prev) // 128)
            for r in (0, 1, 127, 128, n - 1):
                for b in range(-(-(o - prev) // 32)):
                    assert int(got[grouped_k_scale_offset(r, b, t, tiles, n)]) == int(u8(st)[r, 4 * t + b])
            prev = o
        back = from_blocked_scales_grouped_k(to_blocked_scales_grouped_k(st, offs), offs, n, st.shape[1])
        assert_bytes_equal(back, st, "round trip")
        assert st.shape[1] == 4 * grouped_scale_tiles(m, g)


def test_grouped_k_blocks_do_not_cross_group_end():
    """A huge value in group 0 must not change group 2's scales; an empty group contributes nothing."""
    offs = torch.tensor([5, 5, 42, 170], dtype=torch.int32)
    x = torch.ones(200, 32)
    x[4] = 2.0**20  # last row of group 0 (same first 32-row block as group 2's start without group bounds)
    data, scales = quantize_mxfp8_grouped_k(x, offs, scale_mode="floor")
    su = u8(scales)
    # group 0 -> tile 0 (scale row 0); group 2 -> tile 1 (rows 4, 5); group 3 -> tile 2 (rows 8..11)
    assert su[0].unique().tolist() == [20 - 8 + 127]
    assert su[4].unique().tolist() == [0 - 8 + 127] and su[5].unique().tolist() == [119]
    assert su[8:12].unique().tolist() == [119]
    zero_rows = [1, 2, 3, 6, 7] + list(range(12, su.shape[0]))
    assert bool((su[zero_rows] == 0).all())
    assert scales.shape == (4 * 5, 32)
    assert bool((u8(data)[5:170] == 0x78).all())  # 1.0 / 2**-8 = 256


def test_grouped_k_errors():
    with pytest.raises(ValueError):
        quantize_mxfp8_grouped_k(torch.ones(4, 8, 32), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError):
        quantize_mxfp8_grouped_k(torch.ones(40, 32), torch.tensor([41], dtype=torch.int32))
    with pytest.raises(ValueError, match="4 \\* tiles"):
        to_blocked_scales_grouped_k(torch.zeros(32, 6, dtype=torch.uint8).view(E8M0), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="scale columns"):  # offs of another operand: more tiles than the scales have
        to_blocked_scales_grouped_k(torch.zeros(32, 8, dtype=torch.uint8).view(E8M0),
                                    torch.tensor([100, 300], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        to_blocked_scales_grouped_k(torch.zeros(32, 8, dtype=torch.uint8).view(E8M0), torch.tensor([4]))
    for bad in ([250, 100, 100], [-5, 100]):  # decreasing, negative: the ops' message, not dropped groups
        offs = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(ValueError, match="non-decreasing"):
            to_blocked_scales_grouped_k(torch.zeros(32, 12, dtype=torch.uint8).view(E8M0), offs)
        with pytest.raises(ValueError, match="non-decreasing"):
            from_blocked_scales_grouped_k(torch.zeros(128 * 12, dtype=torch.uint8).view(E8M0), offs, 32, 12)


# ---------------------------------------------------------------------------------------------------------
# validate_offsets
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("offs", [
    torch.tensor([5, 3, 10], dtype=torch.int32),     # decreasing
    torch.tensor([-1, 5], dtype=torch.int32),        # negative
    torch.tensor([5, 201], dtype=torch.int32),       # offs[-1] > M
    torch.tensor([5, 42], dtype=torch.int64),        # wrong dtype
    torch.tensor([[5, 42]], dtype=torch.int32),      # 2-D
    torch.tensor([5.0, 42.0]),                       # float
    [5, 42],                                         # not a tensor
], ids=["decreasing", "negative", "past_end", "int64", "2d", "float", "list"])
def test_validate_offsets_rejects(offs):
    with pytest.raises(ValueError):
        validate_offsets(offs, 200)


@pytest.mark.parametrize("offs", [[5, 5, 42, 170], [0], [0, 0, 0], [200], [], [0, 200, 200]])
def test_validate_offsets_accepts(offs):
    validate_offsets(torch.tensor(offs, dtype=torch.int32), 200)


# ---------------------------------------------------------------------------------------------------------
# torchao parity (skips unless torchao is importable)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("elem_dtype", ELEMS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_torchao_parity(dtype, mode, elem_dtype, rng):
    """Bit-exact equality with torchao ``to_mx`` on ordinary data (normal range, no special values): per the case
    table's note, torchao 0.18 deviates on special values, so none are used here."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    to_mx = mx_tensor.to_mx
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    except ImportError:
        ScaleCalculationMode = getattr(mx_tensor, "ScaleCalculationMode", None)
        if ScaleCalculationMode is None:
            pytest.skip("this torchao has no ScaleCalculationMode")
    ao_mode = ScaleCalculationMode.FLOOR if mode == "floor" else ScaleCalculationMode.RCEIL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape in [(128, 256), (4, 8, 64)]:
        x = torch.randn(*shape[:-1], shape[-1] // 32, 32, generator=rng)
        x = x * torch.ldexp(torch.ones(x.shape[:-1]), torch.randint(-30, 31, x.shape[:-1], generator=rng)).unsqueeze(-1)
        x = x.reshape(shape).to(dtype)
        assert bool((x.abs() > 2.0**-100).all())  # normal range: no zeros, no subnormals, no specials
        out = to_mx(x.to(device).contiguous(), elem_dtype, 32, scaling_mode=ao_mode)
        # to_mx returns (scale, data); tell them apart by dtype to be robust across versions
        a, b = out[0], out[1]
        ao_scale, ao_data = (a, b) if a.dtype in (E8M0, torch.uint8) and b.dtype == elem_dtype else (b, a)
        ao_scale = u8(ao_scale.cpu().contiguous()).reshape(*shape[:-1], shape[-1] // 32)
        ao_data = u8(ao_data.cpu().contiguous()).reshape(shape)
        data, scales = quantize_mxfp8(x, scale_mode=mode, elem_dtype=elem_dtype)
        assert_bytes_equal(scales, ao_scale, f"torchao scales {shape}")
        assert_bytes_equal(data, ao_data, f"torchao data {shape}")


def test_bad_dim_and_scale_inputs_raise():
    x = torch.randn(64, 64)
    with pytest.raises(IndexError, match="out of range"):
        quantize_mxfp8(x, dim=2)
    with pytest.raises(IndexError, match="out of range"):
        quantize_mxfp8(x, dim=-3)
    d, s = quantize_mxfp8(x)
    with pytest.raises(IndexError, match="out of range"):
        dequantize_mxfp8(d, s, dim=3)
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        dequantize_mxfp8(d, s.float())
    with pytest.raises(ValueError, match="out_dtype"):
        dequantize_mxfp8(d, s, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="rank >= 1"):
        dequantize_mxfp8(d[0, 0], s[0, 0])
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        to_blocked_scales(torch.ones(4, 4))


def test_kernel_scale_offsets_match_formats():
    """The kernels' byte maps (plain Python in ``kernels.mx_math``, also traced into the DSL) are the formats
    layouts: the blocked one against to_blocked_scales, the grouped-K one against formats.grouped_k_scale_offset."""
    from cute_mxfp8.kernels import mx_math

    s = torch.arange(300 * 7, dtype=torch.int64).remainder(251).to(torch.uint8).view(300, 7)
    blocked = u8(to_blocked_scales(s.view(E8M0)))
    for r in range(300):
        for c in range(7):
            assert int(blocked[mx_math.blocked_scale_offset(r, c, 7)]) == int(s[r, c])
    for rows in (1, 128, 129, 300):
        for tile0, tiles in ((0, 1), (3, 2), (5, 4)):
            for r in {0, rows // 2, rows - 1}:
                for b in range(4 * tiles):
                    assert mx_math.grouped_k_scale_offset(r, b, tile0, tiles, rows) == \
                        grouped_k_scale_offset(r, b, tile0, tiles, rows)


# ---- the Hopper fast mode's shared 128-element scales (issue 16) ----------------------------------------------------
def _distribution(name, shape, gen):
    x = torch.randn(*shape, generator=gen)
    if name == "student_t3":
        x = x / torch.sqrt(torch.distributions.Chi2(3.0).sample(shape) / 3.0)
    elif name == "outlier_channels":
        cols = torch.randperm(shape[1], generator=gen)[: max(1, shape[1] // 100)]
        x[:, cols] *= 30.0
    elif name == "wide_rows":  # rows spanning 2**-20 .. 2**20: many blocks far below their 128-run's largest
        x = x * 2.0 ** torch.randint(-20, 21, (shape[0], shape[1] // 32), generator=gen).repeat_interleave(32, 1)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("dist", ["gaussian", "student_t3", "outlier_channels", "wide_rows"])
@pytest.mark.parametrize("elem", [E4M3, torch.float8_e5m2])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dim", [-1, 0])
def test_scale_block_128_is_mxfp8_exponent_shifted_except_subnormals(dist, elem, mode, dim, rng):
    """scale_block=128: each run of 4 MX blocks takes the largest of their 4 MX scales, and every element equals
    its MXFP8 element times 2**-(scale difference), except where that value lies in the element dtype's subnormal
    range (there the error is at most half a subnormal step, times the scale) and, in floor mode, where MXFP8
    saturated an element that the larger scale no longer clips."""
    shape = (416, 160) if dim == 0 else (160, 416)  # 416 = 3 * 128 + 32: a last run of one block
    x = _distribution(dist, shape, rng)
    x[3] = 0.0  # zero blocks beside nonzero ones (dim 0: a zero row inside column runs)
    q32, s32 = F.quantize_mxfp8(x, dim=dim, scale_mode=mode, elem_dtype=elem)
    q128, s128 = F.quantize_mxfp8(x, dim=dim, scale_mode=mode, elem_dtype=elem, scale_block=128)
    b32, b128 = (s.view(torch.uint8).movedim(dim, -1).int() for s in (s32, s128))
    nb = b32.shape[-1]
    runs = torch.nn.functional.pad(b32, (0, -nb % 4)).unflatten(-1, (-1, 4)).amax(-1)
    assert torch.equal(b128, runs.repeat_interleave(4, -1)[..., :nb])
    shift = (b128 - b32).repeat_interleave(32, -1).float()
    q32f, q128f = (q.float().movedim(dim, -1) for q in (q32, q128))
    shifted = q32f * torch.exp2(-shift)
    changed = q128f != shifted
    tiny = torch.finfo(elem).smallest_normal
    sub = changed & (shifted.abs() < tiny)
    # floor mode lets x / scale reach up to 2 * max, where MXFP8 saturates; a larger shared scale clips less
    clipped = changed & ~sub
    assert bool((q32f[clipped].abs() == torch.finfo(elem).max).all()), "a normal-range element changed"
    if mode == "rceil":
        assert not clipped.any()
    assert bool((q128f[clipped].abs() > shifted[clipped].abs()).all())
    step = tiny * 2.0 ** -(3 if elem == E4M3 else 2)  # the subnormal spacing
    exact = x.float().movedim(dim, -1) * torch.exp2(127.0 - b128.repeat_interleave(32, -1).float())  # x / s128
    assert bool(((q128f - exact)[sub].abs() <= step / 2).all())  # correctly rounded to a subnormal step
    frac = sub.float().mean().item()
    print(f"{dist} {elem} {mode} dim={dim}: {frac:.2e} of elements changed (subnormal range), "
          f"{clipped.float().mean().item():.2e} unclipped, "
          f"{(b128 != b32).float().mean().item():.2f} of blocks took a larger scale")


def test_scale_block_128_poisons_the_whole_run_and_rejects_other_sizes():
    x = torch.ones(2, 256)
    x[0, 5] = float("nan")
    q, s = F.quantize_mxfp8(x, scale_block=128)
    assert (s.view(torch.uint8)[0, :4] == 255).all() and (s.view(torch.uint8)[0, 4:] == 127 - 8).all()
    assert torch.isnan(q[0, :128].float()).all() and not torch.isnan(q[0, 128:].float()).any()
    with pytest.raises(ValueError, match="scale_block"):
        F.quantize_mxfp8(x, scale_block=64)


def test_scale_block_must_be_an_int():
    with pytest.raises(ValueError, match="scale_block"):
        F.quantize_mxfp8(torch.ones(2, 128), scale_block=128.0)


@pytest.mark.parametrize("sizes", [[0, 1, 33, 129, 300, 0], [256], [100, 28]])
def test_grouped_k_scale_block_128_runs_start_at_each_group(sizes, rng):
    """Per group: the 128-runs of the zero-padded group quantized on their own (scale_block=128), so no run
    crosses a group end and a group's last run may be shorter; the scale rows follow the 32-block layout."""
    m, n = sum(sizes) + 7, 64  # rows past offs[-1] belong to no group
    x = (torch.randn(m, n, generator=rng) * 2.0 ** torch.randint(-8, 9, (m, 1), generator=rng)).to(torch.bfloat16)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    data, scales = F.quantize_mxfp8_grouped_k(x, offs, scale_block=128)
    starts = F.group_tile_starts(offs).tolist()
    for (s, e), t in zip(F.group_bounds(offs), starts):
        if e == s:
            continue
        padded = torch.zeros((e - s + 31) // 32 * 32, n, dtype=x.dtype)
        padded[: e - s] = x[s:e]
        want_d, want_s = F.quantize_mxfp8(padded, dim=0, scale_block=128)
        assert torch.equal(data[s:e].view(torch.uint8), want_d[: e - s].view(torch.uint8))
        got_s = scales[4 * t: 4 * t + want_s.shape[0]].view(torch.uint8)
        assert torch.equal(got_s, want_s.view(torch.uint8))
        runs = got_s.int().split(4)  # each run of 4 block rows shares one scale per column
        assert all(bool((r == r[:1]).all()) for r in runs)
    with pytest.raises(ValueError, match="scale_block"):
        F.quantize_mxfp8_grouped_k(x, torch.tensor([0], dtype=torch.int32), scale_block=64)


def test_format_helpers_name_bad_arguments():
    """Wrong-typed dims, list offsets, negative row counts and scales on another device get errors that name the
    argument (they were raw TypeError / AttributeError / RuntimeError from inside torch, or a silent dim=True)."""
    x = torch.randn(4, 64)
    for bad in ("a", 1.0, True):
        with pytest.raises(TypeError, match="dim must be an int"):
            F.quantize_mxfp8(x, dim=bad)
    d, s = F.quantize_mxfp8(x)
    with pytest.raises(TypeError, match="dim must be an int"):
        F.dequantize_mxfp8(d, s, dim=None)
    with pytest.raises(ValueError, match="data is on cpu and scales on meta: move them to one device"):
        F.dequantize_mxfp8(d, s.to("meta"))
    with pytest.raises(TypeError, match=r"offs must be a 1-D torch.int32 tensor .* got list: torch.tensor"):
        F.to_blocked_scales_grouped_m(s, [2, 4])
    with pytest.raises(TypeError, match="offs must be"):
        F.quantize_mxfp8_grouped_k(torch.randn(64, 32), (32, 64))
    with pytest.raises(ValueError, match="rows must be >= 0"):
        F.from_blocked_scales(F.to_blocked_scales(s), -1, 2)
    with pytest.raises(TypeError, match="cols must be an int"):
        F.from_blocked_scales(F.to_blocked_scales(s), 4, 2.0)
    np = pytest.importorskip("numpy")  # numpy / torch integers are ints here, as they were
    assert torch.equal(F.quantize_mxfp8(x, dim=np.int64(1))[0].view(torch.uint8),
                       F.quantize_mxfp8(x, dim=1)[0].view(torch.uint8))
    assert torch.equal(F.from_blocked_scales(F.to_blocked_scales(s), np.int64(4), torch.tensor(2)), s)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        F.blocked_scales_numel(-5, 2)
    offs = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(TypeError, match="rows must be an int, got float"):
        F.from_blocked_scales_grouped_m(F.to_blocked_scales_grouped_m(s, offs), offs, 4.0, 2)
