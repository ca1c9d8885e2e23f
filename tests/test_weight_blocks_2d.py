"""The Hopper fast mode's 128 x 128 weight blocks (``MXFP8Config(hopper_weight_blocks="128x128")``, issue 16):
the reference quantization (``formats.quantize_mxfp8(..., blocks_2d=True)``), the ops' arguments and promise
checks, the autograd functions on the reference, and on the H200 the tile-cast kernels (bit-exact) and the
fast-mode GEMMs with one scalar B scale per block (bit-exact on integer data)."""

from __future__ import annotations

import pytest
import torch

from cute_mxfp8 import MXFP8Config, ops
from cute_mxfp8 import formats as F
from cute_mxfp8.ops import autograd as AG
from test_fast_mode import _equal, _fast_integer_values as _integer_act, _sqnr, _u8, sm90

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _mlp_inputs(grouped, e, d, i, m, rng):
    """x (m, d), [w1, w2, w3] (dense or e experts), dy: the SwiGLU MLP tests' random operands."""
    lead = (e,) if grouped else ()
    x = torch.randn(m, d, generator=rng)
    ws = [torch.randn(*lead, i, d, generator=rng) / d ** 0.5, torch.randn(*lead, d, i, generator=rng) / i ** 0.5,
          torch.randn(*lead, i, d, generator=rng) / d ** 0.5]
    return x, ws, torch.randn(m, d, generator=rng)


def _tile_max(scales_1x128: torch.Tensor, rows: int) -> torch.Tensor:
    """The largest 1x128 scale byte of each 128 x 128 tile, repeated back to the plain (.., rows, K/32) layout."""
    s = _u8(scales_1x128).float()
    kb = s.shape[-1]
    pad = torch.nn.functional.pad(s, (0, -kb % 4, 0, -rows % 128), value=-1)
    tiles = pad.unflatten(-1, (-1, 4)).unflatten(-3, (-1, 128)).amax(dim=(-3, -1))
    return tiles.repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(4, -1)[..., :kb]


# ---- reference numerics ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 384), (200, 96), (3, 160, 288), (1, 32)])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_each_tile_takes_the_largest_of_its_1x128_scales(shape, mode, rng):
    x = torch.randn(*shape, generator=rng) * torch.logspace(-6, 6, shape[-2])[:, None]
    q, s = F.quantize_mxfp8(x, scale_mode=mode, scale_block=128, blocks_2d=True)
    _, s1 = F.quantize_mxfp8(x, scale_mode=mode, scale_block=128)
    assert torch.equal(_u8(s).float(), _tile_max(s1, shape[-2]))
    # the elements: x over the tile's scale, rounded and saturated (the formats' element rule)
    want = (x / F.e8m0_to_float(_u8(s)).repeat_interleave(32, -1)).clamp(-448, 448).to(E4M3)
    assert torch.equal(_u8(q), _u8(want))


@pytest.mark.parametrize("shape", [(256, 384), (224, 96), (2, 160, 128)])
def test_rowwise_and_colwise_casts_hold_the_same_elements(shape, rng):
    x = torch.randn(*shape, generator=rng) * torch.logspace(-3, 3, shape[-1])
    qr, sr = F.quantize_mxfp8(x, dim=-1, scale_block=128, blocks_2d=True)
    qc, sc = F.quantize_mxfp8(x, dim=-2, scale_block=128, blocks_2d=True)
    assert torch.equal(_u8(qr), _u8(qc))
    assert torch.equal(F.dequantize_mxfp8(qr, sr), F.dequantize_mxfp8(qc, sc, dim=-2))


def test_a_nan_poisons_its_tile_only(rng):
    x = torch.randn(256, 256, generator=rng)
    x[130, 200] = float("nan")
    q, s = F.quantize_mxfp8(x, scale_block=128, blocks_2d=True)
    b = _u8(s)
    assert torch.all(b[128:, 4:] == 255) and torch.all(b[:128] != 255) and torch.all(b[128:, :4] != 255)
    assert torch.isnan(q[128:, 128:].float()).all() and not torch.isnan(q[:128].float()).any()


