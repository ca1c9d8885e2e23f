"""Baselines the SM90 GEMM is measured against in ``bench gemm`` (issue 12): the same product, or the nearest one
another library runs on Hopper, timed in the same run.

* ``cuBLAS bf16 mm``: the bar (bf16 operands of the same shape).
* ``cuBLAS fp8 rowwise _scaled_mm``: fp8 with one fp32 scale per row of A and per column of B.
* ``cuBLAS fp8 blockwise _scaled_mm``: the DeepSeek recipe, fp32 scales per 1 x 128 of A and 128 x 128 of B.
* ``Triton tl.dot_scaled MXFP8``: Triton's block-scaled dot (emulated on SM90), best of four tile configs.
* ``sm90 promote mainloop``: our other SM90 design (fp8 WGMMA per MX block, scales promoted on the CUDA cores).
* ``sm90 fast mode (1x128 shared scales)``: the same kernel promoting once per 128 of K (issue 16's Hopper mode).

Each builder returns ``{name: callable}`` with only the baselines that run here; ``skipped`` collects the reason
of each one that does not (torch or triton too old, no triton)."""

from __future__ import annotations

from typing import Callable

import torch


def sm90_dense_baselines(a, a_s, b, b_s, skipped: dict[str, str]) -> dict[str, Callable[[], object]]:
    """Baselines for ``mm`` on the MXFP8 operands ``a`` (M, K), ``b`` (N, K) with blocked scales ``a_s``, ``b_s``."""
    (m, k), n, dev = a.shape, b.shape[0], a.device
    out: dict[str, Callable[[], object]] = {}
    xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    out["cuBLAS bf16 mm"] = lambda: torch.mm(xb, wb.t())
    bt = b.t()  # (K, N) column-major, as _scaled_mm wants its second operand
    row_a, row_b = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
    _try(out, skipped, "cuBLAS fp8 rowwise _scaled_mm",
         lambda: torch._scaled_mm(a, bt, scale_a=row_a, scale_b=row_b, out_dtype=torch.bfloat16))
    kb = (k + 127) // 128
    blk_a = torch.ones(kb, m, device=dev).t()  # (M, K/128), M-major
    blk_b = torch.ones((n + 127) // 128, kb, device=dev).t()  # (K/128, N/128)
    _try(out, skipped, "cuBLAS fp8 blockwise _scaled_mm",
         lambda: torch._scaled_mm(a, bt, scale_a=blk_a, scale_b=blk_b, out_dtype=torch.bfloat16))
    try:
        out["Triton tl.dot_scaled MXFP8"] = _triton_dot_scaled(a, a_s, b, b_s)
    except Exception as e:  # noqa: BLE001 - any failure only drops this baseline, with its reason
        skipped["Triton tl.dot_scaled MXFP8"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    from cute_mxfp8.jit import compile_gemm_sm90

    elem = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    promote = compile_gemm_sm90(elem[a.dtype], elem[b.dtype], "bfloat16", "promote")
    d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    out["sm90 promote mainloop"] = lambda: promote(a, b, a_s.view(torch.uint8), b_s.view(torch.uint8), d)
    # the Hopper fast mode's GEMM (issue 16) as the op runs it: one promotion per 128 of K, reading the first scale
    # of each 128-block (the operands here are plain MXFP8, so only its speed is meaningful)
    from cute_mxfp8 import ops

    out["sm90 fast mode (1x128 shared scales)"] = lambda: ops.mm(a, a_s, b, b_s, backend="sm90", scale_block=128)
    return out


def _try(out: dict, skipped: dict, name: str, fn: Callable[[], object]) -> None:
    try:
        fn()
        out[name] = fn
    except Exception as e:  # noqa: BLE001 - a baseline this torch / GPU cannot run is reported, not fatal
        skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _triton_dot_scaled(a, a_s, b, b_s) -> Callable[[], object]:
    """A Triton MXFP8 GEMM with ``tl.dot_scaled`` (plain row-major E8M0 scales), the fastest of four tile configs
    on these operands."""
    import triton
    import triton.language as tl
    from triton.testing import do_bench

    from cute_mxfp8 import formats as F

    @triton.jit
    def kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rs = tl.arange(0, BK // 32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
            w = tl.load(b_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=(rn < N)[:, None], other=0.0)
            sx = tl.load(as_ptr + rm[:, None] * (K // 32) + (k0 // 32 + rs)[None, :], mask=(rm < M)[:, None], other=0)
            sw = tl.load(bs_ptr + rn[:, None] * (K // 32) + (k0 // 32 + rs)[None, :], mask=(rn < N)[:, None], other=0)
            acc = tl.dot_scaled(x, sx, "e4m3", tl.trans(w), sw, "e4m3", acc)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm < M)[:, None] & (rn < N)[None, :])

    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn or a.shape[1] % 128:
        raise ValueError("the Triton baseline takes e4m3 operands with K % 128 == 0")
    (m, k), n = a.shape, b.shape[0]
    sa = F.from_blocked_scales(a_s, m, k // 32).view(torch.uint8).contiguous()
    sb = F.from_blocked_scales(b_s, n, k // 32).view(torch.uint8).contiguous()
    c = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
    best, best_ms = None, float("inf")
    for bm, bn, bk, warps in ((128, 128, 128, 8), (128, 256, 64, 8), (64, 128, 128, 4), (128, 64, 128, 4)):
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))

        def run(bm=bm, bn=bn, bk=bk, warps=warps, grid=grid):
            kernel[grid](a, sa, b, sb, c, m, n, k, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=3)
        try:
            ms = do_bench(run, warmup=5, rep=30)
        except Exception:  # noqa: BLE001 - a config that does not compile here (shared memory) is skipped
            continue
        if ms < best_ms:
            best, best_ms = run, ms
    if best is None:
        raise RuntimeError("no tile config compiled")
    return best
