"""Hopper fast mode SwiGLU casts (issue 16) on the H200: the 128-block SwiGLU / dSwiGLU + dual-cast kernels in one
launch (each CTA's 16 warps hold its 128-row run in registers, meet once over the 128-block amaxes, then cast),
one CTA per run or persistent (one CTA per SM, the next run's input prefetched into shared memory), against the
two-launch form (an amax pass through global buffers, then the casts), at the bench's MLP shapes, bf16 inputs.
Checks that every form writes the same bytes, then times them (the kernels' ms per call from torch.profiler, which
does not follow a slow host; do_bench beside) and reports GB/s of the op's DRAM bytes (inputs read once, outputs
written once) beside a same-run bf16 copy.  A dev tool: python tools/fast_mode_swiglu.py [--out DIR]."""

from __future__ import annotations

import argparse
import json

import torch

from cute_mxfp8 import ops
from cute_mxfp8.cli.bench import _time_ms, device_copy_gbps
from cute_mxfp8.ops import cute_kernels
from fast_mode_casts import _gpu_ms

PERSISTENT = dict(cute_kernels.SWIGLU_PERSISTENT)  # what the ops run (restored at the end)
FORMS = [("two launches", False, False), ("one launch, a CTA per run", True, False),
         ("one launch, persistent", True, True)]  # (name, SWIGLU_ONE_PASS, SWIGLU_PERSISTENT)

# (name, M, I, experts, token_align): the grouped MLP's casts use the padded layout; the unpadded grouped case too
CASES = [("dense M=16384 I=14336", 16384, 14336, 0, 0), ("dense M=8192 I=8192", 8192, 8192, 0, 0),
         ("grouped T=32768 I=1536 E=8 padded", 32768, 1536, 8, 128), ("grouped T=32768 I=1536 E=8", 32768, 1536, 8, 0)]


def _bytes(outs) -> int:
    return sum(t.numel() * t.element_size() for t in outs if t is not None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="the cases whose names contain one of these words")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_gbps = device_copy_gbps(dev)
    report = {"copy_gbps": copy_gbps, "cases": {}}
    print(f"bf16 copy: {copy_gbps:.0f} GB/s")
    try:
        for case in CASES:
            if not args.only or any(word in case[0] for word in args.only):
                report["cases"][case[0]] = _case(dev, *case)
    finally:
        cute_kernels.SWIGLU_ONE_PASS[torch.bfloat16] = True
        cute_kernels.SWIGLU_PERSISTENT.update(PERSISTENT)
    if args.out:
        with open(f"{args.out}/fast_mode_swiglu.json", "w") as f:
            json.dump(report, f, indent=1)


def _case(dev, name, m, i, e, token_align) -> dict:
    """Both forms of the forward and backward cast of one case: ms, GB/s, and whether their outputs are equal."""
    h13 = torch.randn(m, 2 * i, device=dev).bfloat16()
    dh = torch.randn(m, i, device=dev).bfloat16()
    kw = {"scale_block": 128}
    if e:
        offs = (torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (m // e))
        kw.update(offs=offs, token_align=token_align)
    fns = {"fwd": lambda: ops.swiglu_quant(h13, **kw), "bwd": lambda: ops.dswiglu_quant(dh, h13, **kw)}
    row = {}
    for d, fn in fns.items():
        res = {}
        for form, one_pass, persistent in FORMS:
            cute_kernels.SWIGLU_ONE_PASS[torch.bfloat16] = one_pass
            cute_kernels.SWIGLU_PERSISTENT[d, bool(e)] = persistent
            outs = fn()
            ms = _gpu_ms(fn, dev, every_kernel=True)
            moved = _bytes(outs) + (h13.numel() * 2 + (dh.numel() * 2 if d == "bwd" else 0))
            res[form] = {"ms": ms, "gbps": moved / (ms * 1e-3) / 1e9, "do_bench ms": _time_ms(fn, dev, 1.0),
                         "outs": outs}
        a = res[FORMS[0][0]].pop("outs")
        for form, _, _ in FORMS[1:]:
            b = res[form].pop("outs")
            res[f"same bytes as {FORMS[0][0]}: {form}"] = all(
                torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                            y.view(torch.uint8) if y.element_size() == 1 else y) for x, y in zip(a, b))
        row[d] = res
        print(name, d, {k: ({kk: round(vv, 3) for kk, vv in v.items()} if isinstance(v, dict) else v)
                        for k, v in res.items()})
    return row


if __name__ == "__main__":
    main()
