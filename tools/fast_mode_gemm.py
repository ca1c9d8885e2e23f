"""Hopper fast mode GEMM (issue 16) on the H200: correctness of the 1x128 shared-scale kernel
(``compile_gemm_sm90(..., "promote", block_k=128)``) against the reference, and its speed beside the bench's SM90
dense baselines (cuBLAS bf16, cuBLAS fp8 rowwise / blockwise, Triton, the per-32 promote kernel) and our default
``ops.mm`` (dequantize mainloop), all in one run.  A dev tool: python tools/fast_mode_gemm.py [--out DIR]."""

from __future__ import annotations

import argparse
import json

import torch

from cute_mxfp8 import formats as F
from cute_mxfp8 import ops
from cute_mxfp8.cli.bench import _time_ms
from cute_mxfp8.cli.bench_baselines import sm90_dense_baselines
from cute_mxfp8.jit import compile_gemm_sm90
from cute_mxfp8.ops.gemm_common import schedule_m


def fast_operand(x, blocks_2d=False):
    q, s = F.quantize_mxfp8(x, scale_block=128, blocks_2d=blocks_2d)
    return q, F.to_blocked_scales(s)


VARIANTS = {"n_tile 128": {"n_tile": 128}, "n_tile 192": {"n_tile": 192},
            "n_tile 192 B 128x128": {"n_tile": 192, "b_block_n": 128},
            "n_tile 128 B 128x128": {"n_tile": 128, "b_block_n": 128},
            "n_tile 192 B 128x128 split M": {"n_tile": 192, "b_block_n": 128, "consumer_split": "m"},
            "n_tile 192 B 128x128 split M TMA store": {"n_tile": 192, "b_block_n": 128, "consumer_split": "m",
                                                       "tma_store": True},
            "n_tile 192 no pingpong": {"n_tile": 192, "pingpong": False},
            "n_tile 192 cluster 2x1": {"n_tile": 192, "cluster_mn": (2, 1)},
            "n_tile 192 cluster 1x2": {"n_tile": 192, "cluster_mn": (1, 2)}}


def _picked(name, only):
    """Whether ``--only`` picks ``name``: one of its words is in the name ("=NAME": the name exactly)."""
    return any(name == o[1:] if o.startswith("=") else o in name for o in only)


