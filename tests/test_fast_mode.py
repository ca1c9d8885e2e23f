"""The Hopper fast mode (issue 16) through the ops and the autograd functions: ``scale_block=128`` casts (every
run of 4 MX blocks along the scaled dim takes the largest of their scales), the GEMM ops' ``scale_block`` hint,
and ``MXFP8Config(hopper_block_k=128)``.  The formats-level numerics (exponent-shifted MXFP8 bytes except the
subnormal range) are tested in ``test_formats.py``; here the reference backend is the oracle on the CPU and the
``sm90`` kernels must equal it bit for bit on the H200 (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from cute_mxfp8 import MXFP8Config, ops
from cute_mxfp8 import formats as F
from cute_mxfp8.ops import autograd as AG
from cute_mxfp8.ops import library as L

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FAST = MXFP8Config(hopper_block_k=128)


def _u8(t):
    return t.view(torch.uint8)


def _equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(_u8(g).cpu(), _u8(w).cpu()), f"{(_u8(g).cpu() != _u8(w).cpu()).sum().item()} bytes differ"


def _runs_equal(scales: torch.Tensor, dim: int) -> bool:
    """Every run of 4 plain scales along ``dim`` (from index 0) holds one value."""
    s = _u8(scales).movedim(dim, -1)
    n = s.shape[-1]
    padded = torch.nn.functional.pad(s.float(), (0, -n % 4), value=-1)  # a partial last run: its real scales equal
    runs = padded.reshape(*padded.shape[:-1], -1, 4)
    real = runs >= 0
    first = runs[..., :1].expand_as(runs)
    return bool(((runs == first) | ~real).all())


def _sqnr(ref, x):
    ref, x = ref.double(), x.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


# ---- the ops -----------------------------------------------------------------------------------------------------

def test_scale_block_is_checked_by_every_op(rng):
    x = torch.randn(64, 256, generator=rng)
    q, s = ops.quantize_rowwise(x)
    for call in (lambda: ops.quantize_rowwise(x, scale_block=64), lambda: ops.quantize_colwise(x, scale_block=0),
                 lambda: ops.quantize_dual(x, scale_block=True), lambda: ops.swiglu_quant(x, scale_block=16),
                 lambda: ops.mm(q, s, q, s, scale_block=256),
                 lambda: ops.quantize_gate_up(x[:32], x[32:], scale_block=33)):
        with pytest.raises(ValueError, match="scale_block"):
            call()


@pytest.mark.parametrize("name", ["quantize_rowwise", "quantize_colwise", "quantize_dual"])
def test_fast_mode_casts_pass_opcheck(name, rng):
    x = torch.randn(200, 160, generator=rng)
    op = getattr(L, f"_{name}")
    opcheck(op, (x, "rceil", E4M3, True, None, "", 128))
    opcheck(op, (x, "floor", E5M2, False, torch.tensor([5, 5, 130], dtype=torch.int32), "", 128))
    if name != "quantize_rowwise":  # the padded group layout's shapes: fake == real
        opcheck(op, (x, "rceil", E4M3, True, torch.tensor([5, 5, 130], dtype=torch.int32), "", 128, 128))
        opcheck(op, (x, "rceil", E4M3, False, torch.tensor([0, 0], dtype=torch.int32), "", 32, 128))


@pytest.mark.parametrize("shape,offs", [((127, 96), None), ((300, 416), None), ((3, 64, 256), None),
                                        ((200, 160), [5, 5, 42, 170]), ((170, 32), [0, 0, 170])])
def test_reference_casts_are_the_formats_128_block_quantization(shape, offs, rng):
    """Rowwise scales repeat in runs of 4 along K, colwise along the tokens (from each group's start), and the
    data is ``formats.quantize_mxfp8(..., scale_block=128)``'s."""
    x = torch.randn(*shape, generator=rng) * torch.logspace(-6, 6, shape[-1])
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    q, s, qt, st = ops.quantize_dual(x, blocked=False, offs=o, scale_block=128)
    want_q, want_s = F.quantize_mxfp8(x, scale_block=128)
    assert torch.equal(_u8(q), _u8(want_q)) and torch.equal(_u8(s), _u8(want_s)) and _runs_equal(s, -1)
    if o is None and x.dim() == 2:
        xp = torch.cat([x, x.new_zeros(-x.shape[0] % 32, x.shape[1])])
        want_qt, want_st = F.quantize_mxfp8(xp, dim=0, scale_block=128)
        assert torch.equal(_u8(qt), _u8(want_qt.t())) and torch.equal(_u8(st), _u8(want_st.t()))
        assert _runs_equal(st, -1)
    elif o is not None:
        want_qt, want_st = F.quantize_mxfp8_grouped_k(x, o, scale_block=128)
        assert torch.equal(_u8(qt), _u8(want_qt.t())) and torch.equal(_u8(st), _u8(want_st.t()))
    # the 32-block casts of the same tensor differ where a run's blocks have different scales (K > 32)
    if shape[-1] > 32:
        assert not torch.equal(_u8(s), _u8(ops.quantize_rowwise(x, blocked=False, offs=o)[1]))


@pytest.mark.parametrize("sizes", [[5, 0, 37, 128], [300], [0, 0], [129, 1, 255]], ids=str)
@pytest.mark.parametrize("scale_block", [32, 128])
def test_token_align_pads_each_group_with_zero_tokens(sizes, scale_block, rng):
    """``token_align=128``: group g's colwise data sits at column padded[g - 1] (the unpadded cast's columns
    there), zeros fill the rest; each group's scales are the unpadded cast's, except that in the fast mode the
    padding blocks of a group's last 128-run take the run's scale (they belong to it); rowwise outputs unchanged;
    the wgrad of padded operands on the padded offsets equals the unpadded one."""
    m = sum(sizes) + 9  # rows past offs[-1]: no group
    x = torch.randn(m, 96, generator=rng) * torch.logspace(-3, 3, 96)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    kw = dict(offs=offs, blocked=False, scale_block=scale_block)
    q, s, qt, st = ops.quantize_dual(x, **kw)
    pq, ps, pqt, pst = ops.quantize_dual(x, token_align=128, **kw)
    assert torch.equal(_u8(pq), _u8(q)) and torch.equal(_u8(ps), _u8(s))
    padded = F.padded_group_offsets(offs)
    assert pqt.shape == (96, 128 * (m // 128 + len(sizes))) and pst.shape == (96, pqt.shape[1] // 32 + 4 * len(sizes))
    want = torch.zeros_like(_u8(pqt))
    tiles = F.group_tile_starts(offs).tolist()
    for (a, b), p, t in zip(F.group_bounds(offs), [0] + padded.tolist()[:-1], tiles):
        want[:, p:p + b - a] = _u8(qt)[:, a:b]
        assert p == 128 * t
        nb = -(-(b - a) // 32)  # the group's own blocks: the unpadded cast's scales
        assert torch.equal(_u8(pst)[:, 4 * t:4 * t + nb], _u8(st)[:, 4 * t:4 * t + nb])
        pad_blocks = _u8(pst)[:, 4 * t + nb:4 * t + 4 * -(-(b - a) // 128)]
        if scale_block == 128 and pad_blocks.numel():  # padding blocks of the last run share its scale
            assert torch.equal(pad_blocks, _u8(st)[:, 4 * t + nb - 1:4 * t + nb].expand_as(pad_blocks))
        elif pad_blocks.numel():
            assert torch.all(pad_blocks == 0)  # all-zero 32-blocks: amax 0, scale byte 0
    assert torch.equal(_u8(pqt), want)
    dy = torch.randn(m, 64, generator=rng)
    (a, a_s), (b, b_s) = (ops.quantize_colwise(v, offs=offs, scale_block=scale_block) for v in (dy, x))
    (pa, pa_s), (pb, pb_s) = (ops.quantize_colwise(v, offs=offs, scale_block=scale_block, token_align=128)
                              for v in (dy, x))
    w = ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, scale_block=scale_block)
    pw = ops.grouped_mm_wgrad(pa, pa_s, pb, pb_s, padded, scale_block=scale_block)
    assert torch.allclose(pw, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


@pytest.mark.parametrize("scale_block", [32, 128])
def test_split_halves_is_the_wgrad_with_its_rows_regrouped(scale_block, rng):
    """``grouped_mm_wgrad(..., split_halves=True)`` is (2, G, N / 2, K): every group's first N / 2 rows, then the
    others, each half contiguous; the fake gives the same shape; N % 256 != 0 is refused."""
    offs = torch.tensor([0, 130, 130, 400], dtype=torch.int32)
    dh, x = torch.randn(400, 512, generator=rng), torch.randn(400, 96, generator=rng)
    a, b = (ops.quantize_colwise(v, offs=offs, scale_block=scale_block) for v in (dh, x))
    full = ops.grouped_mm_wgrad(*a, *b, offs, scale_block=scale_block, out_dtype=torch.bfloat16)
    halves = ops.grouped_mm_wgrad(*a, *b, offs, scale_block=scale_block, out_dtype=torch.bfloat16, split_halves=True)
    assert halves.shape == (2, 4, 256, 96) and halves.is_contiguous()
    assert torch.equal(halves[0], full[:, :256]) and torch.equal(halves[1], full[:, 256:])
    from test_ops import FP8_INPUT_CHECKS  # the schema check compares fp8 inputs with allclose, which torch lacks

    opcheck(L._grouped_mm_wgrad, (*a, *b, offs, torch.float32, "", scale_block, True), test_utils=FP8_INPUT_CHECKS)
    small = ops.quantize_colwise(dh[:, :384], offs=offs, scale_block=scale_block)
    with pytest.raises(ValueError, match="multiple of 256"):
        ops.grouped_mm_wgrad(*small, *b, offs, scale_block=scale_block, split_halves=True)


def test_fast_mode_grouped_mlp_gives_contiguous_gate_and_up_gradients(rng):
    """The grouped fast mode's dW13 comes split: w1.grad and w3.grad are the parameters' own layout (no strided
    copy by autograd), and equal the halves of the packed product."""
    e, d, i = 3, 64, 128
    offs = torch.tensor([50, 50, 300], dtype=torch.int32)
    w1, w3 = (torch.randn(e, i, d, generator=rng).requires_grad_() for _ in range(2))
    w2 = torch.randn(e, d, i, generator=rng).requires_grad_()
    x = torch.randn(300, d, generator=rng)
    AG.mxfp8_swiglu_mlp(x, w1, w2, w3, offs, MXFP8Config(hopper_block_k=128)).sum().backward()
    for w in (w1, w3):
        assert w.grad.shape == w.shape and w.grad.stride() == w.stride() and torch.isfinite(w.grad).all()
    assert w1.grad[0].abs().sum() > 0 and w3.grad[2].abs().sum() > 0 and torch.all(w1.grad[1] == 0)


def test_token_align_is_checked():
    x, offs = torch.randn(64, 64), torch.tensor([10, 64], dtype=torch.int32)
    assert torch.equal(ops.padded_offsets(offs), torch.tensor([128, 256], dtype=torch.int32))
    for call, match in ((lambda: ops.quantize_colwise(x, token_align=128), "pass offs"),
                        (lambda: ops.padded_offsets(offs, 64), "must be 128"),
                        (lambda: ops.padded_offsets([10, 64]), "offs must be"),
                        (lambda: ops.padded_offsets(offs.long()), "int32"),
                        (lambda: F.pad_token_groups(x, [10, 64]), "offs must be"),
                        (lambda: F.padded_group_offsets(offs, 0), "positive int"),
                        (lambda: F.pad_token_groups(x, offs, -128), "positive int"),
                        (lambda: F.pad_token_groups(x[None], offs), "2-D"),
                        (lambda: F.pad_token_groups(x, torch.tensor([70], dtype=torch.int32)), "offs"),
                        (lambda: ops.quantize_dual(x, offs=offs, token_align=16), "0 or 128"),
                        (lambda: ops.dswiglu_quant(x[:, :32], x, token_align=128), "pass offs")):
        with pytest.raises(ValueError, match=match):
            call()
    for call in (lambda: ops.quantize_colwise(x, offs=offs, token_align=None),
                 lambda: ops.swiglu_quant(x, offs=offs, token_align=None),
                 lambda: ops.swiglu_quant(x, offs=offs, token_align=True)):
        with pytest.raises(TypeError, match="token_align must be an int"):
            call()


def test_groups_aligned_is_decided_from_the_host_copy_only():
    """The wgrad skips its gather only where the offsets' host values are known and every group (and the token
    count) is a multiple of the alignment."""
    from cute_mxfp8.ops import group_meta
    from cute_mxfp8.ops.token_layout import _groups_aligned

    aligned, odd = torch.tensor([128, 128, 512], dtype=torch.int32), torch.tensor([128, 130, 512], dtype=torch.int32)
    assert not _groups_aligned(aligned, 512, 128)  # no host copy known yet: no decision from the device
    for o in (aligned, odd):
        group_meta.validated_end(o, 512)
    assert _groups_aligned(aligned, 512, 128) and not _groups_aligned(odd, 512, 128)
    assert not _groups_aligned(aligned, 520, 128)  # the operands' width is not aligned
    assert _groups_aligned(aligned, 512, 16) and not _groups_aligned(odd, 512, 16)


def test_gate_up_128_blocks_hold_one_projection(rng):
    w1, w3 = (torch.randn(256, 64, generator=rng) * torch.logspace(-4, 4, 256)[:, None] for _ in range(2))
    row, row_s, col, col_s = ops.quantize_gate_up(w1, w3, blocked=False, scale_block=128)
    # W13 = [w1; w3] quantized whole: the same bytes (I % 128 == 0, so no 128-block mixes the two)
    w13 = torch.cat([w1, w3])
    for got, want in zip((row, row_s, col, col_s), ops.quantize_dual(w13, blocked=False, scale_block=128)):
        assert torch.equal(_u8(got), _u8(want))
    with pytest.raises(ValueError, match="I % 128 == 0"):
        ops.quantize_gate_up(w1[:96], w3[:96], scale_block=128)
    with pytest.raises(ValueError, match="gate_up_tile"):
        ops.quantize_gate_up(w1, w3, gate_up_tile=64, scale_block=128)


def test_gemm_hint_leaves_the_reference_product_unchanged_and_is_checked_there(rng):
    (a, a_s), (b, b_s) = (ops.quantize_rowwise(torch.randn(r, 288, generator=rng) * torch.logspace(-4, 4, 288),
                                               scale_block=128) for r in (96, 160))
    assert torch.equal(ops.mm(a, a_s, b, b_s, scale_block=128), ops.mm(a, a_s, b, b_s))
    # 32-block operands break the promise: the reference says so (the sm90 kernel would compute another product)
    c, c_s = ops.quantize_rowwise(torch.randn(160, 288, generator=rng) * torch.logspace(-4, 4, 288))
    with pytest.raises(ValueError, match="b's scales are not equal in runs of 4"):
        ops.mm(a, a_s, c, c_s, scale_block=128)
    for bad in ("128", 128.0, True):  # the wrappers' ValueError, not the dispatcher's schema error
        with pytest.raises(ValueError, match="scale_block"):
            ops.mm(a, a_s, b, b_s, scale_block=bad)
        with pytest.raises(ValueError, match="scale_block"):
            ops.quantize_gate_up(torch.randn(128, 64), torch.randn(128, 64), scale_block=bad)


def _hint_is_kept_or_refused(op, args, keeps_promise: bool, match: str) -> None:
    """``op(*args, scale_block=128)``: the product without the hint, or the reference's ValueError."""
    if keeps_promise:
        assert torch.equal(op(*args, scale_block=128), op(*args))
    else:
        with pytest.raises(ValueError, match=match):
            op(*args, scale_block=128)


def test_grouped_gemm_hints_are_checked_by_the_reference(rng):
    """grouped_mm / grouped_mm_wgrad with scale_block=128: the same product as without the hint on operands
    that keep the promise (runs of 4 from K's start, or from each token group's start); 32-block operands raise
    (the sm90 fast kernels would read only the first scale of each run)."""
    offs = torch.tensor([0, 70, 70, 200, 256], dtype=torch.int32)
    x = torch.randn(300, 288, generator=rng) * torch.logspace(-4, 4, 288)
    w = torch.randn(5, 96, 288, generator=rng) * torch.logspace(-4, 4, 288)
    dy = torch.randn(300, 80, generator=rng) * torch.logspace(-4, 4, 300)[:, None]
    for block in (128, 32):
        a, a_s = ops.quantize_rowwise(x, offs=offs, scale_block=block)
        b, b_s = ops.quantize_rowwise(w, scale_block=block)
        _hint_is_kept_or_refused(ops.grouped_mm, (a, a_s, b, b_s, offs), block == 128,
                                 "a's scales are not equal in runs of 4")
        (ga, ga_s), (gb, gb_s) = (ops.quantize_colwise(v, offs=offs, scale_block=block) for v in (dy, x))
        _hint_is_kept_or_refused(ops.grouped_mm_wgrad, (ga, ga_s, gb, gb_s, offs), block == 128,
                                 "a's scales are not equal in runs of 4")
    # a 128-block activation with 32-block experts: the experts' scales break it
    (a, a_s), (b, b_s) = ops.quantize_rowwise(x, offs=offs, scale_block=128), ops.quantize_rowwise(w)
    _hint_is_kept_or_refused(ops.grouped_mm, (a, a_s, b, b_s, offs), False, "b's scales are not equal in runs of 4")


# ---- the config and the autograd functions -------------------------------------------------------------------

def test_config_rules():
    with pytest.raises(ValueError, match="hopper_block_k"):
        MXFP8Config(hopper_block_k=64)
    with pytest.raises(ValueError, match="fsdp_mxfp8_all_gather"):
        MXFP8Config(hopper_block_k=128, fsdp_mxfp8_all_gather=True)
    cpu = torch.device("cpu")
    assert AG.scale_block(FAST, cpu) == 128 and AG.scale_block(MXFP8Config(), cpu) == 32
    x, w1, w3, w2 = torch.randn(64, 64), torch.randn(96, 64), torch.randn(96, 64), torch.randn(64, 96)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        ops.mxfp8_swiglu_mlp(x, w1, w2, w3, config=FAST)
    with pytest.raises(ValueError, match="fused_epilogues=True"):
        MXFP8Config(hopper_block_k=128, fused_epilogues=True)


class _SwiGLUFFN(torch.nn.Module):
    """A torchtitan-style SwiGLU FFN ``w2(silu(w1(x)) * w3(x))`` (what convert_to_mxfp8 fuses)."""

    def __init__(self, d, i):
        super().__init__()
        lin = torch.nn.Linear
        self.w1, self.w2, self.w3 = lin(d, i, bias=False), lin(i, d, bias=False), lin(d, i, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


def test_modules_and_convert_take_only_whole_128_hidden_blocks():
    from torch import nn

    from cute_mxfp8 import MXFP8GroupedExperts, MXFP8SwiGLUMLP, convert_to_mxfp8

    with pytest.raises(ValueError, match="multiple of 128"):
        MXFP8SwiGLUMLP(256, 320, config=FAST)
    with pytest.raises(ValueError, match="multiple of 128"):
        MXFP8GroupedExperts(256, 320, 4, config=FAST)
    MXFP8SwiGLUMLP(256, 320)  # plain MXFP8 takes it

    model = nn.Sequential(_SwiGLUFFN(256, 320), _SwiGLUFFN(256, 384))
    report = convert_to_mxfp8(model, config=FAST)
    assert type(model[1]).__name__ == "MXFP8SwiGLUMLP" and type(model[0]) is _SwiGLUFFN
    assert [fqn for fqn, _ in report.converted] == ["0.w1", "0.w2", "0.w3", "1"]
    assert any(fqn == "0" and "multiple of 128" in why for fqn, why in report.skipped)
    x = torch.randn(8, 256, requires_grad=True)
    model(x).sum().backward()  # every converted layer runs in the fast mode
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_modules_and_convert_with_fused_epilogues_take_only_whole_64_hidden_runs():
    """``fused_epilogues=True`` needs I % 64 == 0 (the interleaved gate/up runs): the modules refuse other hidden
    sizes when made (not at every forward) and ``convert_to_mxfp8`` leaves such FFNs unfused, converting their
    Linears, as with the fast mode's 128."""
    from torch import nn

    from cute_mxfp8 import MXFP8GroupedExperts, MXFP8SwiGLUMLP, convert_to_mxfp8

    fused = MXFP8Config(fused_epilogues=True)
    for make in (lambda: MXFP8SwiGLUMLP(64, 96, config=fused), lambda: MXFP8GroupedExperts(64, 96, 2, config=fused)):
        with pytest.raises(ValueError, match="I = 96 is not a multiple of 64, which fused_epilogues=True needs.*"
                                             "fused_epilogues=None"):
            make()
    MXFP8SwiGLUMLP(64, 128, config=fused), MXFP8GroupedExperts(64, 96, 2)  # (whole runs; the default config)

    model = nn.Sequential(_SwiGLUFFN(64, 96), _SwiGLUFFN(64, 128))
    report = convert_to_mxfp8(model, config=fused)
    assert type(model[0]) is _SwiGLUFFN and type(model[1]).__name__ == "MXFP8SwiGLUMLP"
    assert [fqn for fqn, _ in report.converted] == ["0.w1", "0.w2", "0.w3", "1"]
    assert any(fqn == "0" and "multiple of 64" in why for fqn, why in report.skipped)
    x = torch.randn(8, 64, requires_grad=True)
    model(x).sum().backward()  # (before, FFN 0 was swapped and every forward raised)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_sm100_keeps_mx_blocks(monkeypatch):
    monkeypatch.setattr(AG, "resolve_backend", lambda device, backend, op: "sm100")
    assert AG.scale_block(FAST, torch.device("cpu")) == 32


def _deq(q, s):
    return F.dequantize_mxfp8(q, s)


def test_fast_mode_linear_is_the_product_of_128_block_operands(rng):
    x = torch.randn(48, 256, generator=rng) * torch.logspace(-3, 3, 256)
    w = (torch.randn(96, 256, generator=rng) * 0.05).requires_grad_()
    xr = x.clone().requires_grad_()
    y = ops.mxfp8_linear(xr, w, config=FAST)
    xq, wq = F.quantize_mxfp8(x, scale_block=128), F.quantize_mxfp8(w.detach(), scale_block=128)
    assert torch.equal(y, (_deq(*xq) @ _deq(*wq).t()).to(y.dtype))
    dy = torch.randn_like(y)
    y.backward(dy)
    dyq = F.quantize_mxfp8(dy, scale_block=128)  # rowwise along N
    wtq = F.quantize_mxfp8(w.detach().t().contiguous(), scale_block=128)  # W colwise along N = Wᵀ rowwise
    assert torch.equal(xr.grad, _deq(*dyq) @ _deq(*wtq).t())
    # differs from the MXFP8 result (the operands' scales changed), close to it
    y32 = ops.mxfp8_linear(x, w.detach())
    assert not torch.equal(y.detach(), y32) and _sqnr(y32, y.detach()) > 25


@pytest.mark.parametrize("grouped", [False, True])
def test_fast_mode_mlp_matches_bf16_as_closely_as_mxfp8(grouped, rng):
    e, d, i = (4, 128, 256) if grouped else (None, 128, 256)
    lead = (e,) if grouped else ()
    x = torch.randn(300, d, generator=rng)
    w1, w3 = (torch.randn(*lead, i, d, generator=rng) / d ** 0.5 for _ in range(2))
    w2 = torch.randn(*lead, d, i, generator=rng) / i ** 0.5
    offs = torch.tensor([50, 50, 170, 290], dtype=torch.int32) if grouped else None
    dy = torch.randn(300, d, generator=rng)

    def run(config):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        if config is None:  # the high-precision MLP
            if grouped:
                y = torch.zeros_like(x)
                for g, (s, t) in enumerate(F.group_bounds(offs)):
                    h = torch.nn.functional.silu(leaves[0][s:t] @ leaves[1][g].t()) * (leaves[0][s:t] @ leaves[3][g].t())
                    y[s:t] = h @ leaves[2][g].t()
            else:
                h = torch.nn.functional.silu(leaves[0] @ leaves[1].t()) * (leaves[0] @ leaves[3].t())
                y = h @ leaves[2].t()
        else:
            y = ops.mxfp8_swiglu_mlp(*leaves, offs=offs, config=config)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    ref, fast, mx = run(None), run(FAST), run(MXFP8Config())
    for r, f, m in zip(ref, fast, mx):
        assert _sqnr(r, f) > 22 and _sqnr(r, f) > _sqnr(r, m) - 1.5
    assert not torch.equal(fast[0], mx[0])


# ---- the kernels on the H200 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block_k,x_dtype,hp_dtype", [(128, torch.bfloat16, torch.bfloat16),
                                                     (128, torch.float32, torch.float32),
                                                     (32, torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("grouped", [False, True])
def test_the_unfused_mlp_writes_gemm1_and_the_w2_dgrad_in_the_activation_dtype_in_the_fast_mode(
        block_k, x_dtype, hp_dtype, grouped, monkeypatch, rng):
    """The SwiGLU casts' inputs: the fast mode's GEMM1 (h13, the tensor saved for the backward) and w2 dgrad (dh)
    come in the activation dtype; plain MXFP8 keeps them fp32 (the accumulators, the MX contract's input)."""
    seen = []
    gemm = AG._gemm

    def spy(a, a_s, b, b_s, offs, out_dtype, *rest):
        seen.append(out_dtype)
        return gemm(a, a_s, b, b_s, offs, out_dtype, *rest)

    monkeypatch.setattr(AG, "_gemm", spy)
    m, d, i = 256, 128, 256
    x = torch.randn(m, d, generator=rng).to(x_dtype).requires_grad_()
    lead = (2,) if grouped else ()
    w1, w3 = (torch.randn(*lead, i, d, generator=rng).mul(0.1).to(x_dtype).requires_grad_() for _ in range(2))
    w2 = torch.randn(*lead, d, i, generator=rng).mul(0.1).to(x_dtype).requires_grad_()
    offs = torch.tensor([100, 256], dtype=torch.int32) if grouped else None
    y = AG.mxfp8_swiglu_mlp(x, w1, w2, w3, offs, MXFP8Config(hopper_block_k=block_k, backend="reference"))
    y.backward(torch.randn_like(y))
    # forward: GEMM1, GEMM2 (x's dtype); backward: w2 dgrad, then the dx GEMM (x's dtype)
    assert seen == [hp_dtype, x_dtype, hp_dtype, x_dtype]
    assert y.dtype == x.grad.dtype == x_dtype and all(torch.isfinite(t).all() for t in (y, x.grad, w1.grad))


sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                          reason="needs an SM90 GPU (run on the H200 with -m gpu)")


def _special(x: torch.Tensor) -> torch.Tensor:
    """NaN, Inf, zeros, e4m3 saturation and subnormal-range values in the first rows / columns."""
    if x.shape[-2] >= 8 and x.shape[-1] >= 64:
        x[..., 0, 3] = float("nan")
        x[..., 1, 40] = float("inf")
        x[..., 2, :] = 0.0
        x[..., 3, :32] = 448.0 * 2.0 ** 20
        x[..., 4, :] = 1e-30
        x[..., 5, :64] = torch.linspace(-1e-3, 1e3, 64)  # a run whose first block's scale is far below its last's
        x[..., :, 7] = 3e4  # one large column: every colwise run holding it takes its scale
    return x


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("shape", [(1, 32), (127, 96), (129, 160), (300, 416), (33, 4096), (2, 64, 256),
                                   (3, 160, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_mode_cast_kernels_bit_exact(shape, dtype, rng):
    x = _special(torch.randn(*shape, generator=rng) * torch.logspace(-8, 8, shape[-1])).to(dtype)
    for mode in ("floor", "rceil"):
        for elem in (E4M3, E5M2):
            for op in (ops.quantize_rowwise, ops.quantize_colwise, ops.quantize_dual):
                for blocked in (False, True):
                    kw = dict(scale_mode=mode, elem_dtype=elem, blocked=blocked, scale_block=128)
                    _equal(op(x.cuda(), backend="sm90", **kw), op(x, backend="reference", **kw))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes", [[5, 0, 37, 128], [300], [129, 1, 0, 255, 64] * 3, [0, 0], [32, 64, 1]])
@pytest.mark.parametrize("tail", [0, 30, 600])
def test_fast_mode_grouped_cast_kernels_bit_exact(sizes, tail, rng):
    m = sum(sizes) + tail
    x = _special(torch.randn(m, 160, generator=rng) * 100).to(torch.bfloat16)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    for op in (ops.quantize_rowwise, ops.quantize_colwise, ops.quantize_dual):
        for blocked in (False, True):
            kw = dict(blocked=blocked, scale_block=128)
            _equal(op(x.cuda(), offs=offs.cuda(), backend="sm90", **kw), op(x, offs=offs, backend="reference", **kw))
            if op is ops.quantize_rowwise:
                continue
            for sb in (32, 128):  # the padded group layout (every column written by the kernel), either block
                kw = dict(blocked=blocked, scale_block=sb, token_align=128)
                _equal(op(x.cuda(), offs=offs.cuda(), backend="sm90", **kw),
                       op(x, offs=offs, backend="reference", **kw))


def test_fast_mode_swiglu_casts_run_in_one_launch_for_bf16_inputs():
    """The 128-block SwiGLU casts: one ``"cast"`` launch for bf16 inputs, the forward always and the backward when
    I % 128 == 0 (a 128-block along 2I holding dg and du columns needs the two-launch form), in either colwise
    layout; fp32 inputs in two launches (``"amax"`` into zeroed buffers, then ``"apply"``); 32-blocks one
    launch."""
    from cute_mxfp8.ops import cute_kernels as CK

    def phases(scale_block, dtype, ok=True):
        seen = []
        CK._launch_swiglu(lambda sb, phase: (lambda *a: seen.append((sb, phase, len(a)))), ("x",),
                          torch.device("cpu"), (256, 128), None, scale_block, dtype, ok)
        return seen

    assert phases(128, torch.bfloat16) == [(128, "cast", 3)]
    assert phases(128, torch.float32) == [(128, "amax", 3), (128, "apply", 3)]
    assert phases(128, torch.bfloat16, ok=False) == [(128, "amax", 3), (128, "apply", 3)]
    assert phases(32, torch.float32) == phases(32, torch.bfloat16, ok=False) == [(32, "cast", 3)]
    assert CK._one_pass_shape("fwd", 96) and CK._one_pass_shape("bwd", 2 * 256)
    assert not CK._one_pass_shape("bwd", 2 * 96) and not CK._one_pass_shape("bwd", 2 * 320)
    x16, x32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    assert CK._one_pass_dtype((x16, x16)) == torch.bfloat16 and CK._one_pass_dtype((x32, x16)) == torch.float32


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("shape", [(128, 96), (384, 416), (2, 256, 160), (3, 128, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_mode_gate_up_cast_reads_w1_and_w3_and_matches_the_reference(shape, dtype, monkeypatch, rng):
    """``quantize_gate_up`` with 128-blocks runs one cast that reads w1 and w3 themselves (no packed W13 is made):
    the bytes of the reference (each projection cast on its own, then packed), with 1x128 and 128 x 128 blocks,
    plain and blocked scales, NaN / Inf / saturation / subnormal rows in w3 only; dual, and each direction alone
    (what the MLP's forward and backward run)."""
    from cute_mxfp8.ops import cute_kernels as CK

    seen = []
    real = CK.compile_quant
    monkeypatch.setattr(CK, "compile_quant", lambda *a, **kw: seen.append(a) or real(*a, **kw))
    monkeypatch.setattr(CK, "pack_gate_up", lambda *a, **k: pytest.fail("packed W13 made"))
    w1 = torch.randn(*shape, generator=rng).to(dtype)
    w3 = _special(torch.randn(*shape, generator=rng) * torch.logspace(-6, 6, shape[-1])).to(dtype)
    for blocked in (False, True):
        for blocks_2d in (False, True):
            kw = dict(blocked=blocked, scale_block=128, blocks_2d=blocks_2d)
            want = ops.quantize_gate_up(w1, w3, backend="reference", **kw)
            _equal(ops.quantize_gate_up(w1.cuda(), w3.cuda(), backend="sm90", **kw), want)
            for direction, pair in (("rowwise", want[:2]), ("colwise", want[2:])):  # one pair: its own build
                _equal(ops.quantize_gate_up(w1.cuda(), w3.cuda(), backend="sm90", direction=direction, **kw), pair)
    assert seen and all(a[-1] is True for a in seen)  # the gate_up build, every call
    assert {a[0] for a in seen} == {"dual", "rowwise", "colwise"}


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("scale_block", [32, 128])
def test_gate_up_past_32_bit_indexing_casts_only_the_asked_direction(scale_block, monkeypatch, rng):
    """A W13 past the kernels' 32-bit indexing (forced here: ``_packed_limits`` always refuses) is cast one
    projection at a time and packed: the reference's bytes, and a one-direction call runs that direction's casts
    only (the MLP's forward needs W13 rowwise, its backward colwise)."""
    from cute_mxfp8.ops import backends as B
    from cute_mxfp8.ops import cute_kernels as CK

    seen = []
    real = CK.compile_quant
    monkeypatch.setattr(CK, "compile_quant", lambda *a, **kw: seen.append(a[0]) or real(*a, **kw))
    monkeypatch.setattr(CK, "_packed_limits", lambda *a: "forced")
    monkeypatch.setattr(B, "PLANS", {})  # (earlier tests' launch plans of this shape run the one-kernel cast)
    w1 = torch.randn(2, 256, 160, generator=rng).to(torch.bfloat16)
    w3 = _special(torch.randn(2, 256, 160, generator=rng) * torch.logspace(-6, 6, 160)).to(torch.bfloat16)
    for blocked in (False, True):
        kw = dict(blocked=blocked, scale_block=scale_block)
        want = ops.quantize_gate_up(w1, w3, backend="reference", **kw)
        for direction, pair in (("dual", want), ("rowwise", want[:2]), ("colwise", want[2:])):
            seen.clear()
            _equal(ops.quantize_gate_up(w1.cuda(), w3.cuda(), backend="sm90", direction=direction, **kw), pair)
            assert seen and set(seen) == {direction}, (direction, seen)


def test_the_gate_up_cast_build_reads_two_inputs_without_spilling():
    """``compile_quant(..., gate_up=True)``: each CTA loads from w1 or from w3 (two copies of the load code, one
    barrier), no local memory, the kept-run build too; ``gate_up`` is refused where no run is cast in one launch."""
    import re

    from cute_mxfp8.cli import sass_facts
    from cute_mxfp8.jit import compile_quant
    from cute_mxfp8.kernels.quantize_tile import TileQuantKernel

    for keep in (False, True):
        plain, fn = (compile_quant("dual", "bfloat16", "e4m3", "rceil", True, "sm_90a", True, False, False, 128,
                                   "cast", False, True, keep, gate_up) for gate_up in (False, True))
        assert len(re.findall(r"ld\.global", fn.__ptx__)) == 2 * len(re.findall(r"ld\.global", plain.__ptx__))
        assert len(re.findall(r"bar\.sync", fn.__ptx__)) == 1
        (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
        assert res["local_frame"] == 0
    for direction in ("rowwise", "colwise"):  # (the MLP's forward W13 operand, and its backward one)
        fn = compile_quant(direction, "bfloat16", "e4m3", "rceil", True, "sm_90a", True, False, False, 128, "cast",
                           False, True, True, True)
        (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
        assert res["local_frame"] == 0 and len(re.findall(r"bar\.sync", fn.__ptx__)) == 1
    for kw in (dict(scale_block=32), dict(scale_block=128, phase="amax"), dict(scale_block=128, grouped=True)):
        with pytest.raises(ValueError, match="gate_up"):
            TileQuantKernel("e4m3", "rceil", True, True, True, **{"gate_up": True, **kw})
    # compile_quant refuses both flags before it picks the 32-block rowwise kernel (which has neither)
    for flag, value in (("gate_up", True), ("keep_run", True), ("keep_run", 1), ("gate_up", "x")):
        with pytest.raises(ValueError, match=flag):
            compile_quant("rowwise", "bfloat16", "e4m3", "rceil", True, "sm_90a", **{flag: value})


def test_the_kernel_ops_pass_keep_run_and_gate_up_to_the_builds(monkeypatch):
    """The sm90 ops' tile casts (with and without launch plans) and ``quantize_gate_up`` ask ``compile_quant`` for
    the kept run exactly where ``_keep_run`` says (bf16, 128-blocks, with or without groups) and for ``gate_up`` with
    128-blocks and no interleaving (recorded calls; the launches are stubbed, so this runs on the CPU)."""
    from cute_mxfp8.ops import cute_kernels as CK

    calls = []
    monkeypatch.setattr(CK, "compile_quant", lambda *a, **kw: calls.append((a, kw)) or (lambda *t: None))
    ops_, plans = CK._ops("sm_90a"), CK._plans("sm_90a")

    def flags(fn, *args):  # (keep_run, gate_up) of the one build ``fn(*args)`` compiles
        calls.clear()
        fn(*args)
        ((a, kw),) = calls
        assert kw == {"packed_stores": CK.PACKED_STORES}  # (the tile casts' store form, ops.cute_kernels' switch)
        return (a[13] if len(a) > 13 else False), (a[14] if len(a) > 14 else False)

    x16, x32 = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(256, 128)
    offs = torch.tensor([100, 256], dtype=torch.int32)
    assert flags(ops_["quantize_dual"], x16, "rceil", E4M3, True, None, 128) == (True, False)
    assert flags(ops_["quantize_dual"], x32, "rceil", E4M3, True, None, 128) == (False, False)
    assert flags(ops_["quantize_dual"], x16, "rceil", E4M3, True, offs, 128, 128) == (True, False)
    assert flags(ops_["quantize_dual"], x32, "rceil", E4M3, True, offs, 128, 128) == (False, False)
    assert flags(ops_["quantize_colwise"], x16, "rceil", E4M3, True, None, 32) == (False, False)
    assert flags(plans["quantize_dual"], x16, "rceil", E4M3, True, None, 128, 0, True) == (True, False)  # (built
    # when the plan is made)
    w1 = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    assert flags(ops_["quantize_gate_up"], w1, w1, "rceil", E4M3, True, 0, 128, True) == (True, True)
    assert flags(ops_["quantize_gate_up"], w1.float(), w1.float(), "rceil", E4M3, True, 0, 128) == (False, True)
    monkeypatch.setattr(CK, "PACKED_STORES", True)  # (flags() checks the switch reaches every build)
    assert flags(ops_["quantize_dual"], x16, "rceil", E4M3, True, offs, 128, 128) == (True, False)
    assert flags(ops_["quantize_gate_up"], w1, w1, "rceil", E4M3, True, 0, 128, True) == (True, True)
    assert flags(plans["quantize_dual"], x32, "rceil", E4M3, True, None, 128, 0, True) == (False, False)


def test_the_swiglu_ops_ask_for_the_persistent_build_where_the_table_says(monkeypatch):
    """The SwiGLU ops pass ``persistent_ctas`` (the GPU's SM count) exactly for the one-launch 128-block casts that
    :data:`~cute_mxfp8.ops.cute_kernels.SWIGLU_PERSISTENT` marks, on SM90 only, else 0 (recorded calls; the launches
    are stubbed, so this runs on the CPU)."""
    from cute_mxfp8.ops import cute_kernels as CK

    calls = []
    monkeypatch.setattr(CK, "compile_swiglu_quant",
                        lambda *a, **kw: calls.append(a + (kw["packed_stores"],)) or (lambda *t: None))
    monkeypatch.setattr(CK, "_sm_count", lambda dev: 132)
    h13, dh = torch.zeros(256, 512, dtype=torch.bfloat16), torch.zeros(256, 256, dtype=torch.bfloat16)
    offs = torch.tensor([100, 256], dtype=torch.int32)

    def ctas(arch, direction, sb=128, grouped=False, h13_=h13):
        calls.clear()
        fns = CK._swiglu_ops(arch)
        kw = dict(offs=offs, token_align=128) if grouped else {}
        if direction == "fwd":
            fns["swiglu_quant"](h13_, "rceil", E4M3, True, False, scale_block=sb, **kw)
        else:
            fns["dswiglu_quant"](dh, h13_, "rceil", E4M3, True, False, scale_block=sb, **kw)
        return [a[13] for a in calls]

    assert ctas("sm_90a", "fwd") == [132]
    assert ctas("sm_90a", "bwd") == ctas("sm_90a", "fwd", grouped=True) == ctas("sm_90a", "bwd", grouped=True) == [0]
    assert ctas("sm_90a", "fwd", sb=32) == [0] and ctas(CK.SM100_TARGET, "fwd") == [0]
    assert ctas("sm_90a", "fwd", h13_=h13.float()) == [0, 0]  # fp32: the two-launch form
    monkeypatch.setitem(CK.SWIGLU_PERSISTENT, ("bwd", True), True)
    assert ctas("sm_90a", "bwd", grouped=True) == [132]
    assert [a[-1] for a in calls] == [CK.PACKED_STORES]  # (the store form: ops.cute_kernels.PACKED_STORES)
    monkeypatch.setattr(CK, "PACKED_STORES", True)
    ctas("sm_90a", "bwd", grouped=True)
    assert [a[-1] for a in calls] == [True]


def test_the_one_launch_casts_keep_the_run_for_bf16():
    """``ops.cute_kernels._keep_run``: the 128-block one-launch casts of bf16 inputs, with or without token groups,
    keep their run's tiles in registers; fp32 inputs, the two-launch phases and 32-blocks reload (or have no second
    walk).  The kernel refuses ``keep_run`` where it has no run to keep."""
    from cute_mxfp8.kernels.quantize_tile import TileQuantKernel
    from cute_mxfp8.ops import cute_kernels as CK

    assert CK._keep_run(torch.bfloat16, 128, "cast", False) and CK._keep_run(torch.bfloat16, 128, "cast", True)
    assert not any((CK._keep_run(torch.float32, 128, "cast", False), CK._keep_run(torch.float32, 128, "cast", True),
                    CK._keep_run(torch.bfloat16, 128, "apply", False), CK._keep_run(torch.bfloat16, 32, "cast", False)))
    for kw in (dict(scale_block=32), dict(scale_block=128, phase="amax"), dict(scale_block=128, keep_run=1)):
        with pytest.raises(ValueError, match="keep_run"):
            TileQuantKernel("e4m3", "rceil", True, True, True, **{"keep_run": True, **kw})


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100f"])
@pytest.mark.parametrize("blocks_2d,grouped", [(False, False), (True, False), (False, True)])
def test_the_kept_run_casts_read_their_input_once(blocks_2d, grouped, arch):
    """The kept-run dual cast (``TileQuantKernel(keep_run=True)``, what the ops run for bf16 activations and weights,
    and with token groups in the padded layout) issues no loads in its casting walk: half the global loads of the
    reloading build without groups (one walk over the run's 4 tiles instead of two); with groups the run's 4 tiles x
    8 rows x 2 forms (full block, clamped rows) fewer (the tail CTAs' loads and the group lookups stay).  It still
    meets once per run (with groups: and twice per unrolled tail run), keeps its 2 KB of row amaxes and uses no
    local memory on either arch."""
    import re

    from cute_mxfp8.cli import sass_facts
    from cute_mxfp8.jit import compile_quant

    builds = {keep: compile_quant("dual", "bfloat16", "e4m3", "rceil", True, arch, True, grouped, False, 128, "cast",
                                  grouped, blocks_2d, keep) for keep in (False, True)}
    loads = {keep: len(re.findall(r"ld\.global", fn.__ptx__)) for keep, fn in builds.items()}
    if grouped:
        assert loads[False] - loads[True] == 4 * 8 * 2 and loads[True] > 0
    else:
        assert loads[True] * 2 == loads[False] > 0
    fn = builds[True]
    assert len(re.findall(r"bar\.sync", fn.__ptx__)) == (5 if grouped else 1) and ".local" not in fn.__ptx__
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    assert res["local_frame"] == 0 and fn.launch_smem == (2048,)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100f"])
@pytest.mark.parametrize("direction,grouped", [("fwd", False), ("bwd", False), ("fwd", True), ("bwd", True)])
def test_the_one_launch_swiglu_casts_keep_the_run_in_registers(direction, grouped, arch):
    """The resident builds the ops run (bf16; grouped: the padded layout): 512 threads, one CTA barrier, no global
    atomics (the two-launch form's amax pass) and no local memory on either arch (the padded backward spilled 3
    words for sm_90a while the casting pass still ran the lane's own amax reductions); the backward's dg and du
    amaxes in two sets of slots (8 KB of shared memory, the forward 4 KB)."""
    import re

    from cute_mxfp8.cli import sass_facts
    from cute_mxfp8.jit import compile_swiglu_quant

    fn = compile_swiglu_quant(direction, "bfloat16", "e4m3", "rceil", True, arch, True, grouped, False, 128,
                              "cast", None, grouped)
    ptx = fn.__ptx__
    assert len(re.findall(r"bar\.sync", ptx)) == 1 and "atom.global" not in ptx and ".local" not in ptx
    assert re.search(r"\.maxntid\s+512\b", ptx)
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    assert res["local_frame"] == 0 and fn.launch_smem == ((8192 if direction == "bwd" else 4096),)


@pytest.mark.parametrize("direction,grouped", [("fwd", False), ("bwd", False), ("fwd", True), ("bwd", True)])
def test_the_persistent_swiglu_cast_prefetches_into_shared_memory(direction, grouped):
    """The persistent resident build (``persistent_ctas``): one CTA barrier per run, each lane's next-run loads as
    cp.async (LDGSTS) into its two buffers, the amax slots twice; the dense builds hold their run without local
    memory (the backward parks du in the lane's buffer); the grouped ones spill at 128 registers, which is why the
    ops keep them one CTA per run."""
    import re

    from cute_mxfp8.cli import sass_facts
    from cute_mxfp8.jit import compile_swiglu_quant
    from cute_mxfp8.ops import cute_kernels as CK

    fn = compile_swiglu_quant(direction, "bfloat16", "e4m3", "rceil", True, "sm_90a", True, grouped, False, 128,
                              "cast", None, grouped, persistent_ctas=132)
    assert len(re.findall(r"bar\.sync", fn.__ptx__)) == 1 and "atom.global" not in fn.__ptx__
    ops = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))
    nops = 3 if direction == "bwd" else 2
    assert sum(n for op, n in ops.items() if op.startswith("LDGSTS")) == 2 * 8 * nops  # first run + loop
    staging = 2 * 16 * 32 * 8 * 4 * 2 * nops  # 2 buffers x 16 warps x 32 lanes x 8 x 4 bf16 x operands
    assert fn.launch_smem == (staging + 2 * (8192 if direction == "bwd" else 4096),)
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    if not grouped:  # (the grouped builds spill today; the ops do not run them)
        assert res["local_frame"] == 0
    assert CK.SWIGLU_PERSISTENT == {("fwd", False): True, ("fwd", True): False, ("bwd", False): False,
                                    ("bwd", True): False}
    with pytest.raises(ValueError, match="persistent_ctas"):
        compile_swiglu_quant(direction, "bfloat16", "e4m3", "rceil", True, "sm_90a", True, grouped, False, 128,
                             "apply", None, grouped, persistent_ctas=132)
    with pytest.raises(ValueError, match="bf16 inputs"):  # fp32 buffers would not fit in an SM's shared memory
        compile_swiglu_quant(direction, "float32", "e4m3", "rceil", True, "sm_90a", True, grouped, False, 128,
                             "cast", None, grouped, persistent_ctas=132)
    from cute_mxfp8.kernels.quantize_tile import SwiGLUQuantKernel

    for bad, err in ((True, TypeError), ("132", TypeError), (-1, ValueError)):
        with pytest.raises(err, match="persistent_ctas must be"):
            SwiGLUQuantKernel(direction == "fwd" and "swiglu" or "dswiglu", "e4m3", "rceil", True,
                              scale_block=128, persistent_ctas=bad)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,i", [(300, 128), (1000, 384), (4099, 256)])
@pytest.mark.parametrize("groups", ["none", "grouped", "padded"])
def test_fast_mode_swiglu_one_launch_writes_what_two_launches_do(m, i, groups, monkeypatch, rng):
    """Random bf16 data with an outlier row and column, ragged M, token groups ending inside 128-row runs (and
    rows past the last group): the one-launch 128-block SwiGLU / dSwiGLU casts write exactly the bytes of the
    two-launch form (scales, both data layouts, the high-precision output), with one CTA per run and persistent
    (a CTA per SM; and 3 CTAs, so that each walks many runs, both buffers and both sets of amax slots)."""
    from cute_mxfp8.ops import cute_kernels as CK

    h13 = (torch.randn(m, 2 * i, generator=rng) * 3).to(torch.bfloat16).cuda()
    h13[3, :] *= 1000
    h13[:, 7] *= 1000
    dh = torch.randn(m, i, generator=rng).to(torch.bfloat16).cuda()
    kw = dict(scale_block=128, emit_hp=True)
    if groups != "none":
        kw.update(offs=torch.tensor([m // 5, m // 5 + 1, m // 2, m - 3], dtype=torch.int32).cuda(),
                  token_align=128 if groups == "padded" else 0)
    outs = {}
    sms = CK._sm_count
    for form, one_pass, persistent, ctas in [("two", False, False, None), ("per run", True, False, None),
                                             ("persistent", True, True, None), ("3 CTAs", True, True, 3)]:
        monkeypatch.setitem(CK.SWIGLU_ONE_PASS, torch.bfloat16, one_pass)
        monkeypatch.setattr(CK, "SWIGLU_PERSISTENT", {(d, g): persistent for d in ("fwd", "bwd") for g in (0, 1)})
        monkeypatch.setattr(CK, "_sm_count", sms if ctas is None else (lambda dev, n=ctas: n))
        outs[form] = (ops.swiglu_quant(h13, **kw), ops.dswiglu_quant(dh, h13, **kw))
    for form in ("per run", "persistent", "3 CTAs"):
        for one, two in zip(outs[form], outs["two"]):
            _equal(one, two)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,i", [(300, 96), (130, 256), (1024, 1024)])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("emit_hp", [False, True])
def test_fast_mode_swiglu_kernels_match_the_reference(m, i, grouped, emit_hp, rng):
    """As the 32-block SwiGLU kernels (``test_kernels_swiglu``): scales bit-exact, fp8 codes equal up to a rare
    one-code difference and the high-precision output within 4 ulps (fp32 exp / FMA rounding vs torch)."""
    h13 = (torch.randn(m, 2 * i, generator=rng) * 3).to(torch.bfloat16)
    h13[0, :i] = 100.0
    h13[1, 5] = float("inf")
    dh = torch.randn(m, i, generator=rng).to(torch.bfloat16) * torch.logspace(-4, 4, i).to(torch.bfloat16)
    # 7 rows past offs[-1], or 512 (several tail CTAs of the kernels)
    offs = torch.tensor([m // 3, m // 3, m - 7 if m < 1024 else m // 2], dtype=torch.int32) if grouped else None
    dev_offs = None if offs is None else offs.cuda()
    from test_kernels_swiglu import _check  # the SwiGLU kernels' contract with the reference

    for blocked, token_align in ((False, 0), (True, 0), (False, 128), (True, 128)):
        if token_align and not grouped:
            continue
        kw = dict(blocked=blocked, emit_hp=emit_hp, scale_block=128, token_align=token_align)
        what = f"{m}x{i} grouped={grouped} blocked={blocked} hp={emit_hp} token_align={token_align}"
        _check(ops.swiglu_quant(h13.cuda(), offs=dev_offs, backend="sm90", **kw),
               ops.swiglu_quant(h13, offs=offs, backend="reference", **kw), "fwd " + what)
        _check(ops.dswiglu_quant(dh.cuda(), h13.cuda(), offs=dev_offs, backend="sm90", **kw),
               ops.dswiglu_quant(dh, h13, offs=offs, backend="reference", **kw), "bwd " + what)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,n,k", [(300, 200, 416), (257, 129, 1024), (1024, 768, 2048)])
def test_fast_mode_mm_op_is_bit_exact_on_integer_data(m, n, k, rng):
    """Small integers times a power of two per (row, 128-block): every partial sum is exact, so the fast kernel's
    result equals the reference's bit for bit (bf16 and fp32 outputs, odd N: unpaired stores)."""
    def operand(rows):
        ints = torch.randint(-4, 5, (rows, k), generator=rng).float()
        exps = torch.randint(-1, 2, (rows, -(-k // 128)), generator=rng).float().repeat_interleave(128, 1)[:, :k]
        return ops.quantize_rowwise(ints * 2.0 ** exps, scale_block=128)

    (a, a_s), (b, b_s) = operand(m), operand(n)
    for out in (torch.bfloat16, torch.float32):
        got = ops.mm(a.cuda(), a_s.cuda(), b.cuda(), b_s.cuda(), out_dtype=out, backend="sm90", scale_block=128)
        assert torch.equal(got.cpu(), ops.mm(a, a_s, b, b_s, out_dtype=out))


def _fast_integer_values(shape, rng):
    """Small integers times a power of two per (row, 128-block along the last dim): every 128-block's partial
    sum and every promotion is exact, so any summation order gives the reference's bits."""
    k = shape[-1]
    ints = torch.randint(-4, 5, shape, generator=rng).float()
    exps = torch.randint(-1, 2, (*shape[:-1], -(-k // 128)), generator=rng).float()
    return ints * 2.0 ** exps.repeat_interleave(128, -1)[..., :k]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes", [[0, 1, 31, 129, 300], [257], [0, 0], [64, 0, 70]], ids=str)
@pytest.mark.parametrize("n,k", [(200, 416), (96, 1024)])
def test_fast_mode_grouped_mm_op_is_bit_exact_on_integer_data(sizes, n, k, rng):
    """2d-3d in the fast mode (the promote kernel's grouped build): each group on its own expert, empty groups,
    group tiles crossing group ends (the next group's rows computed, not stored), N and K not multiples of the
    tile, 40 rows past offs[-1] written as zeros; a NaN in the last group's rows stays in its own rows."""
    t = sum(sizes) + 40
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    x = _fast_integer_values((t, k), rng)
    if sizes[-1]:
        x[sum(sizes) - 1, 5] = float("nan")
    a, a_s = ops.quantize_rowwise(x, offs=offs, scale_block=128)
    b, b_s = ops.quantize_rowwise(_fast_integer_values((len(sizes), n, k), rng), scale_block=128)
    for out in (torch.bfloat16, torch.float32):
        got = ops.grouped_mm(a.cuda(), a_s.cuda(), b.cuda(), b_s.cuda(), offs.cuda(), out_dtype=out, backend="sm90",
                             scale_block=128).cpu()
        want = ops.grouped_mm(a, a_s, b, b_s, offs, out_dtype=out, scale_block=128)
        assert got.shape == (t, n) and torch.all(got[sum(sizes):] == 0)
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == (n if sizes[-1] else 0)
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]), f"{(got[ok] != want[ok]).sum().item()} outputs differ"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes", [[0, 1, 127, 129, 300], [257], [0, 0], [64, 0, 70]], ids=str)
@pytest.mark.parametrize("n,k", [(200, 136), (96, 384), (256, 200), (128, 100)])
def test_fast_mode_grouped_mm_wgrad_op_is_bit_exact_on_integer_data(sizes, n, k, rng):
    """2d-2d in the fast mode (the promote kernel on 128-aligned groups): K = each group's tokens in 128-blocks
    from its start, empty groups give zero, tokens past offs[-1] are ignored, N and K not multiples of the tile;
    a NaN token of the last group leaves the other groups' dW finite.  bf16 outputs with K % 8 == 0 take the
    TMA-stored build: every tile's boxes (N = 256: a box partly and boxes wholly past K), tiles whose rows cross
    into the next group's stored per thread (N = 200); K = 100 the per-thread build."""
    t = sum(sizes) + 43
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    dy, x = _fast_integer_values((n, t), rng).t(), _fast_integer_values((k, t), rng).t()
    if sizes[-1]:
        dy[sum(sizes) - 1, 3] = float("nan")
    (a, a_s), (b, b_s) = (ops.quantize_colwise(v.contiguous(), offs=offs, scale_block=128) for v in (dy, x))
    for out in (torch.bfloat16, torch.float32):
        got = ops.grouped_mm_wgrad(a.cuda(), a_s.cuda(), b.cuda(), b_s.cuda(), offs.cuda(), out_dtype=out,
                                   backend="sm90", scale_block=128).cpu()
        want = ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, out_dtype=out, scale_block=128)
        assert got.shape == (len(sizes), n, k) and all(torch.all(got[g] == 0) for g, c in enumerate(sizes) if not c)
        assert torch.equal(got.isnan(), want.isnan()) and got[:-1].isnan().sum() == 0
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]), f"{(got[ok] != want[ok]).sum().item()} outputs differ"
    # the same product from operands cast with token_align=128 on their padded offsets, read without a gather
    # (the offsets' host values are known, as in the autograd functions)
    from cute_mxfp8.ops import group_meta, token_layout

    dev_offs = offs.cuda()
    group_meta.known_host_copy(dev_offs, offs)
    (pa, pa_s), (pb, pb_s) = (ops.quantize_colwise(v.contiguous().cuda(), offs=dev_offs, scale_block=128,
                                                   token_align=128) for v in (dy, x))
    padded = ops.padded_offsets(dev_offs)
    assert torch.equal(padded.cpu(), F.padded_group_offsets(offs))

    def no_gather(*args):
        raise AssertionError("the padded operands were gathered")

    orig, token_layout.aligned_operands = token_layout.aligned_operands, no_gather
    try:
        got = ops.grouped_mm_wgrad(pa, pa_s, pb, pb_s, padded, out_dtype=torch.float32, backend="sm90",
                                   scale_block=128).cpu()
    finally:
        token_layout.aligned_operands = orig
    want = ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, out_dtype=torch.float32, scale_block=128)
    ok = ~want.isnan()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[ok], want[ok])


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("sizes", [[0, 1, 127, 129, 300], [257], [0, 0]], ids=str)
def test_sm90_wgrad_split_halves_writes_each_half_contiguous(block, sizes, rng):
    """``split_halves=True`` on the SM90 2d-2d op: the bytes of the unsplit output regrouped as (2, G, N / 2, K)
    (the fast-mode kernel writes that layout itself; with 32-blocks the op copies), empty groups zero, N = 512 and
    768 (one and several 128-row tiles per half, tiles straddling N / 2 in the 256-row dequantize kernel), K not a
    multiple of the tile; random data (the same kernel math either way)."""
    t = sum(sizes) + 20
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(t, 136, generator=rng).cuda()
    for n in (512, 768):
        dh = torch.randn(t, n, generator=rng).cuda()
        a, b = (ops.quantize_colwise(v, offs=offs, scale_block=block) for v in (dh, x))
        for out in (torch.bfloat16, torch.float32):
            kw = dict(out_dtype=out, backend="sm90", scale_block=block)
            full = ops.grouped_mm_wgrad(*a, *b, offs, **kw)
            halves = ops.grouped_mm_wgrad(*a, *b, offs, split_halves=True, **kw)
            assert halves.shape == (2, len(sizes), n // 2, 136) and halves.is_contiguous()
            assert (full.abs().sum() > 0) == (sum(sizes) > 0)
            assert torch.equal(halves[0], full[:, :n // 2]) and torch.equal(halves[1], full[:, n // 2:])


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("block", [32, 128])
def test_sm90_wgrad_in_bf16_is_the_fp32_result_rounded(block, rng):
    """The autograd functions ask the wgrad GEMMs for the weight's dtype directly: on the SM90 kernels (dense and
    2d-2d, fast mode and plain MXFP8) the bf16 output is byte for byte the fp32 output rounded by ``.to``, on
    random data (not integers, so the rounding is exercised), tokens not a multiple of 128."""
    t, n, k = 1000, 192, 320
    offs = torch.tensor([130, 130, 700, 997], dtype=torch.int32, device="cuda")
    dy = torch.randn(t, n, generator=rng).cuda() * torch.logspace(-2, 2, n, device="cuda")
    x = torch.randn(t, k, generator=rng).cuda()
    for grouped in (False, True):
        o = offs if grouped else None
        (a, a_s), (b, b_s) = (ops.quantize_colwise(v, offs=o, scale_block=block) for v in (dy, x))
        if grouped:
            run = lambda dt: ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, out_dtype=dt, backend="sm90",  # noqa: E731
                                                  scale_block=block)
        else:
            run = lambda dt: ops.mm(a, a_s, b, b_s, out_dtype=dt, backend="sm90", scale_block=block)  # noqa: E731
        wide, narrow = run(torch.float32), run(torch.bfloat16)
        assert narrow.dtype == torch.bfloat16 and wide.abs().sum() > 0
        assert torch.equal(narrow, wide.to(torch.bfloat16)), (grouped, block)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("grouped", [False, True])
def test_fast_mode_mlp_on_sm90_matches_the_reference(grouped, rng):
    e = 4
    d, i, m = 256, 512, 1000
    lead = (e,) if grouped else ()
    x = torch.randn(m, d, generator=rng)
    ws = [torch.randn(*lead, i, d, generator=rng) / d ** 0.5, torch.randn(*lead, d, i, generator=rng) / i ** 0.5,
          torch.randn(*lead, i, d, generator=rng) / d ** 0.5]
    offs = torch.tensor([100, 100, 600, 990], dtype=torch.int32) if grouped else None
    dy = torch.randn(m, d, generator=rng)

    def run(device, backend):
        leaves = [t.to(device).to(torch.bfloat16).requires_grad_() for t in (x, *ws)]
        cfg = MXFP8Config(hopper_block_k=128, backend=backend)
        y = ops.mxfp8_swiglu_mlp(*leaves, offs=None if offs is None else offs.to(device), config=cfg)
        y.backward(dy.to(device).to(torch.bfloat16))
        return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves]

    for got, want in zip(run("cuda", "sm90"), run("cpu", "reference")):
        assert _sqnr(want, got) > 35


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("recipe", [dict(hopper_block_k=128, hopper_weight_blocks="128x128"),
                                    dict(hopper_block_k=128), dict()], ids=["fast_128x128", "fast", "mxfp8"])
@pytest.mark.parametrize("grouped", [False, True])
def test_packed_w13_mlp_on_sm90_equals_the_split_weights(recipe, grouped, rng):
    """On the sm90 kernels, ``mxfp8_swiglu_mlp_packed`` on ``[w1; w3]`` gives the split weights' output, dx, dw2
    and ``[dw1; dw3]`` bit for bit (the fast mode's casts of the packed weight are the gate_up kernel's bytes; its
    wgrad writes (E, 2I, D) instead of the two halves; the 32-block MLP re-packs into the fused epilogues'
    interleaved layout), grouped with an empty group and rows past offs[-1]."""
    e, d, i, m = 4, 256, 512, 1000
    lead = (e,) if grouped else ()
    x = torch.randn(m, d, generator=rng).cuda().to(torch.bfloat16)
    w1, w2, w3 = (torch.randn(*lead, *s, generator=rng).div(s[1] ** 0.5).cuda().to(torch.bfloat16)
                  for s in ((i, d), (d, i), (i, d)))
    offs = torch.tensor([100, 100, 600, 990], dtype=torch.int32, device="cuda") if grouped else None
    dy = torch.randn(m, d, generator=rng).cuda().to(torch.bfloat16)
    cfg = MXFP8Config(**recipe)
    split = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    packed = [t.clone().requires_grad_() for t in (x, torch.cat([w1, w3], dim=-2), w2)]
    ys = ops.mxfp8_swiglu_mlp(*split, offs=offs, config=cfg)
    yp = ops.mxfp8_swiglu_mlp_packed(*packed, offs=offs, config=cfg)
    ys.backward(dy)
    yp.backward(dy)
    assert torch.equal(ys, yp) and torch.equal(split[0].grad, packed[0].grad)
    assert torch.equal(split[2].grad, packed[2].grad)
    assert torch.equal(torch.cat([split[1].grad, split[3].grad], dim=-2), packed[1].grad)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100f"])
def test_fast_mode_cast_kernels_compile_in_one_or_two_launches(arch):
    """scale_block=128 builds of every tile-kernel cast.  One launch (``phase="cast"``, what the ops run for the
    casts): no atomics, one CTA barrier between the reducing walk and the casting walk (with token groups, two more
    per unrolled run of the tail CTAs), the row amaxes in shared
    memory (2 KB), no local memory; the SwiGLU kernels' one launch is the resident form (bf16 inputs, what the ops
    run: one barrier, the amax parts in 4 / 8 KB of shared memory, no atomics; the tail CTAs store zeros without
    meeting).  Two launches: the amax phase only reduces (one global atomic max per lane and cast, no shared memory,
    no local memory), the apply phase stores without atomics."""
    import re

    from cute_mxfp8.jit import compile_quant, compile_swiglu_quant

    builds = [(compile_quant, (d, "bfloat16", "e4m3", "rceil", True, arch, True, g, b), {"dual": 2}.get(d, 1), True)
              for d, g, b in [("rowwise", False, False), ("rowwise", True, False), ("rowwise", False, True),
                              ("colwise", True, False), ("dual", False, False), ("dual", True, False)]]
    builds += [(compile_swiglu_quant, (d, "float32", "e5m2", "floor", False, arch, True, g, False), n, None)
               for d, n in (("fwd", 2), ("bwd", 4)) for g in (False, True)]
    atomic = r"(?:atom|red)\.global[.a-z0-9]*\.max"
    from cute_mxfp8.kernels.quantize_tile import BLOCK, RUN, TAIL_ROWS

    for fn, args, atomics, one_launch in builds:
        grouped = fn is compile_quant and args[7]  # the tail CTAs' unrolled blocks past offs[-1] (SwiGLU: zeros)
        if grouped and args[0] != "colwise":
            atomics += TAIL_ROWS // BLOCK  # each reduces its rows
        barriers = 1 + (2 * (TAIL_ROWS // (RUN * BLOCK)) if grouped else 0)  # one pass: two per tail run
        for phase, want in (("amax", atomics), ("apply", 0)):
            ptx = fn(*args, scale_block=128, phase=phase).__ptx__
            assert len(re.findall(atomic, ptx)) == want, (args, phase)
            assert ".local" not in ptx and "bar.sync" not in ptx
        if one_launch is None:  # the SwiGLU kernels: the resident one launch, for bf16 inputs
            one = fn(args[0], "bfloat16", *args[2:], scale_block=128).__ptx__
            assert not re.findall(atomic, one) and ".local" not in one, args
            assert len(re.findall(r"\bbar\.sync|\bbarrier\.sync", one)) == 1 and re.search(r"\.maxntid\s+512\b", one)
            continue
        one = fn(*args, scale_block=128)
        assert not re.findall(atomic, one.__ptx__) and ".local" not in one.__ptx__, args
        assert len(re.findall(r"\bbar\.sync|\bbarrier\.sync", one.__ptx__)) == barriers, args
        assert one.launch_smem == (4 * 32 * 4 * 4,), (args, one.launch_smem)  # 4 x 32 rows x 4 warps, int32
    with pytest.raises(ValueError, match="phase"):
        compile_quant("dual", "bfloat16", "e4m3", "rceil", True, arch, True, phase="amax")
