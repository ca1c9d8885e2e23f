"""The custom ops: opcheck, fakes equal real outputs (shape, dtype, strides), values equal the formats reference,
grouped semantics (the grouped layouts of :mod:`cute_mxfp8.formats`), bad input, and backend selection."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from cute_mxfp8 import formats as F
from cute_mxfp8 import ops
from cute_mxfp8.ops import library as L
from cute_mxfp8.swiglu import pack_gate_up
from cute_mxfp8.ops.backends import Backend, BackendUnavailableError, register_backend, resolve_backend
from torch._subclasses.fake_tensor import FakeTensorMode

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
# opcheck's schema test compares inputs before/after with allclose, which torch does not implement for float8
# dtypes; for ops with fp8 inputs we run the other checks and test non-mutation ourselves (test_no_input_mutation).
FP8_INPUT_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
OFFS = [5, 5, 42, 170]  # cases section F: group sizes [5, 0, 37, 128]


def _offs(vals=OFFS):
    return torch.tensor(vals, dtype=torch.int32)


def _u8(t):
    return t.view(torch.uint8)


def _fake_matches(op, args):
    """Real and fake outputs agree in shape, dtype and strides."""
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    real = real if isinstance(real, (tuple, list)) else (real,)
    fake = fake if isinstance(fake, (tuple, list)) else (fake,)
    assert len(real) == len(fake)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    return real


QUANT_CASES = [
    ((1, 32), None), ((127, 96), None), ((129, 160), None), ((0, 64), None), ((3, 64, 96), None),
    ((200, 64), OFFS), ((170, 32), [0, 0, 170]),
]


@pytest.mark.parametrize("shape,offs", QUANT_CASES)
@pytest.mark.parametrize("blocked", [True, False])
def test_quantize_ops_opcheck_and_fakes(shape, offs, blocked, rng):
    x = torch.randn(*shape, generator=rng).to(torch.bfloat16)
    o = None if offs is None else _offs(offs)
    for op in (L._quantize_rowwise, L._quantize_colwise, L._quantize_dual):
        args = (x, "rceil", E4M3, blocked, o, "")
        opcheck(op, args)
        _fake_matches(op, args)
    for op, args in [
        (L._swiglu_quant, (torch.randn(shape[0], 128, generator=rng), "floor", E5M2, blocked, True, o, "")),
        (L._dswiglu_quant, (torch.randn(shape[0], 64, generator=rng), torch.randn(shape[0], 128, generator=rng),
                            "rceil", E4M3, blocked, False, o, "")),
    ]:
        if len(shape) == 2:
            opcheck(op, args)
            _fake_matches(op, args)


def test_gemm_ops_opcheck_and_fakes(rng):
    x, w = torch.randn(200, 64, generator=rng), torch.randn(96, 64, generator=rng)
    a, a_s = ops.quantize_rowwise(x)
    b, b_s = ops.quantize_rowwise(w)
    for dt in (torch.bfloat16, torch.float32):
        opcheck(L._mm, (a, a_s, b, b_s, dt, ""), test_utils=FP8_INPUT_CHECKS)
        _fake_matches(L._mm, (a, a_s, b, b_s, dt, ""))
    o = _offs()
    ga, ga_s = ops.quantize_rowwise(x, offs=o)
    gb, gb_s = ops.quantize_rowwise(torch.randn(4, 96, 64, generator=rng))
    opcheck(L._grouped_mm, (ga, ga_s, gb, gb_s, o, torch.bfloat16, ""), test_utils=FP8_INPUT_CHECKS)
    _fake_matches(L._grouped_mm, (ga, ga_s, gb, gb_s, o, torch.bfloat16, ""))
    wa, wa_s = ops.quantize_colwise(torch.randn(200, 96, generator=rng), offs=o)
    wb, wb_s = ops.quantize_colwise(x, offs=o)
    opcheck(L._grouped_mm_wgrad, (wa, wa_s, wb, wb_s, o, torch.float32, ""), test_utils=FP8_INPUT_CHECKS)
    _fake_matches(L._grouped_mm_wgrad, (wa, wa_s, wb, wb_s, o, torch.float32, ""))
    w1, w3 = torch.randn(2, 64, 96, generator=rng), torch.randn(2, 64, 96, generator=rng)
    for tile in (0, 32):
        opcheck(L._quantize_gate_up, (w1, w3, "rceil", E4M3, True, tile, ""))
        _fake_matches(L._quantize_gate_up, (w1, w3, "rceil", E4M3, True, tile, ""))
    for direction in ("rowwise", "colwise"):  # one pair of the outputs (the MLP's forward / backward W13 casts)
        args = (w1, w3, "rceil", E4M3, True, 0, "", 32, False, direction)
        opcheck(L._quantize_gate_up, args)
        _fake_matches(L._quantize_gate_up, args)
    xa, xa_s = ops.quantize_rowwise(torch.randn(70, 96, generator=rng))
    w13, w13_s, _, _ = ops.quantize_gate_up(torch.randn(128, 96, generator=rng), torch.randn(128, 96, generator=rng),
                                            gate_up_tile=64)
    for hp in (False, True):
        args = (xa, xa_s, w13, w13_s, "rceil", E4M3, hp, torch.bfloat16, "")
        opcheck(L._mm_swiglu_quant, args, test_utils=FP8_INPUT_CHECKS)
        _fake_matches(L._mm_swiglu_quant, args)
        w2c, w2c_s = ops.quantize_rowwise(torch.randn(128, 96, generator=rng))
        h13 = torch.randn(70, 256, generator=rng).to(torch.bfloat16)
        args = (xa, xa_s, w2c, w2c_s, h13, "floor", torch.float8_e5m2, hp, "")
        opcheck(L._mm_dswiglu_quant, args, test_utils=FP8_INPUT_CHECKS)
        _fake_matches(L._mm_dswiglu_quant, args)
    # grouped (2d-3d) fused ops: x with token groups, W13 (E, 2I, K), w2 colwise (E, I, K)
    o3 = torch.tensor([20, 20, 61], dtype=torch.int32)
    xg, xg_s = ops.quantize_rowwise(torch.randn(70, 96, generator=rng), offs=o3)
    g13, g13_s, _, _ = ops.quantize_gate_up(torch.randn(3, 64, 96, generator=rng),
                                            torch.randn(3, 64, 96, generator=rng), gate_up_tile=64)
    g2, g2_s = ops.quantize_rowwise(torch.randn(3, 64, 96, generator=rng))
    h13 = torch.randn(70, 128, generator=rng)
    for args, op in (((xg, xg_s, g13, g13_s, "rceil", E4M3, True, torch.float32, "", o3), L._mm_swiglu_quant),
                     ((xg, xg_s, g2, g2_s, h13, "floor", E4M3, False, "", o3), L._mm_dswiglu_quant)):
        opcheck(op, args, test_utils=FP8_INPUT_CHECKS)
        _fake_matches(op, args)


def test_no_input_mutation(rng):
    a, a_s = ops.quantize_rowwise(torch.randn(64, 64, generator=rng))
    before = [_u8(t).clone() for t in (a, a_s)]
    ops.mm(a, a_s, a, a_s)
    assert all(torch.equal(b, _u8(t)) for b, t in zip(before, (a, a_s)))


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_quantize_values_match_formats(mode, elem, rng):
    x = torch.randn(129, 160, generator=rng) * 10
    x[3, 5] = float("nan")
    x[40, 64:96] = 0.0
    d, s = ops.quantize_rowwise(x, scale_mode=mode, elem_dtype=elem)
    rd, rs = F.quantize_mxfp8(x, dim=-1, scale_mode=mode, elem_dtype=elem)
    assert torch.equal(_u8(d), _u8(rd)) and torch.equal(_u8(s), _u8(F.to_blocked_scales(rs)))
    # colwise equals rowwise of the transpose (data stored transposed), M padded to 160 with zeros
    cd, cs = ops.quantize_colwise(x, scale_mode=mode, elem_dtype=elem, blocked=False)
    xp = torch.cat([x, torch.zeros(31, 160)])
    td, ts = F.quantize_mxfp8(xp.t().contiguous(), dim=-1, scale_mode=mode, elem_dtype=elem)
    assert cd.shape == (160, 160) and torch.equal(_u8(cd), _u8(td)) and torch.equal(_u8(cs), _u8(ts))
    assert torch.all(_u8(cd)[:, 129:] == 0)
    # dual = rowwise + colwise
    dual = ops.quantize_dual(x, scale_mode=mode, elem_dtype=elem, blocked=False)
    assert torch.equal(_u8(dual[0]), _u8(rd)) and torch.equal(_u8(dual[2]), _u8(td))


def test_quantize_3d_weights(rng):
    w = torch.randn(3, 64, 96, generator=rng)
    d, s = ops.quantize_rowwise(w)
    assert s.shape == (3, F.blocked_scales_numel(64, 3))
    for e in range(3):
        rd, rs = F.quantize_mxfp8(w[e])
        assert torch.equal(_u8(d[e]), _u8(rd)) and torch.equal(_u8(s[e]), _u8(F.to_blocked_scales(rs)))
    cd, cs = ops.quantize_colwise(w, blocked=False)
    assert cd.shape == (3, 96, 64)
    for e in range(3):
        rd, rs = F.quantize_mxfp8(w[e].t().contiguous())
        assert torch.equal(_u8(cd[e]), _u8(rd)) and torch.equal(_u8(cs[e]), _u8(rs))


def test_quantize_gate_up_is_packed_quantization(rng):
    w1, w3 = torch.randn(64, 96, generator=rng), torch.randn(64, 96, generator=rng)
    row, row_s, col, col_s = ops.quantize_gate_up(w1, w3, blocked=False)
    w13 = torch.cat([w1, w3])
    rd, rs = F.quantize_mxfp8(w13)
    cd, cs = F.quantize_mxfp8(w13.t().contiguous())
    assert torch.equal(_u8(row), _u8(rd)) and torch.equal(_u8(row_s), _u8(rs))
    assert torch.equal(_u8(col), _u8(cd)) and torch.equal(_u8(col_s), _u8(cs))
    # one direction: that pair of the dual outputs (blocked and plain scales)
    for blocked in (False, True):
        dual = ops.quantize_gate_up(w1, w3, blocked=blocked)
        for direction, want in (("rowwise", dual[:2]), ("colwise", dual[2:])):
            got = ops.quantize_gate_up(w1, w3, blocked=blocked, direction=direction)
            assert len(got) == 2 and all(torch.equal(_u8(a), _u8(b)) for a, b in zip(got, want))
    for kw, match in ((dict(scale_mode=["rceil"]), "scale_mode must be"), (dict(elem_dtype="e4m3"), "elem_dtype"),
                      (dict(scale_block=64), "scale_block")):  # the package's messages, not the schema's
        with pytest.raises(ValueError, match=match):
            ops.quantize_gate_up(w1, w3, **kw)
    for bad, error in (("both", ValueError), ("", ValueError), ("ROWWISE", ValueError), (None, TypeError),
                       (1, TypeError), (b"rowwise", TypeError)):
        with pytest.raises(error, match="direction must be"):
            ops.quantize_gate_up(w1, w3, direction=bad)


@pytest.mark.parametrize("tile", [32, 64])
def test_quantize_gate_up_interleaved_is_quantization_of_the_interleaved_w13(rng, tile):
    # Interleaving moves whole MX blocks, so it equals quantizing the interleaved bf16 W13 itself, per expert.
    w1, w3 = torch.randn(2, 192, 96, generator=rng), torch.randn(2, 192, 96, generator=rng)
    row, row_s, col, col_s = ops.quantize_gate_up(w1, w3, blocked=False, gate_up_tile=tile)
    w13 = pack_gate_up(w1, w3, dim=-2, tile=tile)
    assert torch.equal(w13[0, tile:2 * tile], w3[0, :tile])  # gate run, then the matching up run
    rd, rs = F.quantize_mxfp8(w13)
    cd, cs = F.quantize_mxfp8(w13, dim=-2)
    assert torch.equal(_u8(row), _u8(rd)) and torch.equal(_u8(row_s), _u8(rs))
    assert torch.equal(_u8(col), _u8(cd.transpose(-1, -2))) and torch.equal(_u8(col_s), _u8(cs.transpose(-1, -2)))
    with pytest.raises(ValueError, match=r"gate_up_tile = 128 must divide I = 192 \(pad w1/w3"):
        ops.quantize_gate_up(w1, w3, gate_up_tile=128)
    with pytest.raises(ValueError, match="0 \\(concatenated W13\\) or a positive multiple of 32, got 48"):
        ops.quantize_gate_up(w1, w3, gate_up_tile=48)  # (no padding makes 48 a valid tile)


def test_fused_gemm_ops_are_the_gemm_then_the_swiglu_cast(rng):
    """mm_swiglu_quant / mm_dswiglu_quant (reference) = mm to fp32, then the SwiGLU / dSwiGLU dual cast of the
    accumulator, with the interleaved gate/up layout undone: bit for bit."""
    from cute_mxfp8.swiglu import GATE_UP_TILE as T, split_gate_up

    m, d, i = 77, 96, 192
    xa, xa_s = ops.quantize_rowwise(torch.randn(m, d, generator=rng))
    w1, w3 = torch.randn(i, d, generator=rng), torch.randn(i, d, generator=rng)
    w13, w13_s, _, _ = ops.quantize_gate_up(w1, w3, gate_up_tile=T)
    h13, *h = ops.mm_swiglu_quant(xa, xa_s, w13, w13_s, gate_up_tile=T, emit_hp=True, out_dtype=torch.float32)
    acc = ops.mm(xa, xa_s, w13, w13_s, out_dtype=torch.float32)
    assert torch.equal(h13, acc)
    want = ops.swiglu_quant(pack_gate_up(*split_gate_up(acc, tile=T)), emit_hp=True)
    for a, b in zip(h, want):
        assert torch.equal(_u8(a) if a.dtype != torch.float32 else a, _u8(b) if b.dtype != torch.float32 else b)
    w2c, w2c_s = ops.quantize_rowwise(torch.randn(i, d, generator=rng))
    dh13 = ops.mm_dswiglu_quant(xa, xa_s, w2c, w2c_s, h13, gate_up_tile=T, elem_dtype=torch.float8_e5m2)
    dh = ops.mm(xa, xa_s, w2c, w2c_s, out_dtype=torch.float32)
    ref = ops.dswiglu_quant(dh, pack_gate_up(*split_gate_up(h13, tile=T)), elem_dtype=torch.float8_e5m2,
                            blocked=False)
    row, row_s, col, col_s, _ = dh13
    unblock = lambda s, r, c: _u8(F.from_blocked_scales(s, r, c))  # noqa: E731
    inter = lambda t, dim, tile=T: pack_gate_up(*split_gate_up(t, dim=dim, tile=tile), dim=dim)  # noqa: E731
    assert torch.equal(inter(_u8(row), -1), _u8(ref[0])) and torch.equal(inter(_u8(col), 0), _u8(ref[2]))
    assert torch.equal(inter(unblock(row_s, m, 2 * i // 32), -1, T // 32), _u8(ref[1]))
    assert torch.equal(inter(unblock(col_s, 2 * i, 96 // 32), 0), _u8(ref[3]))
    with pytest.raises(ValueError, match="multiple of the gate/up tile"):
        ops.mm_swiglu_quant(xa, xa_s, *ops.quantize_rowwise(torch.randn(96, d, generator=rng)), gate_up_tile=T)
    with pytest.raises(ValueError, match=r"h13 must be \(M, 2I\)"):
        ops.mm_dswiglu_quant(xa, xa_s, w2c, w2c_s, h13[:, :128], gate_up_tile=T)
    with pytest.raises(ValueError, match="gate_up_tile must be 64"):  # a concatenated W13 would be silently wrong
        ops.mm_swiglu_quant(xa, xa_s, w13, w13_s, gate_up_tile=0)
    with pytest.raises(TypeError, match="h13 must be a torch.Tensor"):
        ops.mm_dswiglu_quant(xa, xa_s, w2c, w2c_s, None, gate_up_tile=T)


def test_grouped_fused_gemm_ops_are_the_grouped_gemm_then_the_grouped_swiglu_cast(rng):
    """With offs: grouped_mm to fp32, then swiglu_quant / dswiglu_quant with the same offs (grouped scale layouts,
    colwise blocks never crossing a group end), interleaved gate/up undone: bit for bit; rows past offs[-1] zero."""
    from cute_mxfp8.swiglu import GATE_UP_TILE as T, split_gate_up

    offs = torch.tensor([0, 50, 51, 130], dtype=torch.int32)
    m, d, i, e = 150, 96, 128, 4
    xa, xa_s = ops.quantize_rowwise(torch.randn(m, d, generator=rng), offs=offs)
    w13, w13_s, _, _ = ops.quantize_gate_up(torch.randn(e, i, d, generator=rng), torch.randn(e, i, d, generator=rng),
                                            gate_up_tile=T)
    h13, *h = ops.mm_swiglu_quant(xa, xa_s, w13, w13_s, gate_up_tile=T, emit_hp=True, out_dtype=torch.float32,
                                  offs=offs)
    acc = ops.grouped_mm(xa, xa_s, w13, w13_s, offs, out_dtype=torch.float32)
    assert torch.equal(h13, acc) and torch.all(h13[130:] == 0)
    want = ops.swiglu_quant(pack_gate_up(*split_gate_up(acc, tile=T)), emit_hp=True, offs=offs)
    for a, b in zip(h, want):
        assert torch.equal(_u8(a) if a.dtype != torch.float32 else a, _u8(b) if b.dtype != torch.float32 else b)
    w2c, w2c_s = ops.quantize_rowwise(torch.randn(e, i, d, generator=rng))
    h13b = h13.clone()
    h13b[140] = float("nan")  # past offs[-1]: reaches no output
    dh13 = ops.mm_dswiglu_quant(xa, xa_s, w2c, w2c_s, h13b, gate_up_tile=T, offs=offs)
    dh = ops.grouped_mm(xa, xa_s, w2c, w2c_s, offs, out_dtype=torch.float32)
    ref = ops.dswiglu_quant(dh, pack_gate_up(*split_gate_up(h13, tile=T)), offs=offs)
    inter = lambda t, dim, tile=T: pack_gate_up(*split_gate_up(t, dim=dim, tile=tile), dim=dim)  # noqa: E731
    assert torch.equal(inter(_u8(dh13[0]), -1), _u8(ref[0])) and torch.equal(inter(_u8(dh13[2]), 0), _u8(ref[2]))
    with pytest.raises(ValueError, match="3 groups but the weights have 4 experts|4 experts"):
        ops.mm_swiglu_quant(xa, xa_s, w13, w13_s, gate_up_tile=T, offs=offs[:3])
    with pytest.raises(ValueError, match="offs has 1 group but the weights have 4 experts: one END offset per expert"):
        ops.grouped_mm(xa, xa_s, w2c, w2c_s, offs[:1])


def test_sm100_gemm_limits_name_the_fix(rng):
    from cute_mxfp8.ops import gemm_sm100 as G
    from cute_mxfp8.ops.backends import _BACKENDS

    sm100 = _BACKENDS["sm100"]
    assert sm100.fuses_mlp and _BACKENDS["sm90"].fuses_mlp and not _BACKENDS["reference"].fuses_mlp
    assert _BACKENDS["sm90"].fuses_grouped_mlp and sm100.fuses_grouped_mlp
    for name in ("sm90", "sm100"):
        assert {"mm", "mm_swiglu_quant", "mm_dswiglu_quant"} <= set(_BACKENDS[name].ops)
    a, a_s = ops.quantize_rowwise(torch.randn(64, 96, generator=rng))
    b, b_s = ops.quantize_rowwise(torch.randn(136, 96, generator=rng))
    assert G.LIMITS["mm"](a, a_s, b, b_s, torch.bfloat16) is None
    assert "16-byte" in G.LIMITS["mm"](a, a_s, *ops.quantize_rowwise(torch.randn(100, 96)), torch.bfloat16)
    assert "contiguous" in G.LIMITS["mm"](a, a_s, torch.cat([b, b], 1)[:, ::2], b_s, torch.bfloat16)
    b, b_s = ops.quantize_rowwise(torch.randn(128, 96, generator=rng))  # I = 128
    h13 = torch.zeros(64, 2 * 128, dtype=torch.bfloat16)
    args = ("rceil", torch.float8_e4m3fn, False)
    assert G.LIMITS["mm_dswiglu_quant"](a, a_s, b, b_s, h13, *args) is None
    assert "contiguous" in G.LIMITS["mm_dswiglu_quant"](a, a_s, b, b_s, h13.t().contiguous().t(), *args)
    b96, b96_s = ops.quantize_rowwise(torch.randn(96, 96, generator=rng))
    assert "multiple of 64" in G.LIMITS["mm_dswiglu_quant"](a, a_s, b96, b96_s, h13[:, :192].contiguous(), *args)


def _sqnr(ref, x):
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def test_mm_matches_dequantized_product(rng):
    x, w = torch.randn(130, 96, generator=rng), torch.randn(70, 96, generator=rng)
    a, a_s = ops.quantize_rowwise(x)
    b, b_s = ops.quantize_rowwise(w)
    y = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32)
    da = F.dequantize_mxfp8(*F.quantize_mxfp8(x))
    db = F.dequantize_mxfp8(*F.quantize_mxfp8(w))
    torch.testing.assert_close(y, da @ db.t(), rtol=1e-5, atol=1e-4)
    assert _sqnr(x @ w.t(), y) > 27  # two e4m3 operands: ~31 dB on Gaussian data
    assert ops.mm(a, a_s, b, b_s).dtype == torch.bfloat16


def test_grouped_mm_2d3d_cases_F(rng):
    """Group sizes [5, 0, 37, 128] work unpadded; rows past offs[-1] are never read and come out zero."""
    o = _offs()
    x = torch.randn(200, 64, generator=rng)
    w = torch.randn(4, 96, 64, generator=rng)
    a, a_s = ops.quantize_rowwise(x, offs=o)
    b, b_s = ops.quantize_rowwise(w)
    y = ops.grouped_mm(a, a_s, b, b_s, o, out_dtype=torch.float32)
    dx = F.dequantize_mxfp8(*F.quantize_mxfp8(x))
    start = 0
    for g, end in enumerate(OFFS):
        dw = F.dequantize_mxfp8(*F.quantize_mxfp8(w[g]))
        torch.testing.assert_close(y[start:end], dx[start:end] @ dw.t(), rtol=1e-5, atol=1e-4)
        start = end
    assert torch.all(y[170:] == 0)
    # garbage past offs[-1] changes nothing
    a2 = a.clone()
    a2.view(torch.uint8)[170:] = 0x7F  # NaN
    assert torch.equal(ops.grouped_mm(a2, a_s, b, b_s, o, out_dtype=torch.float32), y)


def test_grouped_mm_wgrad_2d2d_cases_F(rng):
    o = _offs()
    dy, x = torch.randn(200, 96, generator=rng), torch.randn(200, 64, generator=rng)
    a, a_s = ops.quantize_colwise(dy, offs=o)
    b, b_s = ops.quantize_colwise(x, offs=o)
    assert a.shape == (96, 200) and b.shape == (64, 200)
    out = ops.grouped_mm_wgrad(a, a_s, b, b_s, o)
    assert out.shape == (4, 96, 64) and out.dtype == torch.float32
    assert torch.all(out[1] == 0)  # the empty group's wgrad is exactly zero
    start = 0
    for g, end in enumerate(OFFS):
        if end > start:
            ddy = F.dequantize_mxfp8_grouped_k(*F.quantize_mxfp8_grouped_k(dy, o), o)
            dxx = F.dequantize_mxfp8_grouped_k(*F.quantize_mxfp8_grouped_k(x, o), o)
            torch.testing.assert_close(out[g], ddy[start:end].t() @ dxx[start:end], rtol=1e-5, atol=1e-4)
            assert _sqnr(dy[start:end].t() @ x[start:end], out[g]) > 25
        start = end
    # tokens past offs[-1] are never read
    dy2 = dy.clone()
    dy2[170:] = float("inf")
    a2, a2_s = ops.quantize_colwise(dy2, offs=o)
    assert torch.equal(ops.grouped_mm_wgrad(a2, a2_s, b, b_s, o), out)


def test_swiglu_quant_matches_reference_math(rng):
    m, i = 77, 64
    h13 = torch.randn(m, 2 * i, generator=rng) * 3
    g, u = h13[:, :i], h13[:, i:]
    h = torch.nn.functional.silu(g) * u
    hr, hr_s, hc, hc_s, hp = ops.swiglu_quant(h13, blocked=False, emit_hp=True)
    rd, rs = F.quantize_mxfp8(h)
    assert torch.equal(_u8(hr), _u8(rd)) and torch.equal(_u8(hr_s), _u8(rs))
    torch.testing.assert_close(hp, h)
    assert hc.shape == (i, 96)
    dh = torch.randn(m, i, generator=rng)
    outs = ops.dswiglu_quant(dh, h13, blocked=False, emit_hp=True)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    (torch.nn.functional.silu(gg) * uu).backward(dh)
    torch.testing.assert_close(outs[4], torch.cat([gg.grad, uu.grad], dim=1), rtol=1e-5, atol=1e-5)
    assert ops.swiglu_quant(h13)[4].shape == (0,)


def test_swiglu_inf_gate_poisons_only_its_block():
    h13 = torch.ones(32, 128)
    h13[0, 0] = float("inf")
    h13[0, 64] = 0.0  # up = 0: inf * 0 -> NaN
    hr, hr_s, *_ = ops.swiglu_quant(h13, blocked=False)
    assert _u8(hr_s)[0, 0] == 255 and _u8(hr_s)[0, 1] != 255 and _u8(hr_s)[1, 0] != 255
    assert torch.isnan(hr[0, :32].float()).all() and not torch.isnan(hr[0, 32:].float()).any()


# ---- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,match", [
    (lambda: ops.quantize_rowwise(torch.randn(4, 48)), "multiple of the MX block size 32"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64).half()), "bfloat16 or float32"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64), scale_mode="ceil"), "scale_mode"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64), elem_dtype=torch.int8), "elem_dtype"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64), offs=torch.tensor([4])), "int32"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64), offs=_offs([3, 2])), "non-decreasing"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64), offs=_offs([-1, 2])), "non-decreasing"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64), offs=_offs([3, 2]), blocked=False), "non-decreasing"),
    (lambda: ops.quantize_rowwise(torch.randn(4, 64), offs=_offs([2, 5]), blocked=False), "exceeds"),
    (lambda: ops.quantize_colwise(torch.randn(4, 64), offs=_offs([2, 5])), "exceeds"),
    (lambda: ops.quantize_colwise(torch.randn(2, 48, 64)), "multiple of the MX block size 32"),
    (lambda: ops.quantize_gate_up(torch.randn(64, 64), torch.randn(32, 64)), "must match"),
    (lambda: ops.swiglu_quant(torch.randn(4, 96)), "pad gate and up EACH"),
    (lambda: ops.dswiglu_quant(torch.randn(4, 64), torch.randn(4, 128, device="meta")), "move them with .to"),
    (lambda: ops.dswiglu_quant(torch.randn(4, 32), torch.randn(4, 128)), "dh must be"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("op", [ops.quantize_rowwise, ops.quantize_colwise, ops.quantize_dual])
def test_quantize_wrappers_check_types(op):
    """The eager wrappers skip the dispatcher, so they repeat the schema's type checks."""
    with pytest.raises(TypeError, match="blocked must be a bool"):
        op(torch.randn(4, 64), blocked="no")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        op(None)


