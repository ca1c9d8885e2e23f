"""The SM100 tcgen05 block-scaled GEMM (``kernels/gemm_sm100.py``).  No SM100 GPU exists here, so CI compiles
every variant for ``sm_100a`` on the CPU and checks the PTX and SASS that prove the design (block-scaled MMA,
scale copies into TMEM, TMA loads and stores, no spills).  The ``sm100`` test runs it where the hardware is."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")

from cute_mxfp8.cli import sass_facts  # noqa: E402

VARIANTS = list(itertools.product([("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")], [128, 256],
                                  ["bfloat16", "float32"]))
needs_sass = pytest.mark.skipif(sass_facts.find_nvdisasm() is None, reason="nvdisasm not installed (test extra)")


@needs_sass
@pytest.mark.parametrize("elems,n_tile,out", VARIANTS)
def test_gemm_compiles_for_sm100_with_tcgen05(elems, n_tile, out):
    from cute_mxfp8.jit import compile_gemm_sm100

    fn = compile_gemm_sm100(*elems, out, n_tile, "sm_100a", True)
    ptx = fn.__ptx__
    assert re.search(r"\.target\s+sm_100a\b", ptx)
    assert "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32" in ptx  # MX: E8M0 per 32 along K
    assert "tcgen05.cp.cta_group::1.32x128b.warpx4" in ptx  # scales shared memory -> TMEM
    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    assert res["local_frame"] == 0 and fn.launch_smem[0] <= 232448  # B200: 227 KB of shared memory per CTA
    ops = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__))

    def count(prefix):
        return sum(v for k, v in ops.items() if k.startswith(prefix))

    assert count("UTCQMMA") == 4  # one block-scaled MMA per K = 32 of the 128-deep stage, unrolled
    assert count("UTCCP") >= 2 and count("UTMALDG") >= 4 and count("UTMASTG") >= 1  # SFA+SFB; A, B, SFA, SFB; D
    assert count("LDL") == count("STL") == 0


def test_can_implement_names_the_constraint():
    from cute_mxfp8.kernels.gemm_sm100 import MXGemmSm100

    assert MXGemmSm100.can_implement(300, 136, 96) is None
    assert "multiple of 32" in MXGemmSm100.can_implement(128, 128, 48)
    assert "16-byte" in MXGemmSm100.can_implement(128, 100, 64)
    assert "positive" in MXGemmSm100.can_implement(0, 128, 64)
    with pytest.raises(ValueError, match="n_tile"):
        MXGemmSm100("e4m3", "e4m3", n_tile=64)


@pytest.mark.sm100
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10),
                    reason="needs an SM100 (B200/GB200) GPU; none is available to this project yet")
@pytest.mark.parametrize("m,n,k", [(256, 256, 256), (300, 136, 96), (1024, 2048, 4096)])
@pytest.mark.parametrize("n_tile,out", [(128, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32)])
def test_gemm_matches_reference_on_sm100(m, n, k, n_tile, out, rng):
    """Against the fp32 emulation of the same quantized operands: fp32 accumulation in another order, then
    rounding to the output dtype, so within one bf16 ulp (also allowed for fp32 out) plus K fp32 ulps of
    sum |a b|."""
    from cute_mxfp8 import formats as F
    from cute_mxfp8 import ops
    from cute_mxfp8.jit import compile_gemm_sm100

    a = torch.randn(m, k, generator=rng).cuda()
    b = torch.randn(n, k, generator=rng).cuda()
    qa, sa = ops.quantize_rowwise(a)
    qb, sb = ops.quantize_rowwise(b)
    d = torch.empty(m, n, dtype=out, device="cuda")
    name = "bfloat16" if out == torch.bfloat16 else "float32"
    compile_gemm_sm100("e4m3", "e4m3", name, n_tile)(qa, qb, sa.view(torch.uint8), sb.view(torch.uint8), d)
    da = F.dequantize_mxfp8(qa, F.from_blocked_scales(sa, m, k // 32))
    db = F.dequantize_mxfp8(qb, F.from_blocked_scales(sb, n, k // 32))
    ref = da @ db.t()
    bound = 2.0 ** -8 * ref.abs() + k * 2.0 ** -23 * (da.abs() @ db.abs().t())
    assert bool(((d.float() - ref).abs() <= bound).all())