def test_blocks_2d_arguments_are_checked():
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="scale_block=128"):
        F.quantize_mxfp8(x, blocks_2d=True)
    with pytest.raises(TypeError, match="blocks_2d must be a bool"):  # (a type error, as for blocked=1)
        F.quantize_mxfp8(x, blocks_2d=1, scale_block=128)
    with pytest.raises(ValueError, match="rank >= 2"):
        F.quantize_mxfp8(torch.randn(64), scale_block=128, blocks_2d=True)
    with pytest.raises(ValueError, match="last two dims"):
        F.quantize_mxfp8(torch.randn(64, 32, 32), dim=0, scale_block=128, blocks_2d=True)
    offs = torch.tensor([64], dtype=torch.int32)
    for op in (ops.quantize_rowwise, ops.quantize_colwise, ops.quantize_dual):
        with pytest.raises(ValueError, match="blocks_2d"):
            op(x, blocks_2d=True, backend="reference")
        with pytest.raises(ValueError, match="no offs"):
            op(x, offs=offs, blocks_2d=True, scale_block=128, backend="reference")
        with pytest.raises(TypeError, match="blocks_2d must be a bool"):
            op(x, blocks_2d="yes", scale_block=128, backend="reference")
    with pytest.raises(ValueError, match="blocks_2d"):
        ops.quantize_gate_up(x, x, blocks_2d=True, backend="reference")
    a, a_s = ops.quantize_rowwise(x, scale_block=128)
    with pytest.raises(ValueError, match="b_blocks_2d"):
        ops.mm(a, a_s, a, a_s, b_blocks_2d=True, backend="reference")
    with pytest.raises(TypeError, match="b_blocks_2d must be a bool"):
        ops.mm(a, a_s, a, a_s, b_blocks_2d=1, scale_block=128, backend="reference")
    dy, dy_s = ops.quantize_colwise(torch.randn(64, 64), offs=offs, backend="reference")
    with pytest.raises(TypeError, match="split_halves must be a bool"):
        ops.grouped_mm_wgrad(dy, dy_s, dy, dy_s, offs, split_halves=1, backend="reference")
    with pytest.raises(ValueError, match="hopper_weight_blocks"):
        MXFP8Config(hopper_weight_blocks="128x128")
    with pytest.raises(ValueError, match="hopper_weight_blocks"):
        MXFP8Config(hopper_block_k=128, hopper_weight_blocks="2d")


def test_ops_reference_casts_are_the_formats_quantization(rng):
    for shape in [(256, 160), (2, 224, 96)]:
        x = torch.randn(*shape, generator=rng) * torch.logspace(-4, 4, shape[-1])
        kw = dict(scale_block=128, blocks_2d=True)
        r, rs, c, cs = ops.quantize_dual(x, blocked=False, backend="reference", **kw)
        qr, sr = F.quantize_mxfp8(x, dim=-1, **kw)
        qc, sc = F.quantize_mxfp8(x, dim=-2, **kw)
        _equal((r, rs, c, cs), (qr, sr, qc.transpose(-1, -2).contiguous(), sc.transpose(-1, -2).contiguous()))
    w1, w3 = torch.randn(256, 96, generator=rng), torch.randn(256, 96, generator=rng) * 100
    got = ops.quantize_gate_up(w1, w3, scale_block=128, blocks_2d=True, blocked=False, backend="reference")
    want = ops.quantize_dual(torch.cat([w1, w3]), scale_block=128, blocks_2d=True, blocked=False,
                             backend="reference")
    _equal(got, want)  # a tile of W13 never mixes the projections (I % 128 == 0)


def test_b_blocks_2d_promise_is_checked_by_the_reference(rng):
    a, a_s = ops.quantize_rowwise(torch.randn(64, 256, generator=rng), scale_block=128)
    w = torch.randn(256, 256, generator=rng) * torch.logspace(-2, 2, 256)[:, None]  # rows of different scales
    b, b_s = ops.quantize_rowwise(w, scale_block=128)
    with pytest.raises(ValueError, match="along each 128 rows"):
        ops.mm(a, a_s, b, b_s, scale_block=128, b_blocks_2d=True, backend="reference")
    b2, b2_s = ops.quantize_rowwise(w, scale_block=128, blocks_2d=True)
    got = ops.mm(a, a_s, b2, b2_s, scale_block=128, b_blocks_2d=True, backend="reference")
    assert torch.equal(got, ops.mm(a, a_s, b2, b2_s, scale_block=128, backend="reference"))
    offs = torch.tensor([30, 64], dtype=torch.int32)
    ga, ga_s = ops.quantize_rowwise(torch.randn(64, 256, generator=rng), offs=offs, scale_block=128)
    wb = torch.stack([w, w.flip(0)])
    with pytest.raises(ValueError, match="along each 128 rows"):
        ops.grouped_mm(ga, ga_s, *ops.quantize_rowwise(wb, scale_block=128), offs, scale_block=128,
                       b_blocks_2d=True, backend="reference")
    q, s = ops.quantize_rowwise(wb, scale_block=128, blocks_2d=True)
    ops.grouped_mm(ga, ga_s, q, s, offs, scale_block=128, b_blocks_2d=True, backend="reference")


