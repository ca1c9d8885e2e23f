"""The SM90 WGMMA MXFP8 GEMM (``kernels/gemm_sm90.py``, issue 12): every variant compiles for ``sm_90a`` on the CPU
with its SASS checked (fp8 WGMMA, TMA loads, no spills); on the H200 (``-m gpu``) it equals the reference bit for
bit on integer-valued data (every sum exact) and stays within the fp32 summation bound on random data."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")

from cute_mxfp8 import MXFP8Config  # noqa: E402
from cute_mxfp8 import formats as F  # noqa: E402
from cute_mxfp8 import ops  # noqa: E402
from cute_mxfp8.cli import sass_facts  # noqa: E402
from fused_checks import assert_dh13_equal, concat_gate_up, grouped_fused_check  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ELEMS = {"e4m3": E4M3, "e5m2": E5M2}
VARIANTS = list(itertools.product([("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")], ["bfloat16", "float32"]))
needs_sass = pytest.mark.skipif(sass_facts.find_nvdisasm() is None, reason="nvdisasm not installed (test extra)")
sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="needs an SM90 GPU (run on the H200 with -m gpu)")


@needs_sass
@pytest.mark.parametrize("mainloop", ["dequant", "promote"])
@pytest.mark.parametrize("elems,out", VARIANTS, ids=str)
def test_gemm_compiles_for_sm90_with_wgmma(elems, out, mainloop):
    from cute_mxfp8.jit import compile_gemm_sm90

    fn = compile_gemm_sm90(*elems, out, mainloop, "sm_90a", True)
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    assert res["local_frame"] == 0 and fn.launch_smem[0] <= 232448  # H100/H200: 227 KB of shared memory per CTA
    counts = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))

    def count(prefix):
        return sum(v for k, v in counts.items() if k.startswith(prefix))

    if mainloop == "promote":
        # one fp8 WGMMA (K = 32 = one MX block) per block of the 128-deep stage and 64-row half of the tile; ptxas
        # honours the warpgroups' setmaxnreg (C7508 drops it silently without a launch bound); 16-byte loads of
        # the column scales (4 per block: 16 columns per thread)
        assert count("QGMMA") == 8 and count("USETMAXREG") == 2 and count("LDS.128") == 16
    else:
        # per 64-deep stage: 2 chunks x 2 row halves x 2 k16 steps of bf16 WGMMA, A from registers; the fp8 ->
        # f16 conversions in hardware (consumers: 32 per stage; the transform warps' loop is unrolled)
        assert count("HGMMA") == 8 and count("QGMMA") == 0
        assert sum(count(f"F2FP.F16.{e.upper()}.UNPACK_B") for e in set(elems)) > 32
    # promote: one TMA warp, A and B; dequant: the first stages' loads and the ones inside the unrolled loop
    assert (count("UTMALDG") == 2 if mainloop == "promote" else count("UTMALDG") >= 4)
    assert count("LDL") == count("STL") == 0


def test_sm90_mm_limits_name_the_fix():
    from cute_mxfp8.ops import gemm_sm90 as G

    a, a_s = ops.quantize_rowwise(torch.randn(64, 64))
    assert G.LIMITS["mm"](a, a_s, a, a_s, torch.bfloat16) is None
    shifted = a.view(torch.uint8).view(-1)[8:8 + 56 * 64].view(56, 64).view(E4M3)  # 8 bytes past a boundary
    assert "16-byte aligned" in G.LIMITS["mm"](shifted, a_s, a, a_s, torch.bfloat16)
    assert "K = 0" in G.LIMITS["mm"](a[:, :0], a_s[:0], a[:, :0], a_s[:0], torch.bfloat16)


@pytest.fixture(params=["dequant", "promote"])
def mainloop(request, monkeypatch):
    """Runs a test once per SM90 mainloop (``ops.gemm_sm90.MAINLOOP``)."""
    from cute_mxfp8.ops import gemm_sm90 as G

    monkeypatch.setattr(G, "MAINLOOP", request.param)
    return request.param


def _integer_operands(m, n, k, ea, eb, rng):
    """MXFP8 operands whose dequantized values are integers in [-8, 8] times a power of two in [2**-1, 2**1] per
    (row, 32-block): a block's 32 products sum to an integer of at most 12 bits (exact even in the fp8 WGMMA's
    ~14-bit accumulation) and the fp32 sum over K <= 2048 spans at most 12 + 4 + 6 bits, so every summation
    order gives the same bits."""
    def operand(rows, elem):
        ints = torch.randint(-8, 9, (rows, k), generator=rng).float()
        exps = torch.randint(-1, 2, (rows, k // 32), generator=rng).float().repeat_interleave(32, dim=1)
        return ops.quantize_rowwise((ints * 2.0 ** exps).cuda(), elem_dtype=ELEMS[elem])

    return (*operand(m, ea), *operand(n, eb))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("elems,out", VARIANTS, ids=str)
@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (300, 200, 96), (1, 33, 32), (257, 129, 416), (640, 384, 2048)])
def test_sm90_mm_integer_data_is_bit_exact(elems, out, m, n, k, rng, mainloop):
    a, a_s, b, b_s = _integer_operands(m, n, k, *elems, rng)
    dt = getattr(torch, out)
    got = ops.mm(a, a_s, b, b_s, out_dtype=dt, backend="sm90")
    want = ops.mm(a, a_s, b, b_s, out_dtype=dt, backend="reference")
    assert got.shape == (m, n) and got.dtype == dt
    bad = (got.float() != want.float()).sum().item()
    assert bad == 0, f"{bad} of {m * n} outputs differ; first at {(got != want).nonzero()[0].tolist()}"
    bias = (torch.randint(-64, 64, (n,), generator=rng) / 4).cuda()
    torch.testing.assert_close(ops.mm(a, a_s, b, b_s, out_dtype=dt, bias=bias, backend="sm90"),
                               ops.mm(a, a_s, b, b_s, out_dtype=dt, bias=bias, backend="reference"), rtol=0, atol=0)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,n,k", [(512, 384, 1024), (1000, 130, 4128)])
def test_sm90_mm_random_data_within_the_accumulation_bound(m, n, k, rng, mainloop):
    x = torch.randn(m, k, generator=rng).cuda() * torch.logspace(-3, 3, k, device="cuda")
    w = torch.randn(n, k, generator=rng).cuda()
    a, a_s = ops.quantize_rowwise(x)
    b, b_s = ops.quantize_rowwise(w)
    got = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, backend="sm90")
    da = F.dequantize_mxfp8(a, F.from_blocked_scales(a_s, m, k // 32)).double()
    db = F.dequantize_mxfp8(b, F.from_blocked_scales(b_s, n, k // 32)).double()
    exact = da @ db.t()
    mag = da.abs() @ db.abs().t()
    # Hopper's fp8 WGMMA adds one instruction's 32 products (one MX block) with about 14 significant bits
    # (DeepSeek-V3 technical report, section 3.3.2; the integer test above stays inside that), so each block's
    # partial is within ~2**-13 of its sum of |products|; the promotion then adds the blocks in fp32.
    bound = (2.0 ** -12 + k * 2.0 ** -24) * mag
    err = (got.double() - exact).abs()
    ratio = (err / mag.clamp_min(1e-300)).max().item()
    print(f"{mainloop}: max |error| / sum |a||b| = {ratio:.3g} (2**{torch.tensor(ratio).log2().item():.1f})")
    assert bool((err <= bound).all()), f"max error / sum|a||b| {ratio:.3g}"


@pytest.mark.gpu
@sm90
def test_sm90_mm_nan_blocks_propagate_as_the_reference(rng, mainloop):
    x = torch.randn(200, 256, generator=rng).cuda()
    x[5, 40] = float("nan")  # block (5, 1): scale byte 255, all its elements NaN
    x[150, 200] = float("inf")
    w = torch.randn(160, 256, generator=rng).cuda()
    w[7, 0] = float("nan")
    a, a_s = ops.quantize_rowwise(x)
    b, b_s = ops.quantize_rowwise(w)
    got = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, backend="sm90")
    want = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, backend="reference")
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 200 + 160 * 2 - 2
    ok = ~want.isnan()
    da = F.dequantize_mxfp8(a, F.from_blocked_scales(a_s, 200, 8)).nan_to_num(0).double()
    db = F.dequantize_mxfp8(b, F.from_blocked_scales(b_s, 160, 8)).nan_to_num(0).double()
    bound = 2.0 ** -12 * (da.abs() @ db.abs().t())  # the accumulation bound of the random-data test
    assert bool(((got.double() - want.double()).abs()[ok] <= bound[ok]).all())


@pytest.mark.gpu
@sm90
def test_sm90_is_the_automatic_gemm_and_the_mlp_matches_the_reference(rng):
    from cute_mxfp8.ops import mxfp8_swiglu_mlp
    from cute_mxfp8.ops.backends import resolve_backend

    a, a_s = ops.quantize_rowwise(torch.randn(64, 64, device="cuda"))
    assert resolve_backend(a.device, op="mm", args=(a, a_s, a, a_s, torch.bfloat16)) == "sm90"
    x = torch.randn(300, 256, generator=rng)
    ws = [torch.randn(512, 256, generator=rng) / 16, torch.randn(256, 512, generator=rng) / 22,
          torch.randn(512, 256, generator=rng) / 16]
    outs = {}
    for backend in ("reference", None):
        leaves = [t.detach().cuda().requires_grad_() for t in (x, *ws)]
        cfg = MXFP8Config(backend=backend)
        y = mxfp8_swiglu_mlp(*leaves, config=cfg)
        y.backward(torch.ones_like(y))
        outs[backend] = [y.detach()] + [t.grad for t in leaves]
    for r, g in zip(outs["reference"], outs[None]):
        sqnr = 10 * torch.log10(r.pow(2).sum() / (r - g).pow(2).sum().clamp_min(1e-30))
        assert sqnr > 35


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_sm90_mm_special_codes_with_finite_scales(elem, rng, mainloop):
    """fp8 NaN (and e5m2 Inf) codes under ordinary scales and, for the dequantize mainloop, a scale at the top of the
    E8M0 range whose scaled elements overflow fp32: NaN / Inf land where the reference puts them (the reference
    dequantizes in fp32; the promotion mainloop scales block sums, not elements, so only the first part holds)."""
    dt = ELEMS[elem]
    m, n, k = 160, 136, 192
    a = (torch.randn(m, k, generator=rng) * 4).to(dt).cuda()
    b = (torch.randn(n, k, generator=rng) * 4).to(dt).cuda()
    a_plain = torch.randint(120, 134, (m, k // 32), generator=rng, dtype=torch.uint8)
    b_plain = torch.randint(120, 134, (n, k // 32), generator=rng, dtype=torch.uint8)
    nan = {"e4m3": 0x7F, "e5m2": 0x7E}[elem]
    a.view(torch.uint8)[3, 70] = nan
    b.view(torch.uint8)[9, 5] = nan
    if elem == "e5m2":
        a.view(torch.uint8)[100, 33] = 0x7C  # +inf
    if mainloop == "dequant":
        a_plain[140, 2] = 254  # 2**127 times values >= 2: +-inf in fp32, as in the reference
    a_s = F.to_blocked_scales(a_plain.cuda().view(torch.float8_e8m0fnu))
    b_s = F.to_blocked_scales(b_plain.cuda().view(torch.float8_e8m0fnu))
    got = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, backend="sm90")
    want = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, backend="reference")
    assert torch.equal(got.isnan(), want.isnan()) and want[3].isnan().all() and want[:, 9].isnan().all()
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()])
    ok = want.isfinite()
    da = F.dequantize_mxfp8(a, a_plain.cuda().view(torch.float8_e8m0fnu)).nan_to_num(0, 0, 0).double()
    db = F.dequantize_mxfp8(b, b_plain.cuda().view(torch.float8_e8m0fnu)).nan_to_num(0, 0, 0).double()
    bound = 2.0 ** -12 * (da.abs() @ db.abs().t())
    assert bool(((got.double() - want.double()).abs()[ok] <= bound[ok]).all())


# ---- grouped: 2d-3d (grouped_mm) and 2d-2d (grouped_mm_wgrad) on the dequantize mainloop ----------------------

@needs_sass
@pytest.mark.parametrize("grouping", ["m", "k"])
def test_grouped_gemms_compile_for_sm90_with_wgmma(grouping):
    from cute_mxfp8.jit import compile_gemm_sm90

    fn = compile_gemm_sm90("e4m3", "e5m2", "float32", "dequant", "sm_90a", True, grouping=grouping)
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    assert res["local_frame"] == 0 and fn.launch_smem[0] <= 232448
    counts = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))

    def count(prefix):
        return sum(v for k, v in counts.items() if k.startswith(prefix))

    assert count("HGMMA") == 8 and count("UTMALDG") >= 4 and count("LDL") == count("STL") == 0


def test_device_offsets_and_the_grouped_limits():
    """Offsets are sanitized on the device (valid ones unchanged); the limits name the fix without reading them."""
    from cute_mxfp8.ops import gemm_sm90 as G
    from cute_mxfp8.ops.gemm_common import device_offsets

    offs = torch.tensor([3, 9, 9, 20], dtype=torch.int32)
    assert torch.equal(device_offsets(offs, 20), offs)
    bad = device_offsets(torch.tensor([5, 2, 30, -1], dtype=torch.int32), 20)
    assert bad.dtype == torch.int32 and bad.tolist() == [5, 5, 20, 20]
    x = torch.randn(48, 64)
    offs = torch.tensor([10, 48], dtype=torch.int32)
    a, a_s = ops.quantize_colwise(x, offs=offs)
    wgrad = G.LIMITS["grouped_mm_wgrad"]
    assert wgrad(a, a_s, a, a_s, offs, torch.float32) is None
    assert "65536" in wgrad(a, a_s, a, a_s, torch.zeros(65537, dtype=torch.int32), torch.float32)
    assert "contiguous" in wgrad(a, a_s, a, a_s, torch.zeros(4, dtype=torch.int32)[::2], torch.float32)
    assert wgrad(a[:, :0], a_s, a[:, :0], a_s, offs, torch.float32) is None  # T = 0: zeros, no launch
    r, r_s = ops.quantize_rowwise(x, offs=offs)
    w, w_s = ops.quantize_rowwise(torch.randn(2, 32, 64))
    assert G.LIMITS["grouped_mm"](r, r_s, w, w_s, offs, torch.bfloat16) is None
    with pytest.raises(ValueError, match="same offs"):
        ops.grouped_mm_wgrad(a, a_s, a, a_s, torch.tensor([48], dtype=torch.int32))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100f"])
def test_token_align_kernel_compiles(arch):
    from cute_mxfp8.jit import compile_token_align

    ptx = compile_token_align(arch, keep_ptx=True).__ptx__
    assert "ld.local" not in ptx and ptx.count("st.global.b32") == 4  # four 32-bit stores: a 16-byte piece


@pytest.mark.parametrize("align", [16, 32])  # SM90's and SM100's 2d-2d kernels
@pytest.mark.parametrize("sizes", [[3, 0, 17, 32], [0], [1] * 40, [129, 0, 0, 16, 5]], ids=str)
def test_aligned_token_layout_maps_every_group_token(sizes, align, rng):
    """The 2d-2d kernels' operand layout: every group starts on an ``align``-aligned column and its columns are
    its tokens in order; the laid-out width is a multiple of ``align`` (TMA's row pitch) whatever T is."""
    from cute_mxfp8.ops.token_layout import aligned_token_layout

    t = sum(sizes) + 7
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    src, starts = aligned_token_layout(offs, t, align)
    assert src.numel() % align == 0 and bool((starts % align == 0).all()) and bool(((src >= 0) & (src < t)).all())
    first = 0
    for g, size in enumerate(sizes):
        assert src[starts[g]:starts[g] + size].tolist() == list(range(first, first + size))
        if g + 1 < len(sizes):
            assert starts[g + 1] >= starts[g] + size
        first += size


def test_group_schedule_counts_tiles_per_group():
    from cute_mxfp8.ops.gemm_common import group_schedule

    offs = torch.tensor([0, 1, 257, 257, 900], dtype=torch.int32)
    s = group_schedule(offs, 256)
    # sizes 0, 1, 256, 0, 643: 256-row tiles 0, 1, 1, 0, 3; 128-row scale tiles 0, 1, 2, 0, 6
    assert s.dtype == torch.int32 and s.tolist() == [[0, 1, 2, 2, 5], [0, 0, 1, 3, 3]]
    assert group_schedule(offs, 128)[0].tolist() == [0, 1, 3, 3, 9]  # the 1-CTA SM100 tiles


def _exact_values(shape, rng):
    """Integers in [-8, 8] times 2**{-1, 0, 1}: exact in e4m3 and e5m2 after any MX scaling, products multiples of
    2**-2 below 2**8, so sums of up to 2**14 of them are exact in fp32 in any order."""
    ints = torch.randint(-8, 9, shape, generator=rng).float()
    return (ints * 2.0 ** torch.randint(-1, 2, shape, generator=rng).float()).cuda()


GROUP_SIZES = [[0, 1, 31, 33, 129, 300], [257], [0, 0], [64, 0, 70]]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("elems,out", VARIANTS, ids=str)
@pytest.mark.parametrize("sizes", GROUP_SIZES, ids=str)
@pytest.mark.parametrize("n,k", [(136, 96), (256, 320)])
def test_sm90_grouped_mm_is_bit_exact_on_integer_data(elems, out, sizes, n, k, rng):
    """2d-3d: every group on its own weight, rows past offs[-1] (40 of them) zero, empty groups and groups of
    1, 31, 33, 129 rows (tiles crossing group ends), N and K not multiples of the tile."""
    t = sum(sizes) + 40
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    a, a_s = ops.quantize_rowwise(_exact_values((t, k), rng), offs=offs, elem_dtype=ELEMS[elems[0]])
    b, b_s = ops.quantize_rowwise(_exact_values((len(sizes), n, k), rng), elem_dtype=ELEMS[elems[1]])
    dt = getattr(torch, out)
    got = ops.grouped_mm(a, a_s, b, b_s, offs, out_dtype=dt, backend="sm90")
    want = ops.grouped_mm(a, a_s, b, b_s, offs, out_dtype=dt, backend="reference")
    assert got.shape == (t, n) and got.dtype == dt and torch.all(got[sum(sizes):] == 0)
    bad = (got.float() != want.float()).sum().item()
    assert bad == 0, f"{bad} of {t * n} outputs differ; first at {(got != want).nonzero()[0].tolist()}"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("elems", [("e4m3", "e4m3"), ("e5m2", "e4m3")], ids=str)
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", GROUP_SIZES, ids=str)
@pytest.mark.parametrize("n,k", [(96, 160), (288, 128)])
def test_sm90_grouped_mm_wgrad_is_bit_exact_on_integer_data(elems, out, sizes, n, k, rng):
    """2d-2d: K = the tokens of each group (blocks never cross a group end; the next group's tokens in a stage are
    masked), empty groups give zero, tokens past offs[-1] are ignored, any token count."""
    t = sum(sizes) + 43  # not a multiple of 16: the op's group-aligned gather pads it
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    dy, x = _exact_values((t, n), rng), _exact_values((t, k), rng)
    a, a_s = ops.quantize_colwise(dy, offs=offs, elem_dtype=ELEMS[elems[0]])
    b, b_s = ops.quantize_colwise(x, offs=offs, elem_dtype=ELEMS[elems[1]])
    dt = getattr(torch, out)
    got = ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, out_dtype=dt, backend="sm90")
    want = ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, out_dtype=dt, backend="reference")
    assert got.shape == (len(sizes), n, k) and got.dtype == dt
    assert all(torch.all(got[g] == 0) for g, s in enumerate(sizes) if s == 0)
    bad = (got.float() != want.float()).sum().item()
    assert bad == 0, f"{bad} of {got.numel()} outputs differ; first at {(got != want).nonzero()[0].tolist()}"