def test_kernel_limits_refuse_scale_buffers_past_int32():
    """Grouped layouts reserve M // 128 + G tiles: with many tiny groups the scale buffer outgrows 32-bit offsets
    while x itself is below the element limit; the kernels refuse (the reference takes the call)."""
    from cute_mxfp8.ops.cute_kernels import _limits

    x = torch.empty(80000, 16384, dtype=torch.bfloat16, device="meta")
    many = torch.empty(40000, dtype=torch.int32, device="meta")
    assert "scale buffer" in _limits(x, "rceil", torch.float8_e4m3fn, True, many)
    assert _limits(x, "rceil", torch.float8_e4m3fn, True, many[:8]) is None


@pytest.mark.parametrize("op", [ops.swiglu_quant, ops.dswiglu_quant])
def test_swiglu_wrappers_check_types(op):
    args = (torch.randn(4, 32),) if op is ops.dswiglu_quant else ()
    with pytest.raises(TypeError, match="emit_hp must be a bool"):
        op(*args, torch.randn(4, 64), emit_hp=1)
    with pytest.raises(TypeError, match="h13 must be a torch.Tensor"):
        op(*args, [[0.0] * 64])


def test_ops_are_not_differentiable_on_any_path():
    """Inputs that require grad go through the dispatcher, so backward says the op has no autograd formula (the
    eager shortcut would otherwise differentiate through whichever backend ran), names the op the gradient reached
    and the differentiable entry points; every op, each as the last one before the loss."""
    h13 = torch.randn(8, 64, requires_grad=True)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(2, 64, 64, requires_grad=True)
    offs = _offs([24, 64])
    qx, sx = ops.quantize_rowwise(x)
    qg, sg = ops.quantize_rowwise(x, offs=offs)
    qw, sw = ops.quantize_rowwise(w)
    qt, st = ops.quantize_colwise(x, offs=offs)
    cases = {
        "swiglu_quant": ops.swiglu_quant(h13, emit_hp=True)[4],
        "dswiglu_quant": ops.dswiglu_quant(torch.randn(8, 32), h13, emit_hp=True)[4],
        "quantize_rowwise": qx,
        "quantize_colwise": ops.quantize_colwise(x)[0],
        "quantize_dual": ops.quantize_dual(x)[2],
        "quantize_gate_up": ops.quantize_gate_up(w, w)[0],
        "mm": ops.mm(qx, sx, qx, sx),
        "grouped_mm": ops.grouped_mm(qg, sg, qw, sw, offs),
        "grouped_mm_wgrad": ops.grouped_mm_wgrad(qt, st, qt, st, offs),
    }
    for name, out in cases.items():
        assert out.requires_grad, name
        with pytest.raises(RuntimeError, match=f"cute_mxfp8::{name} has no autograd formula .*mxfp8_linear"):
            out.float().sum().backward()
    from torch._library.custom_ops import CustomOpDef

    from cute_mxfp8.ops import library as L

    defs = [v for v in vars(L).values() if isinstance(v, CustomOpDef)]  # the rest (fused GEMMs, hp wgrad) too
    assert len(defs) == 12 and all(d._backward_fn is not None for d in defs)
    with torch.no_grad():  # no graph, no error; detached inputs likewise
        assert not ops.quantize_rowwise(x)[0].requires_grad
    assert not ops.quantize_rowwise(x.detach())[0].requires_grad


