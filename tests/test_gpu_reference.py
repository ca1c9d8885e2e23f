"""The reference backend on a CUDA device gives the same bytes as on the CPU (run with ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from cute_mxfp8 import formats as F
from cute_mxfp8 import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")]


def _u8(t):
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(1, 32), (127, 96), (129, 160), (2048, 7168)])
def test_quantize_cuda_equals_cpu(mode, elem, shape, rng):
    x = torch.randn(*shape, generator=rng) * torch.logspace(-30, 30, shape[1])  # wide dynamic range
    x[0, :3] = torch.tensor([float("nan"), 2.0 ** -149, -0.0])
    if shape[0] > 1:
        x[1, :32] = 2.0 ** -126  # subnormal-scale block
    for dtype in (torch.float32, torch.bfloat16):
        xc = x.to(dtype)
        cpu = ops.quantize_dual(xc, scale_mode=mode, elem_dtype=elem)
        gpu = ops.quantize_dual(xc.cuda(), scale_mode=mode, elem_dtype=elem)
        for c, g in zip(cpu, gpu):
            assert g.is_cuda and torch.equal(_u8(g), _u8(c))


def test_decode_and_grouped_on_cuda(rng):
    s = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8, device="cuda")
    d = F.e8m0_to_float(s).cpu()
    assert d[0].view(torch.int32) == 0x00400000 and d[2] == 1.0 and torch.isnan(d[4])
    offs = torch.tensor([5, 5, 42, 170], dtype=torch.int32)
    x = torch.randn(200, 96, generator=rng)
    for fn in (ops.quantize_rowwise, ops.quantize_colwise):
        c = fn(x, offs=offs)
        g = fn(x.cuda(), offs=offs.cuda())
        assert all(torch.equal(_u8(a), _u8(b)) for a, b in zip(c, g))


def test_autograd_mlp_on_cuda_matches_cpu(rng):
    from cute_mxfp8.ops import mxfp8_swiglu_mlp

    x = torch.randn(300, 256, generator=rng)
    ws = [torch.randn(512, 256, generator=rng) / 16, torch.randn(256, 512, generator=rng) / 22,
          torch.randn(512, 256, generator=rng) / 16]
    outs = {}
    for dev in ("cpu", "cuda"):
        leaves = [t.detach().to(dev).requires_grad_() for t in (x, *ws)]
        y = mxfp8_swiglu_mlp(*leaves)
        y.backward(torch.ones_like(y))
        outs[dev] = [y.detach().cpu()] + [t.grad.cpu() for t in leaves]
    for c, g in zip(outs["cpu"], outs["cuda"]):
        # Same math; fp32 summation order differs between devices, which can flip an fp8 rounding of h or dh13
        # here and there (one fp8 step = 1/16 relative), so compare by SQNR, far above quantization noise (~23 dB).
        sqnr = 10 * torch.log10(c.pow(2).sum() / (c - g).pow(2).sum().clamp_min(1e-30))
        assert sqnr > 35