@pytest.mark.gpu
@sm90
def test_sm90_grouped_nan_in_the_next_group_stays_there(rng):
    """2d-2d: a NaN block of group 1 shares a 64-token stage with group 0's last tokens; group 0's dW is finite
    (masked bytes), group 1's is NaN where the reference puts it."""
    sizes = [40, 60]
    t = 112
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    dy, x = torch.randn(t, 64, generator=rng).cuda(), torch.randn(t, 96, generator=rng).cuda()
    dy[45, 3] = float("nan")
    a, a_s = ops.quantize_colwise(dy, offs=offs)
    b, b_s = ops.quantize_colwise(x, offs=offs)
    got = ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, out_dtype=torch.float32, backend="sm90")
    want = ops.grouped_mm_wgrad(a, a_s, b, b_s, offs, out_dtype=torch.float32, backend="reference")
    assert got[0].isfinite().all() and torch.equal(got.isnan(), want.isnan()) and got[1, 3].isnan().all()
    ok = want.isfinite()
    torch.testing.assert_close(got[ok], want[ok], rtol=2.0 ** -12, atol=1e-4)


@pytest.mark.gpu
@sm90
def test_sm90_grouped_experts_autograd_matches_the_reference(rng):
    """MXFP8GroupedExperts fwd + bwd with every GEMM on the SM90 kernels (automatic) vs the reference backend."""
    from cute_mxfp8.nn import MXFP8GroupedExperts
    from cute_mxfp8.ops.backends import resolve_backend

    torch.manual_seed(0)
    ex = MXFP8GroupedExperts(256, 192, 4).cuda()
    counts = torch.tensor([100, 0, 37, 263], device="cuda")
    x = torch.randn(420, 256, generator=rng).cuda()
    offs = counts.cumsum(0).to(torch.int32)
    a, a_s = ops.quantize_rowwise(x, offs=offs)
    w, w_s = ops.quantize_rowwise(ex.w1.detach())
    assert resolve_backend(x.device, op="grouped_mm", args=(a, a_s, w, w_s, offs, torch.bfloat16)) == "sm90"
    outs = {}
    for backend in ("reference", None):
        ex.config = MXFP8Config(backend=backend)
        ex.zero_grad()
        xi = x.clone().requires_grad_()
        y = ex(xi, counts)
        y.backward(torch.ones_like(y))
        outs[backend] = [y.detach(), xi.grad] + [p.grad.clone() for p in ex.parameters()]
    for r, g in zip(outs["reference"], outs[None]):
        sqnr = 10 * torch.log10(r.pow(2).sum() / (r - g).pow(2).sum().clamp_min(1e-30))
        assert sqnr > 35


