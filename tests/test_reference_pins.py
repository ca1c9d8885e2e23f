"""The reference backend pinned where a looser test let a wrong change through (mutation testing, 2026-12-05).

* SwiGLU math bit for bit: the kernels copy the reference's operation order (``cute_mxfp8.swiglu``), so its order is
  part of the contract, and bf16 ``h13`` is widened to fp32 before the math (no bf16 rounding of ``h``).
* Rows at or past ``offs[-1]`` are zero in every output of the SwiGLU casts (a NaN there reaches nothing).
* The reference checks the promises ``scale_block=128`` and ``b_blocks_2d`` make (runs of four equal scales from
  each group's start, B's scales equal along 128 rows), on inputs made to break exactly one of them.
* The kernels' host-side constants agree with ``formats`` (CPU: the kernels themselves run on the GPU only).

Fresh random inputs come from the ``rng`` fixture; every expected value is computed here from the definitions.
"""

from __future__ import annotations

import pytest
import torch

from cute_mxfp8 import formats as F
from cute_mxfp8 import ops


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_swiglu_of_bf16_h13_is_the_fp32_math_then_one_cast(rng):
    h13 = (torch.randn(64, 128, generator=rng) * 3).bfloat16()
    g, u = h13[:, :64].float(), h13[:, 64:].float()
    want_q, want_s = F.quantize_mxfp8(g * torch.sigmoid(g) * u)
    got_q, got_s, *_ = ops.swiglu_quant(h13, blocked=False)
    assert torch.equal(_u8(got_q), _u8(want_q)) and torch.equal(_u8(got_s), _u8(want_s))


def test_swiglu_math_keeps_the_reference_operation_order(rng):
    """``h = (g * sigmoid(g)) * u``, ``dg = (dh * u) * (s * (1 + g * (1 - s)))``, ``du = dh * (g * s)`` in fp32,
    equal bit for bit (another association of the same products differs in the last bit)."""
    h13 = torch.randn(256, 512, generator=rng) * 4
    dh = torch.randn(256, 256, generator=rng)
    g, u = h13[:, :256], h13[:, 256:]
    s = torch.sigmoid(g)
    assert torch.equal(ops.swiglu_quant(h13, blocked=False, emit_hp=True)[4], (g * s) * u)
    hp = ops.dswiglu_quant(dh, h13, blocked=False, emit_hp=True)[4]
    assert torch.equal(hp[:, :256], (dh * u) * (s * (1.0 + g * (1.0 - s))))
    assert torch.equal(hp[:, 256:], dh * (g * s))


@pytest.mark.parametrize("scale_block", [32, 128])
def test_swiglu_casts_zero_every_output_row_past_the_groups(scale_block, rng):
    h13 = torch.randn(64, 256, generator=rng)
    h13[40:] = float("nan")  # rows past offs[-1] = 40: no group's; nothing of them may leak
    dh = torch.randn(64, 128, generator=rng)
    offs = torch.tensor([20, 40], dtype=torch.int32)
    for outs in (ops.swiglu_quant(h13, blocked=False, offs=offs, emit_hp=True, scale_block=scale_block),
                 ops.dswiglu_quant(dh, h13, blocked=False, offs=offs, emit_hp=True, scale_block=scale_block)):
        row_q, _, col_q, _, hp = outs
        assert not _u8(row_q[40:]).any() and not hp[40:].any()  # exact zeros (no NaN, no -0)
        assert col_q.shape[-1] == 64 and not _u8(col_q[:, 40:]).any()  # colwise: (I, M), tokens along columns
        assert torch.isfinite(hp[:40]).all()


def _blocked(t: torch.Tensor, **kw):
    q, s = F.quantize_mxfp8(t, **kw)
    return q, F.to_blocked_scales(s)


def test_b_blocks_2d_promise_is_checked_on_128_rows():
    """B's scales equal along each 32-row block but not along 128 rows: ``b_blocks_2d=True`` is a false promise."""
    b = torch.ones(128, 128)
    b[32:] = 4.0
    bq, bs = _blocked(b, scale_block=128)
    aq, as_ = _blocked(torch.ones(32, 128), scale_block=128)
    ops.mm(aq, as_, bq, bs, scale_block=128)  # the 1x128 promise holds
    with pytest.raises(ValueError):
        ops.mm(aq, as_, bq, bs, scale_block=128, b_blocks_2d=True)


def test_scale_block_128_promise_is_checked_on_runs_of_four():
    """Scales 1, 1, 4, 4 along one 128-deep run: equal in pairs, not in fours."""
    a = torch.ones(32, 128)
    a[:, 64:] = 4.0
    aq, as_ = _blocked(a, scale_block=32)
    with pytest.raises(ValueError):
        ops.mm(aq, as_, aq, as_, scale_block=128)


def test_wgrad_scale_block_128_promise_covers_a_groups_last_partial_block():
    """A group of 40 tokens: its blocks [0, 32) and [32, 40) share one 128-run, and their scales differ."""
    x = torch.ones(64, 32)
    x[32:40] = 64.0
    offs = torch.tensor([40], dtype=torch.int32)
    q, s = ops.quantize_colwise(x, offs=offs, scale_block=32)
    with pytest.raises(ValueError):
        ops.grouped_mm_wgrad(q, s, q, s, offs, scale_block=128)


def test_kernel_constants_agree_with_formats():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")
    from cute_mxfp8.kernels import mx_math as X

    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        assert X.ELEM_DTYPES[name][1] == F.ELEM_DTYPES[dtype][1], name  # the largest exponent (emax)
    assert X.MXCastParams("e4m3", "rceil").rceil is True and X.MXCastParams("e4m3", "floor").rceil is False