def test_ops_without_a_gradient_fail_to_compile_with_the_same_message():
    """Under torch.compile AOTAutograd traces the backward when an input requires grad: the op's error reaches the
    user at compile time, naming the fix."""
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda x: ops.quantize_rowwise(x)[0].float().sum(), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="cute_mxfp8::quantize_rowwise has no autograd formula"):
        f(x).backward()


def test_kernel_limits_refuse_strided_offs_and_padded_colwise_past_int32():
    from cute_mxfp8.ops.cute_kernels import _limits, _swiglu_limits

    strided = torch.tensor([2, 4, 6, 8], dtype=torch.int32)[::2]
    assert "contiguous" in _limits(torch.zeros(64, 128), "rceil", torch.float8_e4m3fn, True, strided)
    assert "contiguous" in _swiglu_limits(torch.zeros(64, 128), "rceil", torch.float8_e4m3fn, True, False, strided)
    # dh13 colwise is (2I, ceil(M / 32) * 32): past 2**31 - 1 elements although h13 (M, 2I) is below
    h13 = torch.empty(11184810, 192, dtype=torch.bfloat16, device="meta")
    dh = torch.empty(11184810, 96, dtype=torch.bfloat16, device="meta")
    assert h13.numel() < 2**31 and "int32" in _swiglu_limits(dh, h13, "rceil", torch.float8_e4m3fn, True, False, None)
    assert _swiglu_limits(dh[:11184800], h13[:11184800], "rceil", torch.float8_e4m3fn, True, False, None) is None