@pytest.mark.gpu
@sm90
def test_sm90_grouped_out_of_contract_offsets_stay_in_bounds(rng):
    """The kernels never read offs on the host: offsets past T or decreasing are clamped on the device, so the
    result is the reference's for the clamped offsets (and nothing is written out of bounds)."""
    t, n, k = 300, 96, 64
    x, w = _exact_values((t, k), rng), _exact_values((2, n, k), rng)
    good = torch.tensor([120, 300], dtype=torch.int32, device="cuda")
    a, a_s = ops.quantize_rowwise(x, offs=good)
    b, b_s = ops.quantize_rowwise(w)
    want = ops.grouped_mm(a, a_s, b, b_s, good, out_dtype=torch.float32, backend="reference")
    past = torch.tensor([120, 5000], dtype=torch.int32, device="cuda")
    got = ops.grouped_mm(a, a_s, b, b_s, past, out_dtype=torch.float32, backend="sm90")
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    ac, ac_s = ops.quantize_colwise(x, offs=good)
    got = ops.grouped_mm_wgrad(ac, ac_s, ac, ac_s, torch.tensor([120, 90], dtype=torch.int32, device="cuda"),
                               backend="sm90")
    torch.cuda.synchronize()
    assert got.shape == (2, k, k) and torch.all(got[1] == 0)  # decreasing -> [120, 120]: group 1 is empty


