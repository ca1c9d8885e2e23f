"""CuTe DSL rowwise / colwise quantization kernels: compiled for sm_90a and sm_100a on the CPU (every variant, PTX checked),
and bit-exact against the reference on a GPU (``-m gpu``, SM90)."""

from __future__ import annotations

import itertools
import re
import struct

import pytest
import torch

from cute_mxfp8 import ops
from cute_mxfp8.ops.backends import BackendUnavailableError, resolve_backend

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")

VARIANTS = list(itertools.product(["bfloat16", "float32"], ["e4m3", "e5m2"], ["floor", "rceil"], [False, True]))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("direction", ["rowwise", "colwise", "dual"])
@pytest.mark.parametrize("in_dtype,elem,mode,blocked", VARIANTS)
def test_quant_kernels_compile_for_arch(arch, direction, in_dtype, elem, mode, blocked):
    from cute_mxfp8.jit import compile_quant

    ptx = compile_quant(direction, in_dtype, elem, mode, blocked, arch, keep_ptx=True).__ptx__
    assert re.search(rf"\.target\s+{arch}\b", ptx)
    assert f"cvt.rn.satfinite.{elem}x2.f32" in ptx  # hardware RNE + saturating fp8 conversion
    if direction != "colwise":
        assert re.search(r"ld\.global(\.nc)?\.(v4\.[bfu]32|v2\.[bfu]64)", ptx)  # 16-byte vector loads
    assert re.search(r"st\.global\.v[24]\.[bu](32|64)", ptx)  # vector stores of the fp8 data
    assert ".local" not in ptx  # no local-memory arrays
    if direction == "dual":  # one read: the colwise half comes from the shared-memory tile
        assert "bar.sync" in ptx and "ld.shared" in ptx


gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                         reason="needs an SM90 GPU (run on the H200 with -m gpu)")


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _special_rows(k: int) -> torch.Tensor:
    """Rows of design.md / cases section A, each repeated across the row's blocks."""
    rows = [[0.0] * 32, [2.0 ** -126] * 32, [float("inf")] + [1.0] * 31, [float("nan")] * 32, [448.0] * 32,
            [480.0] * 32, [2.0 ** -149] + [1.0] * 31, [-2.0 ** -149] + [1.0] * 31, [_f32(0x40600001)] * 32,
            [_f32(0x43FFFFFF)] * 32, [500.0] + [1.0] * 31, [-0.0] * 32, [-float("inf")] + [0.0] * 31,
            [3.0e38] * 32, [-1e-40] * 16 + [1e-3] * 16]
    return torch.tensor([r * (k // 32) for r in rows], dtype=torch.float32)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(1, 32), (127, 96), (129, 160), (0, 64), (4096, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quant_kernels_bit_exact(shape, dtype, mode, elem, rng):
    x = torch.randn(*shape, generator=rng) * torch.logspace(-20, 20, shape[1])
    if shape[0] >= 20:
        x[:15] = _special_rows(shape[1])
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
    with pytest.raises(BackendUnavailableError, match="contiguous"):
        ops.quantize_rowwise(x, backend="sm90")
    ref = ops.quantize_rowwise(x.cpu())
    got = ops.quantize_rowwise(x)
    assert all(torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8)) for g, r in zip(got, ref))


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


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("in_dtype,elem,mode", list(itertools.product(["bfloat16", "float32"], ["e4m3", "e5m2"],
                                                                         ["floor", "rceil"])))
def test_grouped_rowwise_kernel_compiles_for_arch(arch, in_dtype, elem, mode):
    from cute_mxfp8.jit import compile_grouped_rowwise_quant

    ptx = compile_grouped_rowwise_quant(in_dtype, elem, mode, arch, keep_ptx=True).__ptx__
    assert re.search(rf"\.target\s+{arch}\b", ptx) and f"cvt.rn.satfinite.{elem}x2.f32" in ptx
    assert ".local" not in ptx


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