def _deq2d(w):
    q, s = F.quantize_mxfp8(w, scale_block=128, blocks_2d=True)
    return F.dequantize_mxfp8(q, s)


def test_linear_with_128x128_weights_is_the_product_of_those_operands(rng):
    """Forward = x's 1x128 cast times w's 128 x 128 cast; the dgrad's weight operand is the same elements."""
    x = torch.randn(200, 256, generator=rng)
    w = torch.randn(384, 256, generator=rng) * torch.logspace(-3, 3, 384)[:, None]
    cfg = MXFP8Config(hopper_block_k=128, hopper_weight_blocks="128x128", backend="reference")
    xs = F.dequantize_mxfp8(*F.quantize_mxfp8(x, scale_block=128))
    y = AG.mxfp8_linear(x, w, config=cfg)
    assert torch.allclose(y, xs @ _deq2d(w).t(), rtol=1e-5, atol=1e-5)
    y1 = AG.mxfp8_linear(x, w, config=MXFP8Config(hopper_block_k=128, backend="reference"))
    assert not torch.equal(y, y1)  # the rows' scales differ within tiles here: the weights round differently
    xg = x.clone().requires_grad_()
    dy = torch.randn(200, 384, generator=rng)
    AG.mxfp8_linear(xg, w, config=cfg).backward(dy)
    dys = F.dequantize_mxfp8(*F.quantize_mxfp8(dy, scale_block=128))
    wt = w.t().contiguous()
    wts = F.dequantize_mxfp8(*F.quantize_mxfp8(wt, scale_block=128, blocks_2d=True))
    assert torch.allclose(xg.grad, dys @ wts.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(wts, _deq2d(w).t())


@pytest.mark.parametrize("grouped", [False, True])
def test_mlp_with_128x128_weights_matches_the_exact_recipe(grouped, rng):
    e, d, i, m = 3, 128, 256, 192
    x, ws, dy = _mlp_inputs(grouped, e, d, i, m, rng)
    offs = torch.tensor([50, 50, 180], dtype=torch.int32) if grouped else None

    def mlp(x, w1, w2, w3, rows=slice(None)):
        return (torch.nn.functional.silu(x[rows] @ w1.t()) * (x[rows] @ w3.t())) @ w2.t()

    def hp(x, w1, w2, w3, offs):  # fp32, per token group
        if offs is None:
            return mlp(x, w1, w2, w3)
        ends = [0] + offs.tolist()
        parts = [mlp(x, w1[g], w2[g], w3[g], slice(ends[g], ends[g + 1])) for g in range(len(offs))]
        return torch.cat(parts + [x.new_zeros(m - ends[-1], d)])

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, *ws)]
        y = fn(*leaves)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    def mx(cfg):
        return run(lambda *leaves: ops.mxfp8_swiglu_mlp(*leaves, offs=offs, config=cfg))

    ref = run(lambda *leaves: hp(*leaves, offs))
    w2d = mx(MXFP8Config(hopper_block_k=128, hopper_weight_blocks="128x128", backend="reference"))
    fast = mx(MXFP8Config(hopper_block_k=128, backend="reference"))
    for r, b, c in zip(ref, w2d, fast):  # about MXFP8's accuracy (~25-30 dB here), and within 1.5 dB of 1x128's
        assert _sqnr(r, b) > 22 and _sqnr(r, b) > _sqnr(r, c) - 1.5


# ---- the kernels, compiled on the CPU (SASS facts) --------------------------------------------------------------