# ---- GEMM-fused SwiGLU / dSwiGLU + dual quant on the dequantize mainloop (dense) -------------------------------

@needs_sass
@pytest.mark.parametrize("grouping", ["none", "m"])
@pytest.mark.parametrize("epilogue,elem,mode,hp", [("swiglu", "e4m3", "rceil", False), ("dswiglu", "e5m2", "floor", True)])
def test_fused_epilogues_compile_for_sm90(epilogue, elem, mode, hp, grouping):
    from cute_mxfp8.jit import compile_gemm_sm90

    fn = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "dequant", "sm_90a", True, grouping=grouping,
                           epilogue=epilogue, cast_elem=elem, scale_mode=mode, emit_hp=hp)
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    assert res["local_frame"] == 0 and fn.launch_smem[0] <= 232448
    counts = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))

    def count(prefix):
        return sum(v for k, v in counts.items() if k.startswith(prefix))

    # per warp 2 (swiglu: 64 h columns) or 4 (dswiglu: 128 dh columns, each 2 blocks of dh13) 32 x 32 blocks, a
    # colwise amax scatter (31 shuffles) and 32 factor broadcasts each: gemm_epilogue's code, not a copy
    assert count("HGMMA") == 8 and count("LDL") == count("STL") == 0
    assert count("SHFL") == 63 * (2 if epilogue == "swiglu" else 8)


