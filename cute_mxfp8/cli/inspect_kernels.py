"""``python -m cute_mxfp8 inspect [--arch sm_100f|sm_100a|sm_103a|sm_90a] [--jobs J] [--pairwise] [--shard K/N]``:
compile every kernel variant for an arch, no GPU needed, in J processes (default: the CPU count); ``--pairwise``:
the subset of each family in which every pair of argument values occurs (the CPU test suite's check); ``--shard
K/N``: every N-th variant from the K-th, so that N runs share the list (the test suite's workers do).

One row per variant of the registry :data:`FAMILIES`: whether it compiled (or the error); from the CUBIN, the
registers per thread, shared memory (static from the CUBIN, dynamic from the launch) and the local-memory frame;
from the SASS (needs ``nvdisasm``: ``pip install -e ".[sass]"``) the spill instructions ``LDL``/``STL`` (must be 0)
and the counts of the instructions that prove the design (:data:`SASS_COLUMNS`; a column is printed when some row
has one; a variant whose PTX asks for ``setmaxnreg`` must keep it in SASS).  Without ``nvdisasm`` the PTX counts
(:data:`PTX_COLUMNS`) stand in.  ``--json`` writes every number, including the full SASS opcode histogram.  Exit
status 1 if any variant fails to compile, uses local memory or loses its ``setmaxnreg``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import itertools
import json
import os
import re
from typing import Callable

from cute_mxfp8 import jit
from cute_mxfp8.cli import sass_facts
from cute_mxfp8.cli.checks import output_file_problem

IN_DTYPES, ELEMS, MODES = ["bfloat16", "float32"], ["e4m3", "e5m2"], ["floor", "rceil"]


@dataclasses.dataclass(frozen=True)
class Family:
    """Variants of one kernel: ``compile(*values, arch, keep_ptx=True)`` for every combination of ``axes``
    (argument name -> values, in the compile function's positional order)."""

    kernel: str
    compile: Callable
    axes: dict
    archs: tuple = (*jit.SM100_ARCHS, "sm_90a")  # targets the kernel exists for (the tcgen05 GEMM: SM100 only)

    def variants(self) -> list[dict]:
        return [dict(zip(self.axes, values)) for values in itertools.product(*self.axes.values())]

    def pairwise_variants(self) -> list[dict]:
        """A subset of :meth:`variants` in which every value of every varying argument, and every pair of values
        of two of them, occurs at least once (greedy: each pick covers the most pairs still missing; ties go to
        the first in :meth:`variants` order, so the subset is fixed).  The CI's compile check (``inspect
        --pairwise``): about 60 % of the variants, every argument interaction of order two still built."""
        full = self.variants()
        varying = [k for k in self.axes if len(self.axes[k]) > 1]

        def pairs(v: dict) -> set:
            singles = {(k, v[k]) for k in varying}
            return {((a, v[a]), (b, v[b])) for a, b in itertools.combinations(varying, 2)} | singles

        missing = set().union(*(pairs(v) for v in full))
        chosen = [] if missing else full[:1]
        while missing:
            best = max(full, key=lambda v: len(pairs(v) & missing))
            chosen.append(best)
            missing -= pairs(best)
        return [v for v in full if v in chosen]  # registry order

    def build(self, args: dict, arch: str):
        """The call, spelled with every argument positional and defaults included (a ``functools.partial`` with
        keywords is unwrapped): one spelling per key, so the in-memory ``lru_cache`` of a ``compile_*`` is shared
        with other callers that spell their calls the same way (the kernel tests do)."""
        fn, fixed = self.compile, {}
        if isinstance(fn, functools.partial) and not fn.args:
            fn, fixed = fn.func, fn.keywords
        bound = inspect.signature(fn).bind(*args.values(), arch, keep_ptx=True, **fixed)
        bound.apply_defaults()
        return fn(*bound.args, **bound.kwargs)

    def label(self, args: dict) -> str:
        """The arguments that vary within the family: strings as they are, flags by name when set."""
        parts = [(k if v else "") if isinstance(v, bool) else str(v) for k, v in args.items() if len(self.axes[k]) > 1]
        return " ".join(p for p in parts if p)


# Add a kernel here (one line) and ``inspect`` compiles and reports all its variants.  3-D (E, N, K) colwise and
# dual casts run the same builds as the 2-D ones (a 2-D input is a batch of one).
_BLOCKED = {"blocked": [False, True]}
_GEMM_E4M3 = {"a_elem": ["e4m3"], "b_elem": ["e4m3"]}
FAMILIES = [
    *(Family(f"quantize_{d}", jit.compile_quant, {"direction": [d], "in_dtype": IN_DTYPES, "elem": ELEMS,
                                                   "scale_mode": MODES, **_BLOCKED})
      for d in ("rowwise", "colwise", "dual")),
    Family("quantize_rowwise_grouped_m", functools.partial(jit.compile_quant, grouped=True),
           {"direction": ["rowwise"], "in_dtype": IN_DTYPES, "elem": ELEMS, "scale_mode": MODES, "blocked": [True]}),
    *(Family(f"quantize_{d}_grouped_k", functools.partial(jit.compile_quant, grouped=True),
             {"direction": [d], "in_dtype": IN_DTYPES, "elem": ELEMS, "scale_mode": MODES, **_BLOCKED})
      for d in ("colwise", "dual")),
    # token_align=128: the colwise output in the padded group layout (ops.quantize_colwise / quantize_dual)
    *(Family(f"quantize_{d}_grouped_k_padded", functools.partial(jit.compile_quant, grouped=True, pad_groups=True),
             {"direction": [d], "in_dtype": IN_DTYPES, "elem": ["e4m3"], "scale_mode": MODES, **_BLOCKED})
      for d in ("colwise", "dual")),
    Family("quantize_rowwise_3d", functools.partial(jit.compile_quant, batched=True),
           {"direction": ["rowwise"], "in_dtype": IN_DTYPES, "elem": ELEMS, "scale_mode": MODES, **_BLOCKED}),
    *(Family(f"swiglu_quant_{d}{'_grouped' if grouped else ''}{'_hp' if hp else ''}",
             functools.partial(jit.compile_swiglu_quant, grouped=grouped, emit_hp=hp),
             {"direction": [d], "in_dtype": IN_DTYPES, "elem": ELEMS, "scale_mode": MODES, **_BLOCKED})
      for d in ("fwd", "bwd") for grouped in (False, True) for hp in (False, True)),
    # the Hopper fast mode's casts (scale_block=128, issue 16): the one-launch casts and the SwiGLU kernels' two
    # launches (the 128-block amax pass, then the cast pass), as the ops run them; the other dtype / layout axes
    # build the same code as the 32-block families above
    # (the grouped MLP's x / dy casts: dual with token_align=128, the padded group layout)
    *(Family(f"quantize_{d}{'_grouped_k' if grouped else ''}{'_padded' if pad else ''}{'_3d' if batched else ''}"
             "_fast_mode",
             functools.partial(jit.compile_quant, grouped=grouped, batched=batched, scale_block=128, pad_groups=pad),
             {"direction": [d], "in_dtype": IN_DTYPES, "elem": ["e4m3"], "scale_mode": MODES, "blocked": [True]})
      for d, grouped, batched, pad in (("rowwise", False, False, False), ("rowwise", False, True, False),
                                       ("colwise", False, False, False), ("dual", False, False, False),
                                       ("dual", True, False, False), ("dual", True, False, True))),
    # ... and the 128 x 128 weight blocks (hopper_weight_blocks="128x128"): the weights' casts, dual (what the
    # layers run) in every input dtype and mode, 2-D / 3-D rowwise and colwise once
    *(Family(f"quantize_{d}{'_3d' if batched else ''}_blocks_2d_fast_mode",
             functools.partial(jit.compile_quant, batched=batched, scale_block=128, blocks_2d=True),
             {"direction": [d], "in_dtype": IN_DTYPES if d == "dual" else ["bfloat16"], "elem": ["e4m3"],
              "scale_mode": MODES if d == "dual" else ["rceil"], "blocked": [True]})
      for d, batched in (("dual", False), ("rowwise", False), ("rowwise", True), ("colwise", False))),
    # ... and what the ops run for bf16 (ops.cute_kernels.TILE_KEEP_RUN): the run's tiles kept in registers
    # between the two walks
    *(Family(f"quantize_{d}{'_3d' if batched else ''}{'_blocks_2d' if b2d else ''}_kept_fast_mode",
             functools.partial(jit.compile_quant, batched=batched, scale_block=128, blocks_2d=b2d, keep_run=True),
             {"direction": [d], "in_dtype": ["bfloat16"], "elem": ["e4m3"],
              "scale_mode": MODES if d == "dual" else ["rceil"], "blocked": [True]})
      for d, batched, b2d in (("dual", False, False), ("rowwise", False, False), ("rowwise", True, False),
                              ("colwise", False, False), ("dual", False, True), ("rowwise", False, True),
                              ("rowwise", True, True), ("colwise", False, True))),
    # ... and with token groups (the grouped MLP's x / dy casts in the padded layout; the grouped ops' rowwise and
    # unpadded casts), kept as well for bf16
    *(Family(f"quantize_{d}_grouped_k{'_padded' if pad else ''}_kept_fast_mode",
             functools.partial(jit.compile_quant, grouped=True, scale_block=128, pad_groups=pad, keep_run=True),
             {"direction": [d], "in_dtype": ["bfloat16"], "elem": ["e4m3"],
              "scale_mode": MODES if pad else ["rceil"], "blocked": [True]})
      for d, pad in (("dual", True), ("dual", False), ("rowwise", False), ("colwise", True))),
    # ... and the packed W13's cast read from w1 and w3 (ops.quantize_gate_up with 128-blocks): kept run for bf16
    # (dual, or one direction: the SwiGLU MLP's forward rowwise and backward colwise casts of W13)
    *(Family(f"quantize_{d}_gate_up{'_blocks_2d' if b2d else ''}{'_kept' if keep else ''}_fast_mode",
             functools.partial(jit.compile_quant, scale_block=128, blocks_2d=b2d, keep_run=keep, gate_up=True),
             {"direction": [d], "in_dtype": ["bfloat16" if keep else "float32"], "elem": ["e4m3"],
              "scale_mode": ["rceil"], "blocked": [True]})
      for d in ("dual", "rowwise", "colwise") for b2d in (False, True) for keep in (False, True)),
    *(Family(f"swiglu_quant_{d}_fast_mode_{phase}",
             functools.partial(jit.compile_swiglu_quant, scale_block=128, phase=phase),
             {"direction": [d], "in_dtype": ["bfloat16"], "elem": ["e4m3"], "scale_mode": MODES, "blocked": [True]})
      for d in ("fwd", "bwd") for phase in ("amax", "apply", "cast")),  # (cast: the bf16 inputs' one launch)
    # ... and the grouped MLP's (GEMM outputs in the activation dtype in, colwise outputs in the padded group layout)
    # ... their one launch (bf16; the padded backward too since its casting pass skips the lane's own amax reductions)
    *(Family(f"swiglu_quant_{d}_grouped{'_padded' if pad else ''}_fast_mode_cast",
             functools.partial(jit.compile_swiglu_quant, grouped=True, scale_block=128, phase="cast", pad_groups=pad),
             {"direction": [d], "in_dtype": ["bfloat16"], "elem": ["e4m3"], "scale_mode": MODES, "blocked": [True]})
      for d, pad in (("fwd", True), ("fwd", False), ("bwd", True), ("bwd", False))),
    # ... and the dense forward's one launch as the SM90 ops run it (ops.cute_kernels.SWIGLU_PERSISTENT): persistent
    # CTAs (the H200's 132) prefetching the next run into shared memory
    # (every element dtype, scale layout and mode, with and without the high-precision output: at 120-128 registers)
    *(Family(f"swiglu_quant_fwd_fast_mode_cast_persistent{'_hp' if hp else ''}",
             functools.partial(jit.compile_swiglu_quant, scale_block=128, phase="cast", persistent_ctas=132,
                               emit_hp=hp),
             {"direction": ["fwd"], "in_dtype": ["bfloat16"], "elem": ELEMS, "scale_mode": MODES, **_BLOCKED},
             archs=("sm_90a",))
      for hp in (False, True)),
    *(Family(f"swiglu_quant_{d}_grouped_padded_fast_mode_apply",
             functools.partial(jit.compile_swiglu_quant, grouped=True, scale_block=128, phase="apply",
                               pad_groups=True),  # (dh and the saved h13 in one dtype)
             {"direction": [d], "in_dtype": IN_DTYPES, "elem": ["e4m3"], "scale_mode": MODES, "blocked": [True]})
      for d in ("fwd", "bwd")),
    Family("gemm_sm90", jit.compile_gemm_sm90,
           {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16", "float32"], "mainloop": ["dequant", "promote"]},
           archs=("sm_90a",)),
    # the Hopper fast mode's GEMM (issue 16): one promotion per 128 of K, n_tile 128 / 192
    *(Family(f"gemm_sm90_fast_mode_n{nt}", functools.partial(jit.compile_gemm_sm90, block_k=128, n_tile=nt),
             {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16", "float32"], "mainloop": ["promote"]},
             archs=("sm_90a",))
      for nt in (128, 192)),
    # ... with 128 x 128 B blocks (MXFP8Config(hopper_weight_blocks="128x128")): dense and 2d-3d, n_tile 192, the
    # consumers split M as the ops run them (dense split N: an option, measured 4-5 % slower)
    *(Family(f"gemm_sm90_fast_mode_b128x128{'_grouped_m' if g == 'm' else ''}_split_{split}",
             functools.partial(jit.compile_gemm_sm90, block_k=128, n_tile=192, grouping=g, b_block_n=128,
                               consumer_split=split),
             {**(dict(a_elem=ELEMS, b_elem=ELEMS) if g == "none" and split == "m" else _GEMM_E4M3),
              "out_dtype": ["bfloat16", "float32"] if split == "m" else ["bfloat16"], "mainloop": ["promote"]},
             archs=("sm_90a",))
      for g, split in (("none", "m"), ("m", "m"), ("none", "n"))),
    # ... the split-M builds the ops run for a bf16 D with N % 8 == 0 (dense and 2d-3d): the tile TMA-stored from
    # shared memory
    *(Family(f"gemm_sm90_fast_mode_b128x128{'_grouped_m' if g == 'm' else ''}_split_m_tma_store",
             functools.partial(jit.compile_gemm_sm90, block_k=128, n_tile=192, b_block_n=128, consumer_split="m",
                               grouping=g, tma_store=True),
             {**(dict(a_elem=ELEMS, b_elem=ELEMS) if g == "none" else _GEMM_E4M3), "out_dtype": ["bfloat16"],
              "mainloop": ["promote"]}, archs=("sm_90a",))
      for g in ("none", "m")),
    # ... the split-tail builds the ops run where the last round of tiles is split along K (1x128 B; 128 x 128 B)
    *(Family(f"gemm_sm90_fast_mode_{name}_split_tail",
             functools.partial(jit.compile_gemm_sm90, block_k=128, n_tile=192, split_tail=True, **kw),
             {**_GEMM_E4M3, "out_dtype": ["bfloat16"], "mainloop": ["promote"]}, archs=("sm_90a",))
      for name, kw in (("n192", {}), ("b128x128_split_m_tma_store",
                                      dict(b_block_n=128, consumer_split="m", tma_store=True)))),
    # ... the op's configuration (n_tile 192) in 2-CTA clusters with TMA multicast (an option; measured no faster)
    *(Family(f"gemm_sm90_fast_mode_n192_cluster{m}x{n}",
             functools.partial(jit.compile_gemm_sm90, block_k=128, n_tile=192, cluster_mn=(m, n)),
             {**_GEMM_E4M3, "out_dtype": ["bfloat16"], "mainloop": ["promote"]}, archs=("sm_90a",))
      for m, n in ((2, 1), (1, 2))),
    # ... and its 2d-3d / 2d-2d builds (ops.grouped_mm / grouped_mm_wgrad with scale_block=128)
    *(Family(f"gemm_sm90_fast_mode_grouped_{g}",
             functools.partial(jit.compile_gemm_sm90, block_k=128, n_tile=192, grouping=g),
             {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16", "float32"], "mainloop": ["promote"]},
             archs=("sm_90a",))
      for g in ("m", "k")),
    *(Family(f"gemm_sm90_grouped_{g}", functools.partial(jit.compile_gemm_sm90, grouping=g),
             {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16", "float32"], "mainloop": ["dequant"]},
             archs=("sm_90a",))
      for g in ("m", "k")),
    # the fast 2d-2d build writing (2, G, N / 2, K) (grouped_mm_wgrad(..., split_halves=True): W13's dW1, dW3)
    Family("gemm_sm90_fast_mode_grouped_k_split_halves",
           functools.partial(jit.compile_gemm_sm90, grouping="k", split_halves=True, block_k=128, n_tile=192),
           {**_GEMM_E4M3, "out_dtype": ["bfloat16", "float32"], "mainloop": ["promote"]}, archs=("sm_90a",)),
    # ... the 2d-2d builds the ops run for a bf16 output with K % 8 == 0: the split-N tile TMA-stored from shared
    # memory (ops.gemm_sm90.WGRAD_TMA_STORE), in both output layouts
    *(Family(f"gemm_sm90_fast_mode_grouped_k{'_split_halves' if halves else ''}_tma_store",
             functools.partial(jit.compile_gemm_sm90, grouping="k", split_halves=halves, block_k=128, n_tile=192,
                               tma_store=True),
             {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16"], "mainloop": ["promote"]},
             archs=("sm_90a",))
      for halves in (False, True)),
    *(Family(f"gemm_sm90_{epi}{'_hp' if hp else ''}_{elem}_{mode}",
             functools.partial(jit.compile_gemm_sm90, epilogue=epi, cast_elem=elem, scale_mode=mode, emit_hp=hp),
             {**_GEMM_E4M3, "out_dtype": ["bfloat16"], "mainloop": ["dequant"]}, archs=("sm_90a",))
      for epi in ("swiglu", "dswiglu") for hp in (False, True) for elem, mode in (("e4m3", "rceil"), ("e5m2", "floor"))),
    Family("gemm_sm100", jit.compile_gemm_sm100,
           {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16", "float32"], "n_tile": [128, 256]},
           archs=jit.SM100_ARCHS),
    # 2-CTA MMAs and clusters (TMA multicast), then the fused SwiGLU / dSwiGLU epilogues, 1-CTA and in the
    # configuration the ops run (2-CTA, cluster (2, 2))
    *(Family(f"gemm_sm100_{'2cta' if pair else '1cta'}_cluster{m}x{n}",
             functools.partial(jit.compile_gemm_sm100, cta_pair=pair, cluster_mn=(m, n)),
             {**_GEMM_E4M3, "out_dtype": ["bfloat16", "float32"], "n_tile": [128, 256]}, archs=jit.SM100_ARCHS)
      for pair, (m, n) in ((True, (2, 1)), (True, (4, 1)), (True, (2, 2)), (False, (2, 1)), (False, (1, 2)))),
    # 2d-3d token groups, in the ops' configuration: plain, then the fused epilogues
    Family("gemm_sm100_grouped_2d3d_2cta_cluster2x2",
           functools.partial(jit.compile_gemm_sm100, cta_pair=True, cluster_mn=(2, 2), grouping="m"),
           {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16", "float32"], "n_tile": [128]},
           archs=jit.SM100_ARCHS),
    # 2d-2d (wgrad) token groups, in the ops' configuration (1-CTA, cluster (1, 2))
    Family("gemm_sm100_grouped_2d2d_1cta_cluster1x2",
           functools.partial(jit.compile_gemm_sm100, cta_pair=False, cluster_mn=(1, 2), grouping="k"),
           {"a_elem": ELEMS, "b_elem": ELEMS, "out_dtype": ["bfloat16", "float32"], "n_tile": [128]},
           archs=jit.SM100_ARCHS),
    *(Family(f"gemm_sm100_grouped_2d3d_{epi}_2cta_cluster2x2",
             functools.partial(jit.compile_gemm_sm100, epilogue=epi, cta_pair=True, cluster_mn=(2, 2), grouping="m"),
             {**_GEMM_E4M3, "out_dtype": ["bfloat16"], "n_tile": [128]}, archs=jit.SM100_ARCHS)
      for epi in ("swiglu", "dswiglu")),
    *(Family(f"gemm_sm100_{epi}{'_2cta_cluster2x2' if pair else ''}{'_hp' if hp else ''}_{elem}_{mode}",
             functools.partial(jit.compile_gemm_sm100, epilogue=epi, cast_elem=elem, scale_mode=mode, emit_hp=hp,
                               cta_pair=pair, cluster_mn=(2, 2) if pair else (1, 1)),
             {**_GEMM_E4M3, "out_dtype": ["bfloat16"], "n_tile": [128, 256]}, archs=jit.SM100_ARCHS)
      for epi in ("swiglu", "dswiglu") for pair in (False, True) for hp in (False, True)
      for elem, mode in (("e4m3", "rceil"), ("e5m2", "floor"))),
]

SPILLS = r"(?:LDL|STL)\b"
# column -> regex matched at the start of each full SASS opcode
SASS_COLUMNS = {
    "F2FP.fp8": r"F2FP\.(?:\w+\.)*E[45]M[23]",  # hardware RNE + saturating fp8 conversion
    "LDG.128": r"LDG\.E\.128\b", "LDG.64": r"LDG\.E\.64\b", "LDG.narrow": r"LDG\.E(?!\.(?:128|64)\b)",
    "STG.128": r"STG\.E\.128\b", "STG.64": r"STG\.E\.64\b", "STG.narrow": r"STG\.E(?!\.(?:128|64)\b)",
    "LDS": r"LDS\b", "STS": r"STS\b", "STSM": r"STSM\b", "SHFL": r"SHFL\.", "BAR": r"BAR\.",
    "UTMALDG": r"UTMALDG\b", "UTMASTG": r"UTMASTG\b", "UTCCP": r"UTCCP\b", "UTCQMMA": r"UTCQMMA\b",
    "UTCHMMA": r"UTCHMMA\b", "QGMMA": r"QGMMA\b", "HGMMA": r"HGMMA\b",
    "USETMAXREG": r"USETMAXREG\b",  # the warpgroups' register budgets, as the PTX's setmaxnreg asks
}
PTX_COLUMNS = {
    "cvt.satfinite": r"cvt\.rn\.satfinite\.e[45]m[23]x2\.f32",
    "ld.global.128b": r"ld\.global(?:\.nc)?\.(?:v4\.[bfu]32|v2\.[bfu]64)",
    "st.global.vec": r"st\.global\.v[24]\.[bu](?:32|64)",
    "ld/st.shared": r"(?:ld|st)\.shared",
    "bar.sync": r"bar\.sync",
    "local": r"\.local",
    "setmaxnreg": r"setmaxnreg\.",
}
SASS_HINT = 'SASS columns (LDL/STL spills, instruction counts) need nvdisasm: pip install -e ".[sass]"'


def variants(arch: str | None = None, pairwise: bool = False,
             shard: tuple[int, int] | None = None) -> list[tuple[Family, dict]]:
    """Every (family, arguments) pair, or those of the families built for ``arch``; ``pairwise``: each family's
    :meth:`Family.pairwise_variants` only; ``shard=(k, n)``: of those, every n-th from the k-th (the n shards
    partition the list; a family's variants land in consecutive shards).  ValueError unless k, n are ints with
    0 <= k < n."""
    todo = [(family, args) for family in FAMILIES if arch is None or arch in family.archs
            for args in (family.pairwise_variants() if pairwise else family.variants())]
    if shard is not None:
        k, n = shard
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in shard) or not 0 <= k < n:
            raise ValueError(f"shard=(k, n) needs ints with 0 <= k < n, got {shard!r}")
        todo = todo[k::n]
    return todo


def _error(e: Exception) -> str:
    text = str(e).strip()
    return f"error: {type(e).__name__}: {text.splitlines()[0][:120] if text else ''}"


def compile_variant(arch: str, family: Family, args: dict) -> tuple[dict, object]:
    """The row's identity and CUBIN/PTX facts, and the compiled function (``None`` if it failed)."""
    row = {"kernel": family.kernel, "variant": family.label(args), **args}
    try:
        fn = family.build(args, arch)
    except Exception as e:  # report, do not stop: one broken variant should not hide the others
        row["status"] = _error(e)
        return row, None
    ptx = fn.__ptx__
    row["status"] = "ok" if re.search(rf"\.target\s+{arch}\b", ptx) else "wrong target"
    resources = sass_facts.cubin_resources(fn.__cubin__).values()
    smem = getattr(fn, "launch_smem", (None,))
    row.update(kernels=len(resources), regs=max(r["regs"] for r in resources),
               smem_static=max(r["smem_static"] for r in resources),
               smem_dynamic=None if None in smem else max(smem), local_frame=max(r["local_frame"] for r in resources))
    row.update({name: len(re.findall(pat, ptx)) for name, pat in PTX_COLUMNS.items()})
    return row, fn


def add_sass(row: dict, sass: str) -> None:
    ops = sass_facts.opcode_counts(sass)
    row["LDL/STL"] = sum(n for op, n in ops.items() if re.match(SPILLS, op))
    row.update({name: sum(n for op, n in ops.items() if re.match(pat, op)) for name, pat in SASS_COLUMNS.items()})
    row["sass_opcodes"] = dict(sorted(ops.items()))


def finish(row: dict) -> dict:
    if row["status"] == "ok" and (row.get("local_frame") or row.get("local") or row.get("LDL/STL")):
        row["status"] = "local memory (spills)"
    if row["status"] == "ok" and row.get("USETMAXREG", row.get("setmaxnreg")) != row.get("setmaxnreg"):
        # ptxas drops every setmaxnreg when it cannot tell the entry register count (C7508, printed only by
        # ptxas -v): the warpgroups then share the launch's flat budget (fix: launch with min_blocks_per_mp=1)
        row["status"] = "setmaxnreg dropped by ptxas (C7508)"
    return row


def _compile_in_worker(arch: str, family: Family, args: dict) -> tuple[dict, bytes | None]:
    """Worker process: compile one variant; the row and the CUBIN (picklable)."""
    row, fn = compile_variant(arch, family, args)
    return row, None if fn is None else fn.__cubin__


def inspect_all(arch: str, with_sass: bool, jobs: int = 1, pairwise: bool = False,
                shard: tuple[int, int] | None = None) -> list[dict]:
    """Compile every variant (``pairwise``, ``shard``: :func:`variants`' subsets), in ``jobs`` processes (1: in this
    one), with a progress bar on stderr (so --json and the table stay clean); disassemble the CUBINs on worker
    threads while the next ones compile.  Rows come back in registry order whatever the completion order."""
    from tqdm import tqdm

    todo = variants(arch, pairwise, shard)
    rows: list[dict | None] = [None] * len(todo)
    cubins: list[bytes | None] = [None] * len(todo)
    bar = tqdm(total=len(todo), desc=f"compiling for {arch}", unit="variant", leave=False,
               disable=None)  # (None: no bar when stderr is not a terminal, e.g. CI logs)
    if jobs <= 1:
        for i, (family, args) in enumerate(todo):
            row, fn = compile_variant(arch, family, args)
            rows[i], cubins[i] = row, None if fn is None else fn.__cubin__
            bar.update()
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh DSL per worker: no state forked mid-compile
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_compile_in_worker, arch, family, args): i for i, (family, args) in enumerate(todo)}
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                try:
                    rows[i], cubins[i] = future.result()
                except Exception as e:  # noqa: BLE001 -- a crashed worker is reported like a compile failure
                    family, args = todo[i]
                    rows[i] = {"kernel": family.kernel, "variant": family.label(args), **args, "status": _error(e)}
                bar.update()
    bar.close()
    if with_sass:
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            pending = [(row, pool.submit(sass_facts.disassemble, cubin)) for row, cubin in zip(rows, cubins)
                       if cubin is not None]
            for row, future in pending:
                try:
                    add_sass(row, future.result())
                except Exception as e:  # noqa: BLE001 -- a tool failure is reported like a compile failure
                    row["status"] = _error(e)
    return [finish(row) for row in rows]


def _smem(row: dict) -> str:
    dynamic = "?" if row.get("smem_dynamic") is None else row["smem_dynamic"]
    return f"{row['smem_static']}+{dynamic}" if "smem_static" in row else ""


def table(rows: list[dict], with_sass: bool) -> tuple[list[str], list[list]]:
    counts = [c for c in SASS_COLUMNS if any(r.get(c) for r in rows)] if with_sass else list(PTX_COLUMNS)
    cols = ["kernel", "variant", "status", "regs", "smem", "local_frame", *(["LDL/STL"] if with_sass else []),
            *counts]
    body = [[_smem(r) if c == "smem" else r.get(c, "") for c in cols] for r in rows]
    return cols, body


def main(args) -> int:
    from tabulate import tabulate

    problem = output_file_problem("--json", args.json)  # (before minutes of compiling)
    if problem:
        raise SystemExit(f"inspect: {problem}")
    pairwise, shard = getattr(args, "pairwise", False), getattr(args, "shard", None)
    if shard is not None:
        total = len(variants(args.arch, pairwise))
        if shard[0] >= total:
            raise SystemExit(f"inspect: --shard {shard[0]}/{shard[1]} is empty: the list holds {total} variants, so "
                             f"K must be below {total} (and N at most {total} for every shard to hold one)")
    with_sass = sass_facts.find_nvdisasm() is not None
    rows = inspect_all(args.arch, with_sass, getattr(args, "jobs", None) or os.cpu_count() or 1, pairwise, shard)
    part = f" (shard {shard[0]}/{shard[1]})" if shard else ""
    print(f"arch {args.arch}{part}: {sum(r['status'] == 'ok' for r in rows)}/{len(rows)} variants compiled")
    if not with_sass:
        print(SASS_HINT)
    cols, body = table(rows, with_sass)
    print(tabulate(body, headers=cols))
    print("smem = static (CUBIN) + dynamic (launch) bytes per CTA; local_frame = local memory bytes per thread")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "pairwise": pairwise, "shard": shard,
                       "sass": with_sass, "rows": rows}, f, indent=2)
    return 0 if all(r["status"] == "ok" for r in rows) else 1