def _sass(fn):
    from cute_mxfp8.cli import sass_facts

    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    sass = sass_facts.disassemble(fn.__cubin__)
    counts = sass_facts.opcode_counts(sass)  # an opcode and its modifiers; a pattern with operands: as text
    return res, (lambda p: sass.count(p) if " " in p else sum(v for k, v in counts.items()
                                                              if k == p or k.startswith(p + ".")))


@pytest.mark.parametrize("split,grouping", [("m", "none"), ("m", "m"), ("n", "none")])
def test_the_128x128_gemm_promotes_with_one_ffma_per_element(split, grouping):
    """Per stage: 96 FFMA (a thread's accumulator elements) and 12 FMUL (rows x 32-column chunks times the two
    blocks' scalars; the 1x128 build: 96 FMUL), the B scales one 8-byte shared load (1x128: 6 x 16 bytes), one
    m64n192 (split M) or two m64n96 (split N) WGMMAs per K step, no local memory, setmaxnreg kept."""
    from cute_mxfp8.cli.sass_facts import find_nvdisasm
    from cute_mxfp8.jit import compile_gemm_sm90

    if find_nvdisasm() is None:
        pytest.skip('nvdisasm not installed (pip install -e ".[sass]")')
    fn = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, block_k=128, n_tile=192,
                           grouping=grouping, b_block_n=128, consumer_split=split)
    res, count = _sass(fn)
    assert res["local_frame"] == 0 and count("LDL") == count("STL") == 0 and count("USETMAXREG") == 2
    assert count("FFMA") == 96 and count("FMUL") == 12 and count("LDS.64") == 1 and count("LDS.128") == 0
    assert count("QGMMA.64x192x32.F32.E4M3.E4M3") == (4 if split == "m" else 0)
    assert count("QGMMA.64x96x32.F32.E4M3.E4M3") == (0 if split == "m" else 8)
    for bad in (dict(b_block_n=64), dict(b_block_n=128, block_k=32), dict(b_block_n=128, grouping="k"),
                dict(consumer_split="m"), dict(b_block_n=128, consumer_split="k")):
        with pytest.raises(ValueError, match="b_block_n|consumer_split"):
            compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", **{"block_k": 128, **bad})


def test_the_tma_store_epilogue_stages_the_tile_and_stores_it_asynchronously():
    """The split-M build with ``tma_store``: the 128 x 192 tile written to shared memory by 12 ``stmatrix`` per
    thread (96 bf16 = 12 x 8) and stored by TMA, each warpgroup's first warp 6 boxes of 64 x 32 (the 6 UTMASTG of
    the code, 12 per tile; no thread-level global stores), the
    same mainloop (96 FFMA, 4 WGMMAs per stage), the two epilogue barriers, no local memory."""
    from cute_mxfp8.cli.sass_facts import find_nvdisasm
    from cute_mxfp8.jit import compile_gemm_sm90

    if find_nvdisasm() is None:
        pytest.skip('nvdisasm not installed (pip install -e ".[sass]")')
    kw = dict(block_k=128, n_tile=192, b_block_n=128, consumer_split="m")
    direct = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, **kw)
    staged = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, tma_store=True, **kw)
    (res_d, count_d), (res, count) = _sass(direct), _sass(staged)
    assert res["local_frame"] == 0 and count("LDL") == count("STL") == 0 and count("USETMAXREG") == 2
    assert res["regs"] == res_d["regs"]  # the staging adds no registers to the consumers' budget
    assert count("STSM") == 12 and count("UTMASTG") == 6 and count("STG") == 0 and count_d("STG") > 0
    assert count_d("STSM") == count_d("UTMASTG") == 0
    assert count("FFMA") == count_d("FFMA") == 96 and count("QGMMA.64x192x32.F32.E4M3.E4M3") == 4
    assert count("BAR.SYNC") == count_d("BAR.SYNC") + 2
    for bad in (dict(kw, consumer_split="n"), dict(kw, grouping="k"), dict(block_k=128), dict(kw, cluster_mn=(2, 1))):
        with pytest.raises(ValueError, match="tma_store|b_block_n"):  # (2d-2d has no 128 x 128 B blocks either)
            compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", tma_store=True, **bad)
    with pytest.raises(ValueError, match="tma_store"):
        compile_gemm_sm90("e4m3", "e4m3", "float32", "promote", tma_store=True, **kw)
    with pytest.raises(ValueError, match="tma_store=True: options of mainloop='promote'"):
        compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "dequant", tma_store=True)
    with pytest.raises(ValueError, match="tma_store"):  # not the cached True build
        compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, tma_store=1, **kw)