def test_sm90_fused_limits_name_the_fix():
    from cute_mxfp8.ops import gemm_sm90 as G

    x, x_s = ops.quantize_rowwise(torch.randn(64, 64))
    w, w_s = ops.quantize_rowwise(torch.randn(256, 64))
    assert G.FUSED_LIMITS["mm_swiglu_quant"](x, x_s, w, w_s, "rceil", E4M3, False, torch.bfloat16) is None
    w, w_s = ops.quantize_rowwise(torch.randn(192, 64))  # I = 96: not a multiple of 64
    assert "I % 64" in G.FUSED_LIMITS["mm_swiglu_quant"](x, x_s, w, w_s, "rceil", E4M3, False, torch.bfloat16)
    from cute_mxfp8.ops import gemm_sm100

    offs = torch.tensor([64], dtype=torch.int32)  # grouped fused epilogues: both archs take offs
    x, x_s = ops.quantize_rowwise(torch.randn(64, 64), offs=offs)
    w, w_s = ops.quantize_rowwise(torch.randn(1, 256, 64))  # one expert's W13 (2I = 256)
    for limits in (G.FUSED_LIMITS, gemm_sm100.LIMITS):
        assert limits["mm_swiglu_quant"](x, x_s, w, w_s, "rceil", E4M3, False, torch.bfloat16, offs) is None
        strided = torch.tensor([32, 0, 64, 0], dtype=torch.int32)[::2]  # 2 groups, not contiguous
        assert "offs must be contiguous" in limits["mm_swiglu_quant"](x, x_s, w, w_s, "rceil", E4M3, False,
                                                                      torch.bfloat16, strided)
    w, w_s = ops.quantize_rowwise(torch.randn(1, 192, 64))  # I = 96 per expert: not a multiple of 64
    assert "I % 64" in gemm_sm100.LIMITS["mm_swiglu_quant"](x, x_s, w, w_s, "rceil", E4M3, False, torch.bfloat16,
                                                            offs)
    assert {"mm_swiglu_quant", "mm_dswiglu_quant"} <= set(G.OPS) and G.LIMITS["mm_swiglu_quant"] is G.FUSED_LIMITS["mm_swiglu_quant"]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,d,i", [(300, 256, 192), (77, 128, 64), (512, 96, 320)])