def test_gemm_bad_input(rng):
    a, a_s = ops.quantize_rowwise(torch.randn(64, 64, generator=rng))
    b, b_s = ops.quantize_rowwise(torch.randn(32, 96, generator=rng))
    with pytest.raises(ValueError, match="expected"):
        ops.mm(a, a_s, b, b_s)
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        ops.mm(a, a_s.view(torch.uint8), a, a_s)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        ops.mm(a.view(torch.uint8), a_s, a, a_s)
    with pytest.raises(ValueError, match="out_dtype"):
        ops.mm(a, a_s, a, a_s, out_dtype=torch.float16)
    w, w_s = ops.quantize_rowwise(torch.randn(3, 32, 64, generator=rng))
    g, g_s = ops.quantize_rowwise(torch.randn(64, 64, generator=rng), offs=_offs([10, 20]))
    with pytest.raises(ValueError, match="experts"):
        ops.grouped_mm(g, g_s, w, w_s, _offs([10, 20]))


# ---- backends -------------------------------------------------------------------------------------------

@pytest.fixture
def scratch_registry():
    """Backends registered by a test are removed afterwards."""
    from cute_mxfp8.ops import backends
    saved, order = dict(backends._BACKENDS), list(backends._ORDER)
    yield
    backends._BACKENDS.clear()
    backends._BACKENDS.update(saved)
    backends._ORDER[:] = order


