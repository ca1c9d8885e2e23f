"""CuTe DSL rowwise / colwise quantization kernels: compiled on the CPU with PTX checked (every sm_100f variant, a
pairwise cover of the sm_90a ones), and bit-exact against the reference on a GPU (``-m gpu``, SM90)."""

from __future__ import annotations

import itertools
import re
import struct

import pytest
import torch

from cute_mxfp8 import ops
from cute_mxfp8.ops.backends import BackendUnavailableError, resolve_backend

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")

# (in_dtype, elem, mode, blocked): the values of each compile argument, and every combination of them
AXES = {"in_dtype": ["bfloat16", "float32"], "elem": ["e4m3", "e5m2"], "mode": ["floor", "rceil"],
        "blocked": [False, True]}
VARIANTS = list(itertools.product(*AXES.values()))
# (direction, grouped, batched): every kernel build of compile_quant
BUILDS = [("rowwise", False, False), ("rowwise", True, False), ("rowwise", False, True), ("colwise", False, False),
          ("colwise", True, False), ("dual", False, False), ("dual", True, False)]


def _pairwise_sm90() -> list[tuple]:
    """The sm_90a cases: a subset of BUILDS x VARIANTS holding every pair of argument values (the greedy cover of
    ``inspect --pairwise``).  Every sm_90a build also runs on the H200 (``-m gpu``), so CI compiles these; SM100,
    which no test can run, compiles the full product."""
    from cute_mxfp8.cli.inspect_kernels import Family

    return [("sm_90a", *v["build"], *(v[k] for k in AXES))
            for v in Family("quantize", None, {"build": BUILDS, **AXES}).pairwise_variants()]


CASES = [("sm_100f", *b, *v) for b in BUILDS for v in VARIANTS] + _pairwise_sm90()


@pytest.mark.parametrize("arch,direction,grouped,batched,in_dtype,elem,mode,blocked", CASES)
def test_quant_kernels_compile_for_arch(arch, direction, grouped, batched, in_dtype, elem, mode, blocked):
    from cute_mxfp8.cli import sass_facts
    from cute_mxfp8.jit import compile_quant

    if direction == "rowwise" and grouped and not blocked:
        with pytest.raises(ValueError, match="only defined blocked"):
            compile_quant(direction, in_dtype, elem, mode, blocked, arch, True, grouped, batched)
        return
    fn = compile_quant(direction, in_dtype, elem, mode, blocked, arch, True, grouped, batched)
    ptx = fn.__ptx__
    assert re.search(rf"\.target\s+{arch}\b", ptx)
    assert f"cvt.rn.satfinite.{elem}x2.f32" in ptx  # hardware RNE + saturating fp8 conversion
    assert ".local" not in ptx and "bar.sync" not in ptx  # no local-memory arrays, no shared-memory staging
    if sass_facts.find_nvdisasm() is not None:  # no register spills either (the test extra installs nvdisasm)
        counts = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))
        spills = {op: n for op, n in counts.items() if op.split(".")[0] in ("LDL", "STL")}
        assert not spills, f"ptxas spilled to local memory: {spills}"
    tile = direction != "rowwise" or batched
    if not tile:  # one thread per block: 16-byte loads
        assert re.search(r"ld\.global(\.nc)?\.(v4\.[bfu]32|v2\.[bfu]64)", ptx)
        return
    # tile kernel: 8 vector loads of 4 elements per lane (8 bytes of bf16, 16 of fp32)
    vec = r"v4\.[bu]16|v2\.[bfu]32" if in_dtype == "bfloat16" else r"v4\.[bfu]32"
    assert len(re.findall(rf"ld\.global(?:\.nc)?\.(?:{vec})", ptx)) >= 8
    shuffles = len(re.findall(r"shfl\.sync", ptx))
    # reduce-scatter + broadcast: rowwise 7 + 8 shuffles per lane, colwise 3 + 4; the packed stores (the default,
    # jit.compile_quant's packed_stores) have two copies of the rowwise stores with their 8 factor broadcasts, one
    # for full 32-row blocks without row checks, one checked; with groups, the tail CTAs' unrolled blocks past
    # offs[-1] add a rowwise cast each (their colwise data is a zero store)
    from cute_mxfp8.kernels.quantize_tile import BLOCK, TAIL_ROWS

    rowwise = 7 + 8 + 8
    tail = TAIL_ROWS // BLOCK * rowwise if grouped and direction != "colwise" else 0
    assert shuffles == {"rowwise": rowwise, "colwise": 7, "dual": 7 + rowwise}[direction] + tail
    if direction != "rowwise" and not grouped:  # 8-byte stores of the transposed colwise data
        assert re.search(r"st\.global\.(v2\.[bu]32|[bu]64)", ptx)


gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                         reason="needs an SM90 GPU (run on the H200 with -m gpu)")


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _special_rows(k: int) -> torch.Tensor:
    """Rows of the MX special-value case table (zeros, NaN / Inf, saturation, subnormals), each repeated across the
    row's blocks."""
    rows = [[0.0] * 32, [2.0 ** -126] * 32, [float("inf")] + [1.0] * 31, [float("nan")] * 32, [448.0] * 32,
            [480.0] * 32, [2.0 ** -149] + [1.0] * 31, [-2.0 ** -149] + [1.0] * 31, [_f32(0x40600001)] * 32,
            [_f32(0x43FFFFFF)] * 32, [500.0] + [1.0] * 31, [-0.0] * 32, [-float("inf")] + [0.0] * 31,
            [3.0e38] * 32, [-1e-40] * 16 + [1e-3] * 16, [57344.0] * 32, [-896.0] + [1.0] * 31]
    # (448, 896, 57344: amax mantissa exactly 0x600000, the rceil rounding threshold for e4m3 and e5m2)
    return torch.tensor([r * (k // 32) for r in rows], dtype=torch.float32)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(1, 32), (127, 96), (129, 160), (0, 64), (33, 4096), (16384, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quant_kernels_bit_exact(shape, dtype, mode, elem, rng):
    x = torch.randn(*shape, generator=rng) * torch.logspace(-20, 20, shape[1])
    special = _special_rows(shape[1])
    if shape[0] >= 20:
        x[:len(special)] = special
    x = x.to(dtype).cuda()
    assert resolve_backend(x.device, op="quantize_rowwise", args=(x, mode, elem, True, None)) == "sm90"
    for op in (ops.quantize_rowwise, ops.quantize_colwise, ops.quantize_dual):
        for blocked in (False, True):
            got = op(x, scale_mode=mode, elem_dtype=elem, blocked=blocked, backend="sm90")
            ref = op(x.cpu(), scale_mode=mode, elem_dtype=elem, blocked=blocked, backend="reference")
            for g, r in zip(got, ref):
                assert g.shape == r.shape and g.dtype == r.dtype
                assert torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))


@pytest.mark.gpu
@gpu
def test_rowwise_kernel_limits_route_to_reference():
    x = torch.randn(64, 128, device="cuda").t()  # not row-major
    assert resolve_backend(x.device, op="quantize_rowwise", args=(x, "rceil", torch.float8_e4m3fn, True, None)) \
        == "reference"
    ref = ops.quantize_rowwise(x.cpu())
    # the op copies a strided input to a contiguous one before dispatch, so the kernel takes it too
    for got in (ops.quantize_rowwise(x), ops.quantize_rowwise(x, backend="sm90")):
        assert all(torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8)) for g, r in zip(got, ref))
    buf = torch.randn(64 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    misaligned = buf[1:].view(64, 128)  # contiguous but 2 bytes past a 16-byte boundary: the kernels' vector loads refuse it
    with pytest.raises(BackendUnavailableError, match="16-byte aligned"):
        ops.quantize_rowwise(misaligned, backend="sm90")
    ref = ops.quantize_rowwise(misaligned.cpu())
    assert all(torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))
               for g, r in zip(ops.quantize_rowwise(misaligned), ref))


@pytest.mark.gpu
@gpu
def test_kernels_run_on_the_current_torch_stream():
    """The input is produced on a side stream behind a long sleep; a kernel launched on any other stream would
    read it before it is written."""
    src = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ref = [t.view(torch.uint8).cpu() for t in ops.quantize_dual(src.cpu())]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros_like(src)
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        got = ops.quantize_dual(x)
    side.synchronize()
    assert all(torch.equal(g.view(torch.uint8).cpu(), r) for g, r in zip(got, ref))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("sizes", [[5, 0, 37, 128], [0, 0], [300], [129, 1, 0, 255, 64] * 3])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_grouped_rowwise_kernel_bit_exact(sizes, mode, rng):
    m = sum(sizes) + 30  # rows past offs[-1] exist and get no scales
    x = (torch.randn(m, 160, generator=rng) * 100).to(torch.bfloat16).cuda()
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    got = ops.quantize_rowwise(x, scale_mode=mode, offs=offs.cuda(), backend="sm90")
    ref = ops.quantize_rowwise(x.cpu(), scale_mode=mode, offs=offs, backend="reference")
    for g, r in zip(got, ref):
        assert g.shape == r.shape and torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.quantize_rowwise(x, offs=torch.tensor([5, 2], dtype=torch.int32, device="cuda"), backend="sm90")