@pytest.mark.parametrize("elem,scale_mode,emit_hp", [("e4m3", "rceil", False), ("e5m2", "floor", True)])
def test_sm90_mm_swiglu_quant_equals_the_standalone_casts_of_its_accumulator(m, d, i, elem, scale_mode, emit_hp,
                                                                             rng):
    """GEMM1 + fused epilogue: h13 in fp32 is the accumulator itself (the dense kernel's, bit for bit), and h's
    dual cast equals the standalone fused SwiGLU kernel's on that accumulator, bytes and scales (same mx_math code)."""
    from cute_mxfp8.ops import gemm_sm90 as G

    x, x_s = ops.quantize_rowwise(torch.randn(m, d, generator=rng).cuda())
    w13, w13_s, _, _ = ops.quantize_gate_up(torch.randn(i, d, generator=rng).cuda() / 4,
                                            torch.randn(i, d, generator=rng).cuda() / 4, gate_up_tile=64)
    h13, q, qs, qt, qts, hp = G.mm_swiglu_quant(x, x_s, w13, w13_s, scale_mode, ELEMS[elem], emit_hp, torch.float32)
    assert torch.equal(h13, ops.mm(x, x_s, w13, w13_s, out_dtype=torch.float32, backend="sm90"))
    rq, rqs, rqt, rqts, rhp = ops.swiglu_quant(concat_gate_up(h13, -1), scale_mode=scale_mode, elem_dtype=ELEMS[elem],
                                               emit_hp=emit_hp, backend="sm90")
    assert torch.equal(qs.view(torch.uint8), rqs.view(torch.uint8))
    assert torch.equal(qts.view(torch.uint8), rqts.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(qt.view(torch.uint8),
                                                                                   rqt.view(torch.uint8))
    if emit_hp:
        torch.testing.assert_close(hp, rhp, rtol=0, atol=0, equal_nan=True)
    h13b = G.mm_swiglu_quant(x, x_s, w13, w13_s, scale_mode, ELEMS[elem], False, torch.bfloat16)[0]
    assert torch.equal(h13b, h13.to(torch.bfloat16))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,d,i", [(300, 256, 192), (77, 128, 64)])
@pytest.mark.parametrize("elem,scale_mode,emit_hp", [("e4m3", "rceil", True), ("e5m2", "floor", False)])
def test_sm90_mm_dswiglu_quant_equals_the_standalone_casts_of_its_accumulator(m, d, i, elem, scale_mode, emit_hp,
                                                                              rng):
    """GEMM3 + fused epilogue vs the standalone dSwiGLU kernel on the dense kernel's fp32 dh (the same mainloop,
    so the same accumulator bits), with the interleaved dh13 layout undone."""
    from cute_mxfp8.ops import gemm_sm90 as G

    dy, dy_s = ops.quantize_rowwise(torch.randn(m, d, generator=rng).cuda())
    w2c, w2c_s = ops.quantize_rowwise(torch.randn(i, d, generator=rng).cuda() / 4)
    h13 = (torch.randn(m, 2 * i, generator=rng) * 3).to(torch.bfloat16).cuda()
    q, qs, qt, qts, hp = G.mm_dswiglu_quant(dy, dy_s, w2c, w2c_s, h13, scale_mode, ELEMS[elem], emit_hp)
    dh = ops.mm(dy, dy_s, w2c, w2c_s, out_dtype=torch.float32, backend="sm90")
    rq, rqs, rqt, rqts, rhp = ops.dswiglu_quant(dh, concat_gate_up(h13, -1).float(), scale_mode=scale_mode,
                                                elem_dtype=ELEMS[elem], blocked=False, emit_hp=emit_hp,
                                                backend="sm90")
    mp = -(-m // 32) * 32
    plain = (F.from_blocked_scales(qs, m, 2 * i // 32), F.from_blocked_scales(qts, 2 * i, mp // 32))
    assert_dh13_equal((q, qt, hp), plain, (rq, rqs, rqt, rqts, rhp), emit_hp)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("align", [16, 32])  # SM90's and SM100's 2d-2d kernels (SM100's zero pad is what it needs)
@pytest.mark.parametrize("sizes", [[3, 0, 17, 32], [0], [1] * 40, [129, 0, 0, 16, 5], [1000, 2047, 1]], ids=str)
def test_token_align_kernel_equals_the_torch_gather(sizes, align, rng):
    """The gather kernel writes every group's tokens where ``aligned_token_layout`` maps them, zeros elsewhere."""
    from cute_mxfp8.jit import compile_token_align
    from cute_mxfp8.ops.token_layout import aligned_token_layout, aligned_width, group_columns

    t = sum(sizes) + 7
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    x = torch.randint(0, 256, (37, t), generator=rng, dtype=torch.uint8).cuda()
    got = torch.full((37, aligned_width(t, len(sizes), align)), 0xAB, dtype=torch.uint8, device="cuda")
    compile_token_align("sm_90a")(x, got, offs, group_columns(offs, align)[2])
    src, starts = aligned_token_layout(offs, t, align)
    want = x.index_select(1, src)
    used = torch.zeros(got.shape[1], dtype=torch.bool, device="cuda")
    for g, size in enumerate(sizes):
        used[int(starts[g]):int(starts[g]) + size] = True
    assert torch.equal(got[:, used], want[:, used]) and bool((got[:, ~used] == 0).all())


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes", [[0, 1, 31, 33, 129, 300], [256, 0, 77]], ids=str)
@pytest.mark.parametrize("elem,scale_mode,emit_hp", [("e4m3", "rceil", False), ("e5m2", "floor", True)])
def test_sm90_grouped_fused_epilogues_equal_the_standalone_grouped_casts(sizes, elem, scale_mode, emit_hp, rng):
    """2d-3d GEMM1 / GEMM3 with the fused epilogues vs the grouped GEMM's own fp32 accumulator through the
    standalone grouped casts (:func:`fused_checks.grouped_fused_check`)."""
    grouped_fused_check("sm90", sizes, ELEMS[elem], scale_mode, emit_hp, rng)


# ---- the Hopper fast mode's GEMM (issue 16): one promotion per 128 of K ---------------------------------------------
@needs_sass
def test_fast_mode_gemm_compiles_with_a_quarter_of_the_promotions():
    from cute_mxfp8.jit import compile_gemm_sm90

    def facts(block_k):
        fn = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=block_k)
        (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
        counts = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))
        return res, lambda p: sum(v for k, v in counts.items() if k.startswith(p))

    res, count = facts(128)
    _, count32 = facts(32)
    assert res["local_frame"] == 0 and count("LDL") == count("STL") == 0
    assert count("QGMMA") == 8 and count("UTMALDG") == 2 and count("USETMAXREG") == 2
    # the promotion FMUL + FFMA pairs: 64 accumulator elements per thread, once per stage instead of 4 times; the
    # thread's 16 column scales in 4 16-byte loads
    assert count("FFMA") * 4 == count32("FFMA") and count("FFMA") == 64 and count("LDS.128") == 4
    with pytest.raises(ValueError, match="block_k"):
        compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "dequant", block_k=128)
    with pytest.raises(ValueError, match="n_tile"):
        compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", block_k=32, n_tile=192)
    wide = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=128, n_tile=192)
    (res,) = sass_facts.cubin_resources(wide.__cubin__).values()
    assert res["local_frame"] == 0 and wide.launch_smem[0] <= 232448
    counts = sass_facts.opcode_counts(sass_facts.disassemble(wide.__cubin__))
    assert counts["FFMA"] == 96 and counts["LDS.128"] == 6 and counts["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1
    assert counts["QGMMA.64x96x32.F32.E4M3.E4M3"] == 8  # split N: each warpgroup's 96 columns, 4 K steps per stage
    # the 2d-3d build (ops.grouped_mm(..., scale_block=128)): the same mainloop on the groups' tiles
    grouped = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=128, n_tile=192,
                                grouping="m")
    (res,) = sass_facts.cubin_resources(grouped.__cubin__).values()
    g_counts = sass_facts.opcode_counts(sass_facts.disassemble(grouped.__cubin__))
    assert res["local_frame"] == 0 and all(g_counts[op] == counts[op] for op in ("QGMMA.64x96x32.F32.E4M3.E4M3",
                                                                                 "FFMA", "LDS.128", "UTMALDG.2D"))
    wgrad = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=128, n_tile=192,
                              grouping="k")  # 2d-2d: the same mainloop over each group's 128-aligned tokens
    (res,) = sass_facts.cubin_resources(wgrad.__cubin__).values()
    k_counts = sass_facts.opcode_counts(sass_facts.disassemble(wgrad.__cubin__))
    assert res["local_frame"] == 0 and all(k_counts[op] == counts[op] for op in ("FFMA", "LDS.128", "UTMALDG.2D"))
    for bad, says in ((dict(grouping="x"), "grouping must be"), (dict(grouping="m", block_k=32), "block_k=128"),
                      (dict(grouping="k", cluster_mn=(2, 1)), r"cluster_mn=\(1, 1\)")):
        with pytest.raises(ValueError, match=says):
            compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", **{"block_k": 128, **bad})