def test_backend_selection_and_explicit_errors(monkeypatch, scratch_registry):
    monkeypatch.delenv("CUTE_MXFP8_BACKEND", raising=False)
    assert resolve_backend("cpu") == "reference"
    register_backend(Backend("test_never", 100, lambda d: "needs hardware this test never has",
                             ops={"mm": lambda *a: None}))
    assert resolve_backend("cpu") == "reference"  # unavailable backends are never picked automatically
    with pytest.raises(BackendUnavailableError, match="needs hardware this test never has"):
        resolve_backend("cpu", "test_never")
    x = torch.randn(32, 64)
    with pytest.raises(BackendUnavailableError, match="test_never"):
        ops.quantize_rowwise(x, backend="test_never")
    monkeypatch.setenv("CUTE_MXFP8_BACKEND", "test_never")
    with pytest.raises(BackendUnavailableError):
        ops.quantize_rowwise(x)
    monkeypatch.setenv("CUTE_MXFP8_BACKEND", "nope")
    with pytest.raises(BackendUnavailableError, match="unknown"):
        ops.quantize_rowwise(x)
    monkeypatch.setenv("CUTE_MXFP8_BACKEND", "reference")
    assert ops.quantize_rowwise(x)[0].shape == (32, 64)


def test_explicit_backend_without_the_op_raises(monkeypatch, scratch_registry):
    monkeypatch.delenv("CUTE_MXFP8_BACKEND", raising=False)
    register_backend(Backend("test_partial", 100, lambda d: None, ops={"mm": lambda *a: None}))
    with pytest.raises(BackendUnavailableError, match="does not implement"):
        ops.quantize_rowwise(torch.randn(32, 64), backend="test_partial")
    # automatic choice per op: test_partial has no quantize, so the reference runs quantize
    assert resolve_backend("cpu", op="quantize_rowwise") == "reference"
    assert resolve_backend("cpu", op="mm") == "test_partial"


