"""``python -m cute_mxfp8 inspect [--arch sm_100a|sm_90a]``: compile every kernel variant for an arch, no GPU needed.

One row per variant: whether it compiled (or the error), and counts of the PTX instructions that prove the design:
hardware fp8 conversion (``cvt.rn.satfinite``), 16-byte global loads / vector stores, shared memory and barriers
(tile kernels), and local memory (must be zero).  PTX, not SASS: register counts and spills need the ``sass`` extra
(nvdisasm) and are not reported yet.
"""

from __future__ import annotations

import itertools
import json
import re

PATTERNS = {
    "cvt.satfinite": r"cvt\.rn\.satfinite\.e[45]m[23]x2\.f32",
    "ld.global.128b": r"ld\.global(?:\.nc)?\.(?:v4\.[bfu]32|v2\.[bfu]64)",
    "st.global.vec": r"st\.global\.v[24]\.[bu](?:32|64)",
    "ld/st.shared": r"(?:ld|st)\.shared",
    "bar.sync": r"bar\.sync",
    "local": r"\.local",
}


def variants():
    """Every compile key of the quantization kernels: (direction, in_dtype, elem, scale_mode, blocked)."""
    return list(itertools.product(["rowwise", "colwise", "dual"], ["bfloat16", "float32"], ["e4m3", "e5m2"],
                                  ["floor", "rceil"], [False, True]))


def inspect_variant(arch: str, key: tuple) -> dict:
    from cute_mxfp8.jit import compile_quant

    row = {"kernel": "quantize_" + key[0], "in": key[1], "elem": key[2], "mode": key[3], "blocked": key[4]}
    try:
        ptx = compile_quant(*key, arch, keep_ptx=True).__ptx__
    except Exception as e:  # report, do not stop: one broken variant should not hide the others
        row["status"] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
        return row
    row["status"] = "ok" if re.search(rf"\.target\s+{arch}\b", ptx) else "wrong target"
    row.update({name: len(re.findall(pat, ptx)) for name, pat in PATTERNS.items()})
    return row


def main(args) -> int:
    from tabulate import tabulate

    rows = [inspect_variant(args.arch, key) for key in variants()]
    cols = ["kernel", "in", "elem", "mode", "blocked", "status", *PATTERNS]
    print(f"arch {args.arch}: {sum(r['status'] == 'ok' for r in rows)}/{len(rows)} variants compiled")
    print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "rows": rows}, f, indent=2)
    bad = [r for r in rows if r["status"] != "ok" or r.get("local", 0)]
    return 1 if bad else 0
