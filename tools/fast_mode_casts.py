"""Hopper fast mode plain casts (issue 16) on the H200: the one-launch 128-block dual casts the MLP steps run (x / dy
of the dense steps, the grouped step's token-aligned x / dy, the 128 x 128-block weights), in two builds: the CTA's
run reloaded from L2 for the casting walk (``TileQuantKernel(keep_run=False)``) or kept in registers from the
reducing walk (``keep_run=True``), with and without token groups (``ops.cute_kernels.TILE_KEEP_RUN`` says which
the ops run).
Checks that both builds write the same bytes, times the cast kernel (torch.profiler; do_bench wall medians beside)
and reports GB/s of the op's DRAM bytes (input read once, outputs written once) beside a same-run bf16 copy and
the 32-block dual cast of the same tensor; and W13's cast read from w1 and w3 against torch.cat then the cast.
A dev tool: python tools/fast_mode_casts.py [--out DIR]."""

from __future__ import annotations

import argparse
import json

import torch

from cute_mxfp8 import ops
from cute_mxfp8.cli.bench import _time_ms, device_copy_gbps
from cute_mxfp8.cli.bench_mlp import kernel_breakdown
from cute_mxfp8.ops import backends, cute_kernels

# (name, shape, experts, token_align, blocks_2d)
CASES = [("x / dy, M=16384 D=4096", (16384, 4096), 0, 0, False),
         ("x / dy, M=8192 D=2048", (8192, 2048), 0, 0, False),
         ("grouped x / dy, T=32768 D=2048 E=8, token_align 128", (32768, 2048), 8, 128, False),
         ("W13 128x128, 2I=28672 D=4096", (28672, 4096), 0, 0, True),
         ("W13 128x128, 2I=16384 D=2048", (16384, 2048), 0, 0, True),
         ("grouped W13 128x128, 8 x 3072 x 2048", (8, 3072, 2048), 0, 0, True),
         ("grouped W2 128x128, 8 x 2048 x 1536", (8, 2048, 1536), 0, 0, True)]


def _gpu_ms(fn, dev, every_kernel: bool = False) -> float:
    """The cast kernel's ms per call (the call's longest kernel, or with ``every_kernel`` all of them; torch.profiler
    over 20 calls): unlike do_bench's wall time it does not follow the host when queueing a call takes longer than
    running it (the token-group casts' path on a slow host), nor count the token groups' small schedule launches."""
    rows = kernel_breakdown(fn, dev, top=10**6, steps=20)
    return sum(r[2] for r in rows) if every_kernel else rows[0][2]


def _bytes(outs) -> int:
    return sum(t.numel() * t.element_size() for t in outs)


KEEP = dict(cute_kernels.TILE_KEEP_RUN)  # what the ops run (restored after each A/B)


def _set(keep: bool | None) -> None:
    """Both bf16 builds (with and without token groups) keeping their run (True), reloading it (False), or as the
    ops run them (None)."""
    cute_kernels.TILE_KEEP_RUN.update(KEEP)
    if keep is not None:
        cute_kernels.TILE_KEEP_RUN.update({(torch.bfloat16, False): keep, (torch.bfloat16, True): keep})
    backends.PLANS.clear()


def _case(dev, name, shape, e, token_align, blocks_2d) -> dict:
    x = torch.randn(shape, device=dev).bfloat16()
    x[..., 5, :] *= 300  # an outlier row and column: scales differ across the run
    x[..., :, 7] *= 1e-3
    kw = {"scale_block": 128, "blocks_2d": blocks_2d}
    if e:
        counts = torch.full((e,), shape[0] // e, device=dev)
        counts[0] -= 100  # a group ending inside a run
        counts[1] += 100
        kw.update(offs=counts.cumsum(0).to(torch.int32), token_align=token_align)
    row = {}
    outs = {}
    for keep in (False, True):
        _set(keep)
        outs[keep] = ops.quantize_dual(x, **kw)
        label = "kept" if keep else "reloaded"
        row[label] = _gpu_ms(lambda: ops.quantize_dual(x, **kw), dev)
        row[label + " wall"] = _time_ms(lambda: ops.quantize_dual(x, **kw), dev, 1.0)
    _set(None)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                              for a, b in zip(outs[False], outs[True]))
    nbytes = x.numel() * x.element_size() + _bytes(outs[False])
    row.update(equal=same, bytes=nbytes)
    if not e and not blocks_2d:
        row["mx32"] = _gpu_ms(lambda: ops.quantize_dual(x), dev)
    return row


GATE_UP = [("W13 from w1, w3 (128x128), I=14336 D=4096", (14336, 4096)),
           ("W13 from w1, w3 (128x128), I=8192 D=2048", (8192, 2048)),
           ("grouped W13 from w1, w3 (128x128), 8 x 1536 x 2048", (8, 1536, 2048))]


def _gate_up(dev, name, shape) -> dict:
    """``quantize_gate_up`` (one cast reading w1 and w3) against packing W13 with torch.cat and casting it (the
    code before): equal bytes, ms of each; both with the build the ops run (kept for bf16 by default)."""
    w1, w3 = (torch.randn(shape, device=dev).bfloat16() for _ in range(2))
    kw = {"scale_block": 128, "blocks_2d": True}
    new = ops.quantize_gate_up(w1, w3, **kw)
    old = ops.quantize_dual(torch.cat([w1, w3], dim=-2), **kw)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(new, old))
    return {"equal": same, "bytes": 2 * w1.numel() * 2 + _bytes(new),
            "from w1, w3": _gpu_ms(lambda: ops.quantize_gate_up(w1, w3, **kw), dev),
            "cat + cast": _gpu_ms(lambda: ops.quantize_dual(torch.cat([w1, w3], dim=-2), **kw), dev, True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/fast_mode_casts.py needs a CUDA GPU (the sm90 backend's kernels)")
    dev = torch.device("cuda")
    copy_gbps = device_copy_gbps(dev)
    report = {"copy_gbps": copy_gbps, "cases": {}}
    print(f"bf16 copy: {copy_gbps:.0f} GB/s")
    for case in CASES:
        r = _case(dev, *case)
        report["cases"][case[0]] = r
        gbps = {k: r["bytes"] / (r[k] * 1e-3) / 1e9 for k in ("reloaded", "kept", "mx32") if k in r}
        print(f"{case[0]}: equal={r['equal']} " + "  ".join(
            f"{k} {r[k]:.4f} ms ({gbps[k]:.0f} GB/s, {100 * gbps[k] / copy_gbps:.0f} % of copy)" for k in gbps)
            + "; do_bench wall " + "  ".join(f"{k} {r[k + ' wall']:.4f} ms" for k in ("reloaded", "kept")),
            flush=True)
    for name, shape in GATE_UP:
        r = _gate_up(dev, name, shape)
        report["cases"][name] = r
        print(f"{name}: equal={r['equal']} from w1, w3 {r['from w1, w3']:.4f} ms, cat + cast {r['cat + cast']:.4f} "
              f"ms ({100 * r['bytes'] / (r['from w1, w3'] * 1e-3) / 1e9 / copy_gbps:.0f} % of copy)", flush=True)
    if args.out:
        with open(f"{args.out}/fast_mode_casts.json", "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