def check(m, n, k, gen, **kw):
    x = torch.randn(m, k, generator=gen).cuda() * torch.logspace(-3, 3, k, device="cuda")
    w = torch.randn(n, k, generator=gen).cuda()
    (a, a_s), (b, b_s) = fast_operand(x), fast_operand(w, kw.get("b_block_n", 1) == 128)
    out = "bfloat16" if kw.get("tma_store") else "float32"  # (the TMA-stored build: bf16 only)
    fn = compile_gemm_sm90("e4m3", "e4m3", out, "promote", block_k=128, **kw)
    got = torch.empty(m, n, device="cuda", dtype=getattr(torch, out))
    fn(a, b, a_s.view(torch.uint8), b_s.view(torch.uint8), got)
    da = F.dequantize_mxfp8(a, F.from_blocked_scales(a_s, m, k // 32)).double()
    db = F.dequantize_mxfp8(b, F.from_blocked_scales(b_s, n, k // 32)).double()
    mag = da.abs() @ db.abs().t()
    err = (got.double() - da @ db.t()).abs()
    return (err / mag.clamp_min(1e-300)).max().item()


def grouped(only):
    """MoE GEMMs of the bench's grouped experts (8 experts, 32768 tokens in equal groups, d 2048, 2 I 3072): the
    2d-3d GEMM1 and the 2d-2d wgrad of w13, bf16 ``torch._grouped_mm`` vs our exact and fast-mode kernels."""
    e, t, d, n = 8, 32768, 2048, 3072
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (t // e)
    x = torch.randn(t, d, device="cuda")
    w = torch.randn(e, n, d, device="cuda")
    dy = torch.randn(t, n, device="cuda")
    xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()
    fns = {"2d-3d bf16 torch._grouped_mm": lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=offs),
           "2d-2d bf16 torch._grouped_mm": lambda: torch._grouped_mm(dyb.t(), xb, offs=offs)}
    for block in (32, 128):
        name = "fast mode" if block == 128 else "exact MXFP8"
        a, a_s = ops.quantize_rowwise(x, offs=offs, scale_block=block)
        b, b_s = ops.quantize_rowwise(w, scale_block=block)
        (ga, ga_s), (gb, gb_s) = (ops.quantize_colwise(v, offs=offs, scale_block=block) for v in (dy, x))
        fns[f"2d-3d sm90 {name}"] = (lambda a=a, a_s=a_s, b=b, b_s=b_s, block=block: ops.grouped_mm(
            a, a_s, b, b_s, offs, backend="sm90", scale_block=block))
        fns[f"2d-2d sm90 {name}"] = (lambda ga=ga, ga_s=ga_s, gb=gb, gb_s=gb_s, block=block: ops.grouped_mm_wgrad(
            ga, ga_s, gb, gb_s, offs, backend="sm90", scale_block=block))
    b2, b2_s = ops.quantize_rowwise(w, scale_block=128, blocks_2d=True)
    fns["2d-3d sm90 fast mode B 128x128"] = lambda: ops.grouped_mm(a, a_s, b2, b2_s, offs, backend="sm90",
                                                                   scale_block=128, b_blocks_2d=True)
    # the same build with per-thread stores instead of the TMA-stored tile (what ops.grouped_mm ran before)
    direct = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", grouping="m", block_k=128, n_tile=192,
                               b_block_n=128, consumer_split="m", max_ctas=torch.cuda.get_device_properties(0)
                               .multi_processor_count)
    d_direct = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    sched = schedule_m(offs, t, 128)
    fns["2d-3d sm90 fast mode B 128x128 per-thread stores"] = lambda: direct(
        a, b2.view(-1, d), a_s.view(torch.uint8), b2_s.view(torch.uint8).reshape(-1), d_direct, *sched)
    if only:
        fns = {name: fn for name, fn in fns.items() if _picked(name, only)}
    row = wgrad_store_ab(only)
    for name, fn in fns.items():
        try:
            row[name] = 2 * t * n * d / (_time_ms(fn, x.device, 2.0) * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - a baseline this torch cannot run is reported, not fatal
            row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    print("grouped", {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
    return row


def wgrad_store_ab(only) -> dict:
    """The fast 2d-2d wgrad (bf16 out) with its TMA-stored tile vs per-thread stores
    (``ops.gemm_sm90.WGRAD_TMA_STORE``), TFLOP/s, at the grouped step's two wgrads (T=32768 in 8 equal groups):
    dW13 (8 x 3072 x 2048, split into dW1 / dW3 as the MLP asks) and dW2 (8 x 2048 x 1536); each checked equal to
    the other epilogue first (the same fp32 accumulators, rounded once)."""
    from cute_mxfp8.ops import gemm_sm90 as G

    e, t = 8, 32768
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (t // e)
    row = {}
    for label, n, k, halves in (("dW13", 3072, 2048, True), ("dW2", 2048, 1536, False)):
        (ga, ga_s), (gb, gb_s) = (ops.quantize_colwise(torch.randn(t, c, device="cuda"), offs=offs, scale_block=128)
                                  for c in (n, k))

        def run():
            return ops.grouped_mm_wgrad(ga, ga_s, gb, gb_s, offs, backend="sm90", scale_block=128,
                                        out_dtype=torch.bfloat16, split_halves=halves)
        outs = {}
        for staged in (True, False):
            name = f"2d-2d sm90 fast mode {label} {'TMA store' if staged else 'per-thread stores'}"
            if only and not _picked(name, only):
                continue
            G.WGRAD_TMA_STORE = staged
            try:
                outs[staged] = run()
                row[name] = 2 * t * n * k / (_time_ms(run, ga.device, 2.0) * 1e-3) / 1e12
            finally:
                G.WGRAD_TMA_STORE = True
        if len(outs) == 2:
            row[f"{label} epilogues equal"] = bool(torch.equal(outs[True], outs[False]))
    return row


# the M=8192 D=2048 I=8192 MLP step's GEMMs, its wgrads (1x128 B), the large step's GEMM2 and a 4-tile GEMM:
# (name, M, N, K, 128 x 128 B blocks)
SPLIT_TAIL_CASES = [("GEMM1 x W13", 8192, 16384, 2048, True), ("GEMM2 h W2", 8192, 2048, 8192, True),
                    ("dgrad dh = dy W2", 8192, 8192, 2048, True), ("dgrad dx = dh13 W13", 8192, 2048, 16384, True),
                    ("wgrad dW13", 16384, 2048, 8192, False), ("wgrad dW2", 2048, 8192, 8192, False),
                    ("large GEMM2", 16384, 4096, 14336, True), ("small", 256, 384, 4096, False)]


def split_tail_ab() -> dict:
    """``ops.mm(..., scale_block=128)`` with the split tail (``ops.gemm_sm90.SPLIT_TAIL``) off and on, alternating
    twice per shape: the GEMM kernel's ms from torch.profiler (``fast_mode_casts._gpu_ms``: a wall time would
    follow a slow host) and TFLOP/s of the faster of the two; e4m3 -> bf16 from random bf16 data."""
    from cute_mxfp8.ops import gemm_sm90 as G
    from fast_mode_casts import _gpu_ms

    dev, rows, keep = torch.device("cuda"), {}, G.SPLIT_TAIL
    ctas = torch.cuda.get_device_properties(dev).multi_processor_count
    try:
        for name, m, n, k, b2d in SPLIT_TAIL_CASES:
            a, a_s = ops.quantize_rowwise(torch.randn(m, k, device=dev).bfloat16(), scale_block=128)
            b, b_s = ops.quantize_rowwise(torch.randn(n, k, device=dev).bfloat16(), scale_block=128,
                                          blocks_2d=b2d)
            G.SPLIT_TAIL = True
            row = {"shape": (m, n, k), "tail, parts": G._tail_split(m, n, k, ctas)}
            for on in (False, True, False, True):
                G.SPLIT_TAIL = on
                ms = _gpu_ms(lambda: ops.mm(a, a_s, b, b_s, scale_block=128, b_blocks_2d=b2d), dev)
                row.setdefault(f"ms split={on}", []).append(round(ms, 4))
            row["TFLOP/s unsplit, split"] = [round(2 * m * n * k / min(row[f"ms split={on}"]) / 1e9, 1)
                                             for on in (False, True)]
            rows[name] = row
            print(name, row, flush=True)
    finally:
        G.SPLIT_TAIL = keep
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="time only the GEMMs whose names contain one of these")
    ap.add_argument("--profile", default=None, metavar="VARIANT",
                    help="launch only this fast-mode variant ('default', a VARIANTS name or a 'cuBLAS ...' "
                         "baseline) once at 8192^3 between cudaProfilerStart/Stop (for ncu --profile-from-start "
                         "off), then exit")
    ap.add_argument("--no-grouped", action="store_true", help="skip the grouped GEMMs")
    ap.add_argument("--split-tail", action="store_true",
                    help="only the split tail's A/B (SPLIT_TAIL_CASES: kernel ms off / on), then exit")
    args = ap.parse_args()
    if args.split_tail:
        report = split_tail_ab()
        if args.out:
            with open(f"{args.out}/split_tail.json", "w") as f:
                json.dump(report, f, indent=1)
        return
    if args.profile:
        a, a_s = ops.quantize_rowwise(torch.randn(8192, 8192, device="cuda"))
        d = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
        if args.profile.startswith("cuBLAS"):  # a baseline of the same shape, for side-by-side counters
            run = sm90_dense_baselines(a, a_s, a, a_s, {})[args.profile]
        else:
            kw = {} if args.profile == "default" else VARIANTS[args.profile]
            fn = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", block_k=128, **kw)

            def run():
                fn(a, a, a_s.view(torch.uint8), a_s.view(torch.uint8), d)
        run()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    gen = torch.Generator().manual_seed(0)
    report = {"max_error_over_sum_abs": {f"{m}x{n}x{k} {name}": check(m, n, k, gen, **kw)
                                         for m, n, k in [(512, 384, 1024), (1000, 130, 4128), (257, 129, 416),
                                                         (1000, 136, 4128)]
                                         for name, kw in {"default": {}, **VARIANTS}.items()
                                         if n % 8 == 0 or not kw.get("tma_store")  # (TMA: 16-byte rows)
                                         if not args.only or _picked(f"sm90 fast mode {name}", args.only)}}
    print(report)
    report["tflops"] = {}
    for m, n, k in [(8192, 8192, 8192), (16384, 7168, 2048), (16384, 2048, 7168)]:
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda")
        a, a_s = ops.quantize_rowwise(x)
        b, b_s = ops.quantize_rowwise(w)
        skipped = {}
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fns = {"ours default (sm90 dequant)": lambda: ops.mm(a, a_s, b, b_s, backend="sm90"),
               **sm90_dense_baselines(a, a_s, b, b_s, skipped)}
        for name, kw in VARIANTS.items():
            fn = compile_gemm_sm90("e4m3", "e4m3", "bfloat16", "promote", block_k=128, **kw)
            fns[f"sm90 fast mode {name}"] = lambda fn=fn: fn(a, b, a_s.view(torch.uint8), b_s.view(torch.uint8), d)
        if args.only:
            fns = {name: fn for name, fn in fns.items() if _picked(name, args.only)}
        row = {name: 2 * m * n * k / (_time_ms(fn, a.device, 2.0) * 1e-3) / 1e12 for name, fn in fns.items()}
        row["skipped"] = skipped
        report["tflops"][f"{m}x{n}x{k}"] = row
        print(m, n, k, {kk: round(v, 1) for kk, v in row.items() if kk != "skipped"}, skipped)
    if not args.no_grouped:
        report["grouped_tflops"] = grouped(args.only)
    if args.out:
        with open(f"{args.out}/fast_mode_gemm.json", "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