def test_the_grouped_tma_store_build_stages_its_tile_without_spilling():
    """The 2d-3d build with ``tma_store``: the same staging (12 ``stmatrix``, 6 UTMASTG per warpgroup), plus the
    element-wise copy of a group's last rows from the staged tile (6 boxes x 16 elements per thread: 96 STG of
    16 bits, no 32-bit pairs) in place of the per-thread stores (144 STG); setmaxnreg 24 / 240 keeps it out of
    local memory (at 40 / 232 ptxas spilled 4 words), the same mainloop."""
    from cute_mxfp8.cli.sass_facts import find_nvdisasm
    from cute_mxfp8.jit import compile_gemm_sm90

    if find_nvdisasm() is None:
        pytest.skip('nvdisasm not installed (pip install -e ".[sass]")')
    kw = dict(block_k=128, n_tile=192, b_block_n=128, consumer_split="m", grouping="m")
    direct = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, **kw)
    staged = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, tma_store=True, **kw)
    (res_d, count_d), (res, count) = _sass(direct), _sass(staged)
    assert res["local_frame"] == 0 and count("LDL") == count("STL") == 0 and count("USETMAXREG") == 2
    assert count("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0") == 1 and count("USETMAXREG.DEALLOC.CTAPOOL 0x18") == 1
    assert count("STSM") == 12 and count("UTMASTG") == 6 and count("STG.E.U16") == 96 and count("STG") == 96
    assert count_d("STG") == 144 and count_d("STSM") == count_d("UTMASTG") == 0
    assert count("FFMA") == count_d("FFMA") == 96 and count("QGMMA.64x192x32.F32.E4M3.E4M3") == 4


def test_the_2d_2d_tma_store_build_stages_each_warpgroups_columns_without_spilling():
    """The split-N 2d-2d (wgrad) build with ``tma_store``: each consumer thread writes its 96 bf16 as 48 32-bit
    shared stores into the swizzled staging, the warpgroup's first warp stores its 3 boxes of 128 x 32 by TMA
    (the 3 UTMASTG of the code); the per-thread stores stay for tiles whose rows are not all one group's (N % 128
    != 0); the same mainloop (96 FMUL + 96 FFMA, 8 WGMMAs per stage), two more barriers, no local memory."""
    from cute_mxfp8.cli.sass_facts import find_nvdisasm
    from cute_mxfp8.jit import compile_gemm_sm90

    if find_nvdisasm() is None:
        pytest.skip('nvdisasm not installed (pip install -e ".[sass]")')
    kw = dict(block_k=128, n_tile=192, grouping="k", split_halves=True)
    direct = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, **kw)
    staged = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", "sm_90a", True, tma_store=True, **kw)
    (res_d, count_d), (res, count) = _sass(direct), _sass(staged)
    assert res["local_frame"] == 0 and count("LDL") == count("STL") == 0 and res["regs"] == res_d["regs"]
    assert count("STS") == count_d("STS") + 48 and count("UTMASTG") == 3 and count_d("UTMASTG") == 0
    assert count("STG") == count_d("STG") > 0 and count("STSM") == 0
    assert count("FFMA") == count_d("FFMA") == 96 and count("FMUL") == count_d("FMUL") == 96
    assert count("QGMMA.64x96x32.F32.E4M3.E4M3") == count_d("QGMMA.64x96x32.F32.E4M3.E4M3") == 8
    assert count("BAR.SYNC") == count_d("BAR.SYNC") + 2
    assert staged.launch_smem[0] <= 232448  # 4 stages of 40 KB + the 48 KB tile (the direct build: 5 stages)
    for bad in (dict(block_k=128, grouping="k", out_dtype="float32"), dict(block_k=128, grouping="m"),
                dict(block_k=128)):  # split N stages only the 2d-2d tile; a bf16 one
        out = bad.pop("out_dtype", "bfloat16")
        with pytest.raises(ValueError, match="tma_store"):
            compile_gemm_sm90("e4m3", "e4m3", out, "promote", tma_store=True, **bad)