def _cols_special(x: torch.Tensor) -> torch.Tensor:
    """Put the special rows of cases section A into columns too, so colwise blocks see every special value."""
    special = _special_rows(32)
    n = min(x.shape[1], len(special))
    if x.shape[0] >= 32 and n:
        x[:32, :n] = special[:n].t()
    return x


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(192, 96), (2, 128, 256), (1, 64, 32), (3, 256, 96), (384, 64)])
@pytest.mark.parametrize("tile", [0, 64])
def test_gate_up_kernel_path_bit_exact(shape, tile, rng):
    """quantize_gate_up on the kernel backend (one dual cast of the packed W13) equals the reference (each
    projection cast on its own, the casts packed), both layouts; with 128-blocks where I allows them."""
    w1, w3 = ((torch.randn(*shape, generator=rng) * torch.logspace(-8, 8, shape[-1])).to(torch.bfloat16)
              for _ in range(2))
    if shape[-2] % 128 == 0 and tile == 64:
        tile, sb = 128, 128
    else:
        sb = 128 if shape[-2] % 128 == 0 else 32
    for blocked in (False, True):
        kw = dict(scale_mode="rceil", blocked=blocked, gate_up_tile=tile, scale_block=sb)
        got = ops.quantize_gate_up(w1.cuda(), w3.cuda(), backend="sm90", **kw)
        ref = ops.quantize_gate_up(w1, w3, backend="reference", **kw)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))
        for direction, pair in (("rowwise", ref[:2]), ("colwise", ref[2:])):  # one pair (the MLP's two calls)
            got = ops.quantize_gate_up(w1.cuda(), w3.cuda(), backend="sm90", direction=direction, **kw)
            assert len(got) == 2
            for g, r in zip(got, pair):
                assert g.shape == r.shape and torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(2, 64, 96), (3, 160, 128), (8, 256, 2048), (1, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_expert_weight_kernels_bit_exact(shape, dtype, mode, rng):
    """3-D (E, N, K) weights: rowwise along K and colwise along N, blocked scales per expert."""
    x = torch.randn(*shape, generator=rng) * torch.logspace(-10, 10, shape[2])
    x[0] = _cols_special(x[0])
    x = x.to(dtype).cuda()
    for op in (ops.quantize_rowwise, ops.quantize_colwise, ops.quantize_dual):
        for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
            for blocked in (False, True):
                got = op(x, scale_mode=mode, elem_dtype=elem, blocked=blocked, backend="sm90")
                ref = op(x.cpu(), scale_mode=mode, elem_dtype=elem, blocked=blocked, backend="reference")
                for g, r in zip(got, ref):
                    assert g.shape == r.shape and torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("sizes", [[5, 0, 37, 128], [0, 0], [300], [129, 1, 0, 255, 64] * 3, [], [32, 64, 1]])
@pytest.mark.parametrize("tail", [0, 30, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_k_kernels_bit_exact(sizes, tail, dtype, rng):
    """2d-2d wgrad operands: colwise blocks restart at every group start and never cross a group end; rows past
    offs[-1] belong to no group (zero colwise data, rowwise data as usual)."""
    m = sum(sizes) + tail
    x = _cols_special(torch.randn(m, 160, generator=rng) * 100).to(dtype).cuda()
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    for op in (ops.quantize_colwise, ops.quantize_dual):
        for mode in ("floor", "rceil"):
            for blocked in (False, True):
                got = op(x, scale_mode=mode, offs=offs.cuda(), blocked=blocked, backend="sm90")
                ref = op(x.cpu(), scale_mode=mode, offs=offs, blocked=blocked, backend="reference")
                for g, r in zip(got, ref):
                    assert g.shape == r.shape and torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))


@pytest.mark.gpu
@gpu
def test_grouped_kernels_at_the_group_limit():
    """65536 groups of one row: the device binary searches must resolve every group (16 steps would not)."""
    from cute_mxfp8.ops.gemm_common import MAX_GROUPS

    m = MAX_GROUPS
    x = torch.randn(m, 32).to(torch.bfloat16).cuda()
    offs = torch.arange(1, m + 1, dtype=torch.int32)
    for op in (ops.quantize_rowwise, ops.quantize_dual):
        got = op(x, offs=offs.cuda(), backend="sm90")
        ref = op(x.cpu(), offs=offs, backend="reference")
        for g, r in zip(got, ref):
            assert g.shape == r.shape and torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8))