def _fast_integer_operand(rows, k, elem, rng):
    """Integers in [-4, 4] times a power of two shared by each (row, 128-block): a 128-block's products sum to at
    most 11 bits, exact in the fp8 WGMMA's accumulation, and every summation order gives the same fp32 bits."""
    ints = torch.randint(-4, 5, (rows, k), generator=rng).float()
    exps = torch.randint(-1, 2, (rows, (k + 127) // 128), generator=rng).float().repeat_interleave(128, 1)[:, :k]
    q, s = F.quantize_mxfp8((ints * 2.0 ** exps).cuda(), elem_dtype=ELEMS[elem], scale_block=128)
    return q, F.to_blocked_scales(s)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("elems,out", VARIANTS, ids=str)
@pytest.mark.parametrize("m,n,k", [(128, 128, 128), (300, 200, 96), (257, 129, 416), (640, 384, 2048),
                                   (130, 260, 384)])
@pytest.mark.parametrize("n_tile", [128, 192])
def test_fast_mode_gemm_integer_data_is_bit_exact(elems, out, m, n, k, n_tile, rng):
    from cute_mxfp8.jit import compile_gemm_sm90

    a, a_s = _fast_integer_operand(m, k, elems[0], rng)
    b, b_s = _fast_integer_operand(n, k, elems[1], rng)
    dt = getattr(torch, out)
    got = torch.empty(m, n, dtype=dt, device="cuda")
    fn = compile_gemm_sm90(*elems, out, "promote", block_k=128, n_tile=n_tile)
    fn(a, b, a_s.view(torch.uint8), b_s.view(torch.uint8), got)
    want = ops.mm(a, a_s, b, b_s, out_dtype=dt, backend="reference")
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {m * n} differ"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,n,k", [(512, 384, 1024), (1000, 130, 4128), (300, 520, 640)])
@pytest.mark.parametrize("n_tile", [128, 192])
def test_fast_mode_gemm_random_data_within_the_accumulation_bound(m, n, k, n_tile, rng):
    from cute_mxfp8.jit import compile_gemm_sm90

    x = torch.randn(m, k, generator=rng).cuda() * torch.logspace(-3, 3, k, device="cuda")
    w = torch.randn(n, k, generator=rng).cuda()
    (a, sa), (b, sb) = (F.quantize_mxfp8(t, scale_block=128) for t in (x, w))
    got = torch.empty(m, n, device="cuda")
    compile_gemm_sm90("e4m3", "e4m3", "float32", "promote", block_k=128, n_tile=n_tile)(
        a, b, F.to_blocked_scales(sa).view(torch.uint8), F.to_blocked_scales(sb).view(torch.uint8), got)
    da, db = F.dequantize_mxfp8(a, sa).double(), F.dequantize_mxfp8(b, sb).double()
    mag = da.abs() @ db.abs().t()
    # each 128-deep partial is one WGMMA chain with ~14-bit accumulation (as the per-32 kernel's bound says),
    # within ~2**-13 of its sum of |products|; the promotions add the partials in fp32
    bound = (2.0 ** -12 + k * 2.0 ** -24) * mag
    err = (got.double() - da @ db.t()).abs()
    ratio = (err / mag.clamp_min(1e-300)).max().item()
    print(f"fast mode: max |error| / sum |a||b| = {ratio:.3g}")
    assert bool((err <= bound).all()), f"max error / sum|a||b| {ratio:.3g}"


# ---- the split tail: the last round's tiles in K parts (kernels.tile_scheduler.tail_split) ----

@needs_sass
@pytest.mark.parametrize("kw", [dict(n_tile=192), dict(n_tile=192, b_block_n=128, consumer_split="m", tma_store=True),
                                dict(n_tile=192, b_block_n=128, consumer_split="m")], ids=str)
def test_the_split_tail_builds_join_their_parts_without_spilling(kw):
    """Each split build (the ops' two: 1x128 B split N, 128 x 128 B split M with the TMA-stored tile; and split M
    per thread) writes its part with coalesced stores, meets the tile's other parts through one GPU-scope atomic
    per CTA, and reads them back with L1-bypassing loads (one per accumulator element), in registers."""
    from cute_mxfp8.jit import compile_gemm_sm90

    fn = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=128, split_tail=True,
                           **kw)
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    counts = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))
    assert res["local_frame"] == 0 and counts.get("LDL", 0) == counts.get("STL", 0) == 0
    assert counts.get("ATOMG.E.ADD.STRONG.GPU", 0) == 1 and counts.get("LDG.E.STRONG.GPU", 0) == 96
    assert counts.get("MEMBAR.ALL.GPU", 0) >= 2 and counts.get("USETMAXREG.TRY_ALLOC.CTAPOOL", 0) == 1
    whole = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=128, **kw)
    unsplit = sass_facts.opcode_counts(sass_facts.disassemble(whole.__cubin__))
    # the same mainloop: WGMMAs, promotion FFMAs, TMA loads
    def total(c, prefix):
        return sum(v for op, v in c.items() if op.startswith(prefix))

    assert all(total(counts, op) == total(unsplit, op) > 0 for op in ("QGMMA", "FFMA", "UTMALDG"))


def test_the_split_tail_is_a_dense_fast_mode_option():
    from cute_mxfp8.jit import compile_gemm_sm90

    for bad in (dict(block_k=32), dict(grouping="m"), dict(cluster_mn=(2, 1)), dict(split_tail=1)):
        kw = {"block_k": 128, "split_tail": True, **bad}
        with pytest.raises(ValueError, match="split_tail"):
            compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", **kw)
    with pytest.raises(ValueError, match="split_tail"):
        compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "dequant", split_tail=True)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,n,k", [(1024, 768, 2048), (256, 384, 4096), (300, 1000, 4128), (128, 8, 2048),
                                   (8192, 2048, 1024)])