def test_kernel_backends_refuse_cpu_and_unimplemented_ops(monkeypatch):
    monkeypatch.setenv("CUTE_MXFP8_BACKEND", "sm100")
    with pytest.raises(BackendUnavailableError, match="needs an SM100"):
        ops.quantize_rowwise(torch.randn(32, 64))
    monkeypatch.setenv("CUTE_MXFP8_BACKEND", "sm90")
    with pytest.raises(BackendUnavailableError, match="needs an SM90"):
        ops.mm(*ops.quantize_rowwise(torch.randn(32, 64), backend="reference"),
               *ops.quantize_rowwise(torch.randn(32, 64), backend="reference"))
    monkeypatch.delenv("CUTE_MXFP8_BACKEND")
    assert resolve_backend("cpu", op="quantize_rowwise") == "reference"


def test_convert_gate_up_between_the_ecosystem_layouts(rng):
    """Concatenated (HF gate_up_proj) <-> runs of 64 (our SM100 GEMM) <-> runs of 32 (cuDNN-frontend): exact
    permutations; element (gate feature j) lands where each layout's definition puts it."""
    from cute_mxfp8.swiglu import convert_gate_up

    e, i, d = 3, 128, 8
    w13 = torch.randn(e, 2 * i, d, generator=rng)
    gate, up = w13[:, :i], w13[:, i:]
    w64 = convert_gate_up(w13)  # concatenated -> 64
    w32 = convert_gate_up(w64, from_tile=64, to_tile=32)
    assert torch.equal(w64[:, 0:64], gate[:, 0:64]) and torch.equal(w64[:, 64:128], up[:, 0:64])
    assert torch.equal(w32[:, 32:64], up[:, 0:32]) and torch.equal(w32[:, 64:96], gate[:, 32:64])
    assert torch.equal(convert_gate_up(w32, from_tile=32, to_tile=None), w13)
    h = torch.randn(5, 2 * i, generator=rng)  # activations: dim=-1
    assert torch.equal(convert_gate_up(convert_gate_up(h, dim=-1), dim=-1, from_tile=64, to_tile=None), h)
    with pytest.raises(ValueError, match="multiple of the gate/up tile"):
        convert_gate_up(torch.randn(2 * 48, 8))  # I = 48 is not a multiple of 64
    with pytest.raises(ValueError, match=r"must be positive, got 0: the concatenated layout is tile=None here"):
        convert_gate_up(w13, from_tile=0)  # (quantize_gate_up's spelling of it)
    with pytest.raises(TypeError, match="an int or None, got str"):
        convert_gate_up(w13, to_tile="64")