def test_the_fast_wgrad_picks_the_tma_store_build_for_a_bf16_output_with_a_16_byte_row_pitch(monkeypatch):
    from cute_mxfp8.ops import gemm_sm90 as G

    assert G._wgrad_store(torch.bfloat16, 2048) == {"tma_store": True}
    assert G._wgrad_store(torch.bfloat16, 132) == {} and G._wgrad_store(torch.float32, 2048) == {}
    monkeypatch.setattr(G, "WGRAD_TMA_STORE", False)
    assert G._wgrad_store(torch.bfloat16, 2048) == {}


def test_ops_mm_picks_the_tma_store_build_for_a_bf16_output_with_a_16_byte_row_pitch():
    from cute_mxfp8.ops.gemm_sm90 import _tma_store

    assert _tma_store(True, torch.bfloat16, 200) == {"tma_store": True}
    assert _tma_store(False, torch.bfloat16, 200) == {}  # 1x128 B scales: the split-N build
    assert _tma_store(True, torch.bfloat16, 129) == {} and _tma_store(True, torch.float32, 200) == {}


@pytest.mark.parametrize("direction", ["rowwise", "colwise", "dual"])
def test_the_blocks_2d_casts_reduce_the_tile_once(direction):
    """The one-pass 128-block cast with the tile's amax: 5 butterfly shuffles (the warp's amax), one CTA barrier,
    the 4 warps' words read back (4 shared loads), no atomics, no local memory."""
    from cute_mxfp8.cli.sass_facts import find_nvdisasm
    from cute_mxfp8.jit import compile_quant

    if find_nvdisasm() is None:
        pytest.skip('nvdisasm not installed (pip install -e ".[sass]")')
    fn = compile_quant(direction, "bfloat16", "e4m3", "rceil", True, "sm_90a", True, False, True, 128, "cast",
                       False, True)
    res, count = _sass(fn)
    assert res["local_frame"] == 0 and count("LDL") == count("STL") == 0
    assert count("SHFL.BFLY") == 5 and count("BAR.SYNC") == 1 and count("LDS") == 4 and count("ATOM") == 0
    with pytest.raises(ValueError, match="blocks_2d"):
        compile_quant(direction, "bfloat16", "e4m3", "rceil", True, "sm_90a", True, True, False, 128, "cast",
                      False, True)


# ---- the kernels on the H200 -----------------------------------------------------------------------------------