@pytest.mark.parametrize("b_blocks_2d", [False, True])
def test_split_tail_gemm_is_bit_exact_on_integer_data_and_leaves_its_counters_zero(m, n, k, b_blocks_2d, rng,
                                                                                   monkeypatch):
    """Shapes whose last round is split on 132 SMs (``ops.gemm_sm90._tail_split``: all 32 tiles in 4 parts, 4 in
    8, 18 in 7 with a partial last K tile, 1 in 4, the last 44 of 704 in 2), called three times in a row (the
    counters go back to 0 each launch): every call equals the reference bit for bit, bf16 and fp32, both B scale
    layouts."""
    from cute_mxfp8.ops import gemm_sm90 as G
    from test_weight_blocks_2d import _integer_weight

    monkeypatch.setattr(G, "SPLIT_TAIL", True)
    assert G._tail_split(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)[1] > 1
    a, a_s = _fast_integer_operand(m, k, "e4m3", rng)
    if b_blocks_2d:
        b, b_s = ops.quantize_rowwise(_integer_weight((n, k), rng).cuda(), scale_block=128, blocks_2d=True)
    else:
        b, b_s = _fast_integer_operand(n, k, "e4m3", rng)
    for out in (torch.bfloat16, torch.float32):
        want = ops.mm(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), out_dtype=out, backend="reference", scale_block=128,
                      b_blocks_2d=b_blocks_2d)
        for _ in range(3):
            got = ops.mm(a, a_s, b, b_s, out_dtype=out, backend="sm90", scale_block=128, b_blocks_2d=b_blocks_2d)
            assert torch.equal(got.cpu(), want), f"{(got.cpu() != want).sum().item()} of {m * n} differ"
    torch.cuda.synchronize()
    assert all(int(f.abs().sum()) == 0 for f in G._SPLIT_FLAGS.values())


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,n,k", [(1024, 768, 2048), (256, 384, 4096)])
def test_split_tail_regroups_only_the_fp32_k_sum(m, n, k, rng, monkeypatch):
    """Random data over 6 decades: the split result differs from the unsplit kernel's only by the fp32 sum's
    regrouping (parts added at the end instead of in order): within ``parts`` fp32 roundings of the sum of
    |products| of each output, and deterministic (the same bits on every call)."""
    from cute_mxfp8.ops import gemm_sm90 as G

    x = torch.randn(m, k, generator=rng).cuda() * torch.logspace(-3, 3, k, device="cuda")
    w = torch.randn(n, k, generator=rng).cuda()
    (a, a_s), (b, b_s) = (ops.quantize_rowwise(t, scale_block=128) for t in (x, w))
    monkeypatch.setattr(G, "SPLIT_TAIL", True)
    parts = G._tail_split(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)[1]
    split = [ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, scale_block=128) for _ in range(3)]
    monkeypatch.setattr(G, "SPLIT_TAIL", False)
    whole = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, scale_block=128)
    da, db = (F.dequantize_mxfp8(q, F.from_blocked_scales(s, r, k // 32)).double()
              for q, s, r in ((a, a_s, m), (b, b_s, n)))
    mag = da.abs() @ db.abs().t()
    assert parts > 1 and all(torch.equal(s, split[0]) for s in split[1:])
    assert bool(((split[0].double() - whole.double()).abs() <= parts * 2.0 ** -23 * mag).all())


@needs_sass
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2), (2, 2)])
def test_fast_mode_gemm_clusters_multicast_the_shared_tile(cluster):
    from cute_mxfp8.jit import compile_gemm_sm90

    fn = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=128, cluster_mn=cluster)
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    counts = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))
    assert res["local_frame"] == 0 and counts.get("LDL", 0) == counts.get("STL", 0) == 0
    # one TMA load per operand; the shared one (A across the cluster's N CTAs, B across its M CTAs) multicast
    assert counts.get("UTMALDG.2D.MULTICAST", 0) == (cluster[0] > 1) + (cluster[1] > 1)
    assert counts.get("UTMALDG.2D.MULTICAST", 0) + counts.get("UTMALDG.2D", 0) == 2
    with pytest.raises(ValueError, match="cluster_mn"):
        compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", block_k=128, cluster_mn=(4, 1))
    with pytest.raises(ValueError, match="cluster_mn"):
        compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "dequant", cluster_mn=cluster)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("m,n,k", [(257, 129, 416), (640, 384, 2048), (130, 260, 384), (384, 640, 256)])
def test_fast_mode_gemm_clusters_are_bit_exact(cluster, m, n, k, rng):
    """Clusters whose CTAs fall past the output's last tile row / column (257 x 129 is 3 x 2 tiles: with 2 x 2
    clusters, two CTAs have no output) still load and release their slices of the multicast tiles."""
    from cute_mxfp8.jit import compile_gemm_sm90

    a, a_s = _fast_integer_operand(m, k, "e4m3", rng)
    b, b_s = _fast_integer_operand(n, k, "e4m3", rng)
    for out in (torch.bfloat16, torch.float32):
        got = torch.empty(m, n, dtype=out, device="cuda")
        fn = compile_gemm_sm90("e4m3", "e4m3", str(out).split(".")[1], "promote", block_k=128, cluster_mn=cluster)
        fn(a, b, a_s.view(torch.uint8), b_s.view(torch.uint8), got)
        want = ops.mm(a, a_s, b, b_s, out_dtype=out, backend="reference")
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {m * n} differ"


@pytest.mark.gpu
@sm90
def test_sm90_grouped_experts_device_counts_prefetch_matches_host_counts(rng):
    """Device counts (kept on the device by default) give results bit-identical to passing the same counts as Python
    ints, a later in-place change of the counts tensor is seen by the next call, and with ``validate_counts=True``
    (the counts copied to pinned host memory as the forward starts) bad device counts raise the same errors as
    host ones."""
    from cute_mxfp8.nn import MXFP8GroupedExperts

    torch.manual_seed(0)
    ex = MXFP8GroupedExperts(256, 256, 4, config=MXFP8Config(hopper_block_k=128)).cuda()
    x = torch.randn(500, 256, generator=rng).cuda()
    counts = torch.tensor([100, 0, 37, 263], device="cuda")
    for host in ([100, 0, 37, 263], [1, 300, 0, 199]):
        counts.copy_(torch.tensor(host))  # in place: the prefetch must read this call's values
        outs = []
        for c in (host, counts):
            ex.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = ex(xi, c)
            y.backward(torch.ones_like(y))
            outs.append([y.detach(), xi.grad] + [p.grad for p in ex.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    ex.validate_counts = True
    for bad, match in (([5, -1, 0, 0], "must be >= 0"), ([400, 200, 0, 0], "sums to 600 but x has 500")):
        with pytest.raises(ValueError, match=match):
            ex(x, torch.tensor(bad, device="cuda"))
        with pytest.raises(ValueError, match=match):
            ex(x, torch.tensor(bad, device="cuda", dtype=torch.int32))