@pytest.mark.parametrize("grouped", [False, True])
def test_kernel_backend_cast_outputs_never_share_storage(grouped, monkeypatch):
    """torch's custom-op dispatcher rejects outputs that alias each other (torch.compile, opcheck, grad-requiring
    inputs): the kernel backends' dual and SwiGLU casts must allocate every output on its own.  Checked on the CPU
    with the sm90 implementations' allocation code and the kernel launches stubbed out."""
    from cute_mxfp8.ops import cute_kernels as CK

    monkeypatch.setattr(CK, "compile_quant", lambda *a, **k: (lambda *t: None))
    monkeypatch.setattr(CK, "_launch_swiglu", lambda *a, **k: None)
    offs = torch.tensor([50, 50, 190], dtype=torch.int32) if grouped else None
    x = torch.randn(200, 96)
    ops_ = CK._ops("sm_90a")
    sw = CK._swiglu_ops("sm_90a")
    calls = [ops_["quantize_dual"](x, "rceil", torch.float8_e4m3fn, True, offs, 128, 128 if grouped else 0),
             ops_["quantize_dual"](x, "rceil", torch.float8_e4m3fn, False, offs),
             sw["swiglu_quant"](x, "rceil", torch.float8_e4m3fn, True, True, offs),
             sw["dswiglu_quant"](x[:, :48], x, "rceil", torch.float8_e4m3fn, True, False, offs)]
    for outs in calls:
        ptrs = [t.untyped_storage().data_ptr() for t in outs if t.numel()]
        assert len(set(ptrs)) == len(ptrs)