def _special(x: torch.Tensor) -> torch.Tensor:
    """NaN, Inf, zero rows, saturation and subnormal-range values, in different 128 x 128 tiles."""
    if x.shape[-2] >= 200 and x.shape[-1] >= 160:
        x[..., 0, 3] = float("nan")
        x[..., 140, 150] = float("inf")
        x[..., 2, :] = 0.0
        x[..., 3, :32] = 448.0 * 2.0 ** 20
        x[..., 4, :] = 1e-30
        x[..., 150:, :] *= 1e-6  # a tile far below its neighbours
    return x


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("shape", [(32, 32), (127, 96), (300, 416), (256, 4096), (2, 224, 160), (3, 160, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_2d_cast_kernels_bit_exact(shape, dtype, rng):
    x = _special(torch.randn(*shape, generator=rng) * torch.logspace(-8, 8, shape[-1])).to(dtype)
    for mode, elem in (("rceil", E4M3), ("floor", E5M2)):  # (the other pairs build the same scale code)
        for op in (ops.quantize_rowwise, ops.quantize_colwise, ops.quantize_dual):
            for blocked in (False, True):
                kw = dict(scale_mode=mode, elem_dtype=elem, blocked=blocked, scale_block=128, blocks_2d=True)
                want = op(x, backend="reference", **kw)
                for _ in range(2):  # the full path, then the eager launch plan it left
                    _equal(op(x.cuda(), backend="sm90", **kw), want)
    if len(shape) == 2 and shape[0] % 128 == 0:
        w1, w3 = x, x.flip(-1).contiguous()
        for tile in (0, 128):
            kw = dict(scale_block=128, blocks_2d=True, gate_up_tile=tile)
            _equal(ops.quantize_gate_up(w1.cuda(), w3.cuda(), backend="sm90", **kw),
                   ops.quantize_gate_up(w1, w3, backend="reference", **kw))


def _integer_weight(shape, rng):
    """Small integers times a power of two per 128 x 128 tile: what a 128 x 128 cast stores exactly."""
    *lead, n, k = shape
    ints = torch.randint(-4, 5, shape, generator=rng).float()
    exps = torch.randint(-1, 2, (*lead, -(-n // 128), -(-k // 128)), generator=rng).float()
    return ints * 2.0 ** exps.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,n,k", [(300, 200, 416), (257, 129, 1024), (1024, 768, 2048), (128, 576, 256)])
def test_b_blocks_2d_mm_is_bit_exact_on_integer_data(m, n, k, rng):
    """Every 192-column tile's two 128-blocks (a warpgroup's columns split at 32, 64 or 96), N not a multiple of
    the tile: the kernel's result equals the reference's bit for bit."""
    a, a_s = ops.quantize_rowwise(_integer_act((m, k), rng), scale_block=128)
    b, b_s = ops.quantize_rowwise(_integer_weight((n, k), rng), scale_block=128, blocks_2d=True)
    for out in (torch.bfloat16, torch.float32):
        got = ops.mm(a.cuda(), a_s.cuda(), b.cuda(), b_s.cuda(), out_dtype=out, backend="sm90", scale_block=128,
                     b_blocks_2d=True)
        assert torch.equal(got.cpu(), ops.mm(a, a_s, b, b_s, out_dtype=out, scale_block=128, b_blocks_2d=True))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("split", ["n", "m"])
def test_both_consumer_splits_are_bit_exact_on_integer_data(split, rng):
    """The kernel build the ops do not run (split N) and the one they do (split M), called directly."""
    from cute_mxfp8.jit import compile_gemm_sm90

    m, n, k = 300, 328, 640
    a, a_s = ops.quantize_rowwise(_integer_act((m, k), rng), scale_block=128)
    b, b_s = ops.quantize_rowwise(_integer_weight((n, k), rng), scale_block=128, blocks_2d=True)
    fn = compile_gemm_sm90("e4m3", "e4m3", "float32", "promote", block_k=128, n_tile=192, b_block_n=128,
                           consumer_split=split)
    got = torch.empty(m, n, device="cuda")
    fn(a.cuda(), b.cuda(), _u8(a_s).cuda(), _u8(b_s).cuda(), got)
    want = ops.mm(a, a_s, b, b_s, out_dtype=torch.float32, scale_block=128, b_blocks_2d=True)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m,n,k", [(1, 8, 128), (300, 1000, 2048), (128, 192, 128), (1000, 136, 4128),
                                   (257, 8, 416), (4096, 4104, 1024)])
@pytest.mark.parametrize("build", [{}, {"n_tile": 128}, {"pingpong": False}], ids=["ops", "n_tile 128", "no pingpong"])
def test_the_tma_store_build_writes_what_the_direct_one_does_and_nothing_else(m, n, k, build, rng):
    """Random data (not exact in bf16): the TMA-stored tile equals the per-thread stores bit for bit; TMA clips
    the tiles at M and N (a guard after D keeps its values, no NaN fill is left).  The ops' build, and the two
    other builds the kernel takes (4 sub-tiles per tile; both warpgroups' WGMMAs at once)."""
    from cute_mxfp8.jit import compile_gemm_sm90

    kw = {**dict(block_k=128, n_tile=192, b_block_n=128, consumer_split="m"), **build}
    a, a_s = ops.quantize_rowwise(torch.randn(m, k, generator=rng).cuda(), scale_block=128)
    b, b_s = ops.quantize_rowwise(torch.randn(n, k, generator=rng).cuda(), scale_block=128, blocks_2d=True)
    want = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", **kw)(a, b, _u8(a_s), _u8(b_s), want)
    buf = torch.full((m * n + 4096,), 7.0, device="cuda", dtype=torch.bfloat16)
    got = buf[:m * n].view(m, n).fill_(float("nan"))
    compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", tma_store=True, **kw)(a, b, _u8(a_s), _u8(b_s), got)
    assert not want.isnan().any() and torch.equal(got, want) and bool((buf[m * n:] == 7).all())
    if not build:
        assert torch.equal(ops.mm(a, a_s, b, b_s, backend="sm90", scale_block=128, b_blocks_2d=True), want)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes", [[0, 1, 31, 129, 300], [257], [64, 0, 70], [128, 64, 192, 63, 65], [5000, 3, 1200]],
                         ids=str)
@pytest.mark.parametrize("tail", [0, 40, 200])
@pytest.mark.parametrize("n", [8, 200, 1000])
def test_the_grouped_tma_store_build_writes_what_the_direct_one_does_and_nothing_else(sizes, tail, n, rng):
    """2d-3d, random data: the TMA-stored build's D equals the per-thread stores' bit for bit, with groups that end
    inside a warpgroup's 64 rows (copied element-wise from the staged tile), on a 64-row boundary (a whole box),
    empty groups, rows past the last group (zeros, TMA-clipped at D's end) and a guard after D untouched."""
    from cute_mxfp8.jit import compile_gemm_sm90
    from cute_mxfp8.ops.gemm_common import schedule_m

    k, t = 384, sum(sizes) + tail
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    a, a_s = ops.quantize_rowwise(torch.randn(t, k, generator=rng).cuda(), offs=offs, scale_block=128)
    b, b_s = ops.quantize_rowwise(torch.randn(len(sizes), n, k, generator=rng).cuda(), scale_block=128,
                                  blocks_2d=True)
    kw = dict(block_k=128, n_tile=192, b_block_n=128, consumer_split="m", grouping="m")
    args = (a, b.view(-1, k), _u8(a_s), _u8(b_s).reshape(-1))
    sched = schedule_m(offs, t, 128)
    want = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", **kw)(*args, want, *sched)
    buf = torch.full((t * n + 4096,), 7.0, device="cuda", dtype=torch.bfloat16)
    got = buf[:t * n].view(t, n).fill_(float("nan"))
    compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", tma_store=True, **kw)(*args, got, *sched)
    assert not want.isnan().any() and bool((want[sum(sizes):] == 0).all())
    assert torch.equal(got, want), f"{(got != want).sum().item()} outputs differ"
    assert bool((buf[t * n:] == 7).all())
    assert torch.equal(ops.grouped_mm(a, a_s, b, b_s, offs, backend="sm90", scale_block=128, b_blocks_2d=True), want)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes", [[0, 1, 31, 129, 300], [257], [64, 0, 70]], ids=str)
@pytest.mark.parametrize("n,k", [(200, 416), (384, 256)])
def test_b_blocks_2d_grouped_mm_is_bit_exact_on_integer_data(sizes, n, k, rng):
    t = sum(sizes) + 40
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    a, a_s = ops.quantize_rowwise(_integer_act((t, k), rng), offs=offs, scale_block=128)
    b, b_s = ops.quantize_rowwise(_integer_weight((len(sizes), n, k), rng), scale_block=128, blocks_2d=True)
    for out in (torch.bfloat16, torch.float32):
        got = ops.grouped_mm(a.cuda(), a_s.cuda(), b.cuda(), b_s.cuda(), offs.cuda(), out_dtype=out,
                             backend="sm90", scale_block=128, b_blocks_2d=True).cpu()
        want = ops.grouped_mm(a, a_s, b, b_s, offs, out_dtype=out, scale_block=128, b_blocks_2d=True)
        assert torch.equal(got, want), f"{(got != want).sum().item()} outputs differ"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("grouped", [False, True])
def test_128x128_weight_mlp_on_sm90_matches_the_reference(grouped, rng):
    x, ws, dy = _mlp_inputs(grouped, 4, 256, 512, 1000, rng)
    offs = torch.tensor([100, 100, 600, 990], dtype=torch.int32) if grouped else None

    def run(device, backend):
        leaves = [t.to(device).to(torch.bfloat16).requires_grad_() for t in (x, *ws)]
        cfg = MXFP8Config(hopper_block_k=128, hopper_weight_blocks="128x128", backend=backend)
        y = ops.mxfp8_swiglu_mlp(*leaves, offs=None if offs is None else offs.to(device), config=cfg)
        y.backward(dy.to(device).to(torch.bfloat16))
        return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves]

    for got, want in zip(run("cuda", "sm90"), run("cpu", "reference")):
        assert _sqnr(want, got) > 35
