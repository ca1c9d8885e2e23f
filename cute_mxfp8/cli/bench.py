"""``python -m cute_mxfp8 bench [GROUP ...]``: per-op timing on every backend this machine can run.

Groups: ``quantize`` (rowwise / colwise / dual casts), ``swiglu`` (fused SwiGLU + dual quant, fwd and bwd),
``gemm`` (dense at 8192³, 16384x7168x2048 and 16384x2048x7168, the MLP's GEMM1 / w2-dgrad with their fused SwiGLU
epilogues at M=16384 D=4096 I=14336, 2d-3d and 2d-2d grouped), ``mlp`` (a SwiGLU MLP and grouped experts training
step, bf16 vs MXFP8, :mod:`cute_mxfp8.cli.bench_mlp`).  Reports the median time, GB/s for the bytes the op must move
(read + written), TFLOP/s for GEMMs and, on SM100, % of the 4.5 PFLOP/s dense MXFP8 peak.  On CPU only the ``reference`` backend runs, at small shapes; GPU shapes are the
ones the kernel issues name.  Timing: CUDA -> ``triton.testing.do_bench`` (median) when triton is installed,
else CUDA events; CPU -> wall clock median.  Numbers from the reference backend measure torch emulation, not kernels.

On a GPU, baseline rows do the same work another way: torchao's ``to_mx`` under torch.compile (quantize), cuBLAS's
MXFP8 GEMM (``torch._scaled_mm``, SM100 only) for dense ``mm``, the GEMM to fp32 followed by the standalone fused
cast for the fused-epilogue GEMMs, and the unfused path the fused SwiGLU kernels replace (compiled SwiGLU / its gradient written in bf16, then a rowwise and a
colwise cast).  Their GB/s counts the fused op's bytes; the "vs baseline" column of a kernel row is the case's
first baseline time over the kernel's time (the speed-up).  Baselines compile with ``dynamic=False``: one static
graph per shape, as a training run with fixed shapes gets (the default would turn the second shape into a
dynamic-shape graph, which is slower and flatters the kernels).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from cute_mxfp8.cli.checks import device_problem, output_file_problem

GROUPS = ("quantize", "swiglu", "gemm", "mlp")
_FP8_OUT = 1.0 + 1.0 / 32  # bytes per element written by one MXFP8 cast: data + one E8M0 scale per 32


@dataclass
class Row:
    group: str
    op: str
    backend: str
    shape: str
    ms: float
    gbps: float
    tflops: float | None
    speedup: float | None = None  # the case's first baseline time / this row's time (kernel backends only)


@dataclass
class Case:
    group: str
    op: str
    shape: str
    make: Callable[[torch.device], tuple]  # -> (callable(backend) -> None, bytes moved, flops or None)


def _block_32_baseline(fn, dev, *inputs) -> dict:
    """The same cast in MX 32-blocks (automatic backend): the baseline of a ``scale_block=128`` (Hopper fast mode)
    row, so its "vs baseline" is the 128-block cast's cost against the one-pass MXFP8 cast."""
    return {"same op, 32-blocks (automatic)": lambda: fn(*inputs)} if dev.type == "cuda" else {}


def _quantize_cases(large: bool, scale_block: int = 32) -> list[Case]:
    # 2-D activations (M, K) and a 3-D expert weight (E, N, K): rowwise along K, colwise along N
    shapes = [(16384, 16384), (16384, 7168), (65536, 2048), (8, 7168, 2048)] if large else [(1024, 1024), (4096, 256),
                                                                                          (4, 256, 128)]
    cases = []
    for shape in shapes:
        def make(dev, shape=shape, which="rowwise"):
            x = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
            fn = {"rowwise": _q.quantize_rowwise, "colwise": _q.quantize_colwise, "dual": _q.quantize_dual}[which]
            writes = 2 if which == "dual" else 1

            def run(b):
                return fn(x, backend=b, scale_block=scale_block)
            if scale_block != 32:
                run.baselines = _block_32_baseline(fn, dev, x)
            elif (ao := _torchao_to_mx(f"quantize_{which}", dev)) is not None:
                run.baselines = {"torchao.to_mx+compile": lambda: ao(x)}
            return run, x.numel() * (2 + writes * _FP8_OUT), None
        for which in ("rowwise", "colwise", "dual"):
            cases.append(Case("quantize", f"quantize_{which}", "x".join(map(str, shape)),
                              lambda dev, s=shape, w=which: make(dev, s, w)))
    return cases


def _torchao_to_mx(op: str, device: torch.device):
    """torchao's ``to_mx`` under ``torch.compile`` for the same cast (rowwise; colwise as ``to_mx`` of the
    transpose; dual as both), or None when torchao is not installed: the comparison the quantize issue names."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        return None
    if device.type != "cuda" or op not in ("quantize_rowwise", "quantize_colwise", "quantize_dual"):
        return None

    def rowwise(x):
        return to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)

    def colwise(x):
        return to_mx(x.transpose(-1, -2).contiguous(), torch.float8_e4m3fn, 32,
                     scaling_mode=ScaleCalculationMode.RCEIL)

    body = {"quantize_rowwise": rowwise, "quantize_colwise": colwise,
            "quantize_dual": lambda x: (rowwise(x), colwise(x))}[op]
    return torch.compile(body, dynamic=False)


def _swiglu_cases(large: bool, scale_block: int = 32) -> list[Case]:
    shapes = [(16384, 4096), (65536, 1536), (8192, 14336)] if large else [(1024, 512)]
    cases = []
    for m, i in shapes:
        def fwd(dev, m=m, i=i):
            h13 = torch.randn(m, 2 * i, device=dev, dtype=torch.bfloat16)

            def run(b):
                return _q.swiglu_quant(h13, backend=b, scale_block=scale_block)
            if scale_block != 32:
                run.baselines = _block_32_baseline(_q.swiglu_quant, dev, h13)
            elif dev.type == "cuda":
                run.baselines = {"unfused: compiled SwiGLU + 2 casts": lambda: _unfused(_swiglu_hp(), h13)}
            return run, m * i * (4 + 2 * _FP8_OUT), None

        def bwd(dev, m=m, i=i):
            dh = torch.randn(m, i, device=dev, dtype=torch.bfloat16)
            h13 = torch.randn(m, 2 * i, device=dev, dtype=torch.bfloat16)

            def run(b):
                return _q.dswiglu_quant(dh, h13, backend=b, scale_block=scale_block)
            if scale_block != 32:
                run.baselines = _block_32_baseline(_q.dswiglu_quant, dev, dh, h13)
            elif dev.type == "cuda":
                run.baselines = {"unfused: compiled dSwiGLU + 2 casts": lambda: _unfused(_dswiglu_hp(), dh, h13)}
            return run, m * i * (2 + 4 + 4 * _FP8_OUT), None
        cases += [Case("swiglu", "swiglu_quant", f"{m}x{i}", fwd), Case("swiglu", "dswiglu_quant", f"{m}x{i}", bwd)]
    return cases


@functools.lru_cache(maxsize=None)
def _swiglu_hp():
    """torch.compile of the SwiGLU math writing h in the input dtype: the first half of the unfused path."""
    from cute_mxfp8.swiglu import split_gate_up, swiglu

    return torch.compile(lambda h13: swiglu(*split_gate_up(h13)).to(h13.dtype), dynamic=False)


@functools.lru_cache(maxsize=None)
def _dswiglu_hp():
    from cute_mxfp8.swiglu import dswiglu, pack_gate_up, split_gate_up

    return torch.compile(lambda dh, h13: pack_gate_up(*dswiglu(dh, *split_gate_up(h13))).to(dh.dtype),
                         dynamic=False)


def _unfused(math, *inputs):
    """The path the fused kernels replace: the activation (or its gradient) written in high precision, then read
    again by a rowwise and a colwise cast (automatic backend)."""
    hp = math(*inputs)
    return _q.quantize_rowwise(hp), _q.quantize_colwise(hp)


# Dense MXFP8 tensor-core peak by compute capability major (TFLOP/s): B200 (NVIDIA's B200 datasheet, dense).  Where a GPU has
# none listed (the H200 has no MXFP8 MMA), the "% peak" column stays empty.
MXFP8_PEAK_TFLOPS = {10: 4500.0}


def _cublas_mx(a, a_s, b, b_s, out_dtype=torch.bfloat16):
    """cuBLAS's MXFP8 GEMM (``torch._scaled_mm`` with blocked E8M0 scales; SM100 only)."""
    return lambda: torch._scaled_mm(a, b.t(), scale_a=a_s, scale_b=b_s, out_dtype=out_dtype)


def _gemm_cases(large: bool) -> list[Case]:
    dense_shapes = [(8192, 8192, 8192), (16384, 7168, 2048), (16384, 2048, 7168)] if large else [(512, 512, 512)]
    m_mlp, d_mlp, i_mlp = (16384, 4096, 14336) if large else (256, 256, 512)  # tokens, model dim, hidden
    m, n, k, g = (8192, 8192, 8192, 8) if large else (512, 512, 512, 4)
    cases = []

    for dm, dn, dk in dense_shapes:
        def dense(dev, m=dm, n=dn, k=dk):
            a, a_s = _q.quantize_rowwise(torch.randn(m, k, device=dev))
            b, b_s = _q.quantize_rowwise(torch.randn(n, k, device=dev))
            fn = lambda be: _q.mm(a, a_s, b, b_s, backend=be)  # noqa: E731
            if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] == 10:
                fn.baselines = {"cuBLAS _scaled_mm": _cublas_mx(a, a_s, b, b_s)}
            elif dev.type == "cuda":  # no MXFP8 in cuBLAS before SM100: the bf16 GEMM is the bar to beat
                from cute_mxfp8.cli.bench_baselines import sm90_dense_baselines

                fn.baselines = sm90_dense_baselines(a, a_s, b, b_s, SKIPPED_BASELINES)
            return fn, (m * k + n * k) * _FP8_OUT + 2 * m * n, 2 * m * n * k
        cases.append(Case("gemm", "mm", f"{dm}x{dn}x{dk}", dense))

    def mlp_gemm1(dev, m=m_mlp, d=d_mlp, i=i_mlp):
        """GEMM1 + SwiGLU + dual cast of h; baseline: the GEMM to fp32, then the standalone fused cast."""
        from cute_mxfp8.swiglu import GATE_UP_TILE

        x, x_s = _q.quantize_rowwise(torch.randn(m, d, device=dev))
        w13, w13_s, _, _ = _q.quantize_gate_up(torch.randn(i, d, device=dev), torch.randn(i, d, device=dev),
                                               gate_up_tile=GATE_UP_TILE)
        fn = lambda be: _q.mm_swiglu_quant(x, x_s, w13, w13_s, gate_up_tile=GATE_UP_TILE, backend=be)  # noqa: E731
        # (the baseline reads the interleaved accumulator as if concatenated: the same work, for timing only)
        fn.baselines = {"unfused (mm fp32 + swiglu_quant)": lambda: _q.swiglu_quant(
            _q.mm(x, x_s, w13, w13_s, out_dtype=torch.float32))}
        return fn, (m * d + 2 * i * d) * _FP8_OUT + m * 2 * i * 2 + 2 * m * i * _FP8_OUT, 2 * m * 2 * i * d

    def mlp_gemm3(dev, m=m_mlp, d=d_mlp, i=i_mlp):
        """w2 dgrad + dSwiGLU + dual cast of dh13; baseline: the GEMM to fp32, then the standalone fused cast."""
        from cute_mxfp8.swiglu import GATE_UP_TILE

        dy, dy_s = _q.quantize_rowwise(torch.randn(m, d, device=dev))
        w2c, w2c_s = _q.quantize_rowwise(torch.randn(i, d, device=dev))
        h13 = torch.randn(m, 2 * i, device=dev, dtype=torch.bfloat16)
        fn = lambda be: _q.mm_dswiglu_quant(dy, dy_s, w2c, w2c_s, h13, gate_up_tile=GATE_UP_TILE, backend=be)  # noqa: E731
        fn.baselines = {"unfused (mm fp32 + dswiglu_quant)": lambda: _q.dswiglu_quant(
            _q.mm(dy, dy_s, w2c, w2c_s, out_dtype=torch.float32), h13.float())}
        nbytes = (m * d + i * d) * _FP8_OUT + m * 2 * i * 2 + 2 * m * 2 * i * _FP8_OUT
        return fn, nbytes, 2 * m * i * d

    cases += [Case("gemm", "mm_swiglu_quant", f"M={m_mlp} D={d_mlp} I={i_mlp}", mlp_gemm1),
              Case("gemm", "mm_dswiglu_quant", f"M={m_mlp} D={d_mlp} I={i_mlp}", mlp_gemm3)]

    grouped_shapes = [(65536, 7168, 2048, 8), (32768, 1536, 2048, 8), (32768, 2048, 1536, 8)] if large else \
        [(512, 512, 512, 4)]

    def offsets(dev, m, g):
        return torch.linspace(m / g, m, g, device=dev).round().to(torch.int32)

    def grouped(dev, m, n, k, g):
        offs = offsets(dev, m, g)
        x, w = torch.randn(m, k, device=dev), torch.randn(g, n, k, device=dev)
        a, a_s = _q.quantize_rowwise(x, offs=offs)
        b, b_s = _q.quantize_rowwise(w)
        fn = lambda be: _q.grouped_mm(a, a_s, b, b_s, offs, backend=be)  # noqa: E731
        if dev.type == "cuda":
            xb, wb = x.bfloat16(), w.bfloat16().transpose(1, 2)
            fn.baselines = _grouped_baseline("bf16 torch._grouped_mm", lambda: torch._grouped_mm(xb, wb, offs=offs))
        return fn, (m * k + g * n * k) * _FP8_OUT + 2 * m * n, 2 * m * n * k

    def wgrad(dev, m, n, k, g):
        offs = offsets(dev, m, g)
        dy, x = torch.randn(m, n, device=dev), torch.randn(m, k, device=dev)
        a, a_s = _q.quantize_colwise(dy, offs=offs)
        b, b_s = _q.quantize_colwise(x, offs=offs)
        fn = lambda be: _q.grouped_mm_wgrad(a, a_s, b, b_s, offs, backend=be)  # noqa: E731
        if dev.type == "cuda":
            dyt, xb = dy.bfloat16().t(), x.bfloat16()
            fn.baselines = _grouped_baseline("bf16 torch._grouped_mm", lambda: torch._grouped_mm(dyt, xb, offs=offs))
        return fn, (m * k + m * n) * _FP8_OUT + 4 * g * n * k, 2 * m * n * k

    for m, n, k, g in grouped_shapes:
        cases += [Case("gemm", "grouped_mm", f"{m}x{n}x{k} G={g}", functools.partial(grouped, m=m, n=n, k=k, g=g)),
                  Case("gemm", "grouped_mm_wgrad", f"{m}x{n}x{k} G={g}",
                       functools.partial(wgrad, m=m, n=n, k=k, g=g))]
    return cases


def _grouped_baseline(name: str, fn: Callable[[], object]) -> dict:
    """``{name: fn}`` when ``fn`` runs on this GPU (bf16 ``torch._grouped_mm`` needs SM90+ and a recent torch),
    else ``{}`` with the reason recorded in :data:`SKIPPED_BASELINES`."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        SKIPPED_BASELINES[name] = f"{type(e).__name__}: {e}"[:200]
        return {}
    return {name: fn}


def device_copy_gbps(device: torch.device) -> float:
    """GB/s (read + write bytes) of a 1 GiB bf16 device-to-device copy on ``device`` (CUDA), timed as the ops are:
    the ceiling memory-bound kernels are judged against in the same run."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / _time_ms(lambda: dst.copy_(src), device, 1.0) / 1e6


def _time_ms(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
            return float(do_bench(fn, return_mode="median"))
        except ImportError:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()
            times = []
            for _ in range(20):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)
    fn()  # warm-up
    times, t_end = [], time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


_q = None  # cute_mxfp8.ops, imported lazily by main()
# the fields of each ``mlp_steps`` row of the JSON, in order (bench_mlp.mlp_rows)
MLP_STEP_FIELDS = ["workload", "shape", "bf16_ms", "mxfp8_ms", "mxfp8_over_bf16", "bf16_peak_mib", "mxfp8_peak_mib",
                   "ratio_lowest", "ratio_highest", "bf16_ms_per_round", "mxfp8_ms_per_round",
                   "ratio_bf16_first", "ratio_mxfp8_first"]
SKIPPED_BASELINES: dict[str, str] = {}  # baseline name -> why it did not run here


def launch_overhead_us(device: torch.device, calls: int = 2000) -> dict:
    """Host time per call (microseconds) of a tiny rowwise cast (128 x 128 bf16, blocked), at three levels: the
    compiled kernel called through TVM-FFI with torch tensors, the ``torch.ops.cute_mxfp8`` custom op, and the
    documented wrapper.  Measured as wall time of ``calls`` back-to-back calls then one synchronize, so it is the
    Python + dispatch + launch cost (the GPU work of each call is a few microseconds and overlaps)."""
    from cute_mxfp8.jit import SM100_TARGET, compile_quant
    from cute_mxfp8.ops.backends import resolve_backend

    x = torch.randn(128, 128, device=device, dtype=torch.bfloat16)
    backend = resolve_backend(device, None, "quantize_rowwise", (x, "rceil", torch.float8_e4m3fn, True, None))
    if backend == "reference":
        return {}
    arch = {"sm90": "sm_90a", "sm100": SM100_TARGET}[backend]
    kernel = compile_quant("rowwise", "bfloat16", "e4m3", "rceil", True, arch)
    q, s = torch.empty(128, 128, dtype=torch.float8_e4m3fn, device=device), torch.zeros(512, dtype=torch.uint8,
                                                                                        device=device)
    levels = {"kernel (TVM-FFI call)": lambda: kernel(x, q, s),
              "torch.ops.cute_mxfp8.quantize_rowwise": lambda: torch.ops.cute_mxfp8.quantize_rowwise(
                  x, "rceil", torch.float8_e4m3fn, True, None, ""),
              "cute_mxfp8.ops.quantize_rowwise": lambda: _q.quantize_rowwise(x)}
    out = {}
    for name, fn in levels.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    return out


def main(args) -> int:
    global _q
    from tabulate import tabulate

    from cute_mxfp8 import ops
    from cute_mxfp8.ops.backends import _BACKENDS

    _q = ops
    asked = getattr(args, "device", None)
    if asked == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda, but this torch sees no CUDA GPU: drop --device (cpu here)")
    problem = device_problem(asked) if asked is not None else None
    if problem:
        raise SystemExit(f"bench: {problem}")
    device = torch.device(asked if asked not in (None, "auto") else "cuda" if torch.cuda.is_available() else "cpu")
    groups = list(getattr(args, "groups", None) or GROUPS)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown bench group(s) {unknown}; choose from {GROUPS}")
    plot = getattr(args, "plot", None)
    for flag, path in (("--json", getattr(args, "json", None)), ("--plot", plot)):
        problem = output_file_problem(flag, path)
        if problem:
            raise SystemExit(f"bench: {problem}")
    if plot and getattr(args, "json", None) and os.path.abspath(plot) == os.path.abspath(args.json):
        raise SystemExit(f"bench: --json and --plot name one file ({plot}): the chart would overwrite the results")
    if plot:
        from cute_mxfp8.cli.bench_plot import path_problem

        problem = path_problem(plot)
        if problem:
            raise SystemExit(f"bench: --plot {plot}: {problem}")
    if plot and not {"gemm", "mlp"} & set(groups):
        raise SystemExit(f"bench: --plot draws the gemm group's TFLOP/s and the mlp group's step times; {groups} "
                         f"have neither: add gemm or mlp, or drop --plot")
    if getattr(args, "profile", 0) and "mlp" not in groups:
        print(f"bench: --profile applies to the mlp group only; ignored for {groups}")
    if getattr(args, "rounds", None) is not None and "mlp" not in groups:
        print(f"bench: --rounds applies to the mlp group only; ignored for {groups}")
    rounds = getattr(args, "rounds", None) or 4  # (None: not given; the mlp group's default, even: see mlp_rows)
    if rounds % 2 and "mlp" in groups:
        print(f"bench: --rounds {rounds} is odd: bf16 runs first in "
              + ("the only round" if rounds == 1 else "one round more than MXFP8")
              + " (the step timed second can run slower); an even count balances the order")
    large = device.type == "cuda"
    hopper_block_k = getattr(args, "hopper_block_k", 32) or 32
    weight_blocks = getattr(args, "hopper_weight_blocks", "1x128") or "1x128"
    if weight_blocks != "1x128" and hopper_block_k != 128:
        raise SystemExit("bench: --hopper-weight-blocks 128x128 needs --hopper-block-k 128")
    if weight_blocks != "1x128" and any(g != "mlp" for g in groups):
        print("bench: --hopper-weight-blocks applies to the mlp group only (its modules' weights); ignored for "
              f"{[g for g in groups if g != 'mlp']}")
    if hopper_block_k != 32 and "gemm" in groups:
        print("bench: --hopper-block-k does not apply to the gemm group (its operands are MX 32-block casts); the "
              "fast mode's GEMM: python tools/fast_mode_gemm.py")
    cases = []
    for g in groups:
        if g in ("quantize", "swiglu"):
            cases += {"quantize": _quantize_cases, "swiglu": _swiglu_cases}[g](large, hopper_block_k)
        elif g == "gemm":
            cases += _gemm_cases(large)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"backends registered: {ops.registered_backends()}")
    for name in ops.registered_backends():
        why = _BACKENDS[name].unavailable_reason(device)
        if why:
            print(f"  {name}: not run ({why})")
    copy_gbps = None
    if device.type == "cuda":  # the ceiling memory-bound ops are judged against, measured in this run
        copy_gbps = device_copy_gbps(device)
        print(f"device copy bandwidth (1 GiB bf16 copy): {copy_gbps:.0f} GB/s")
    rows: list[Row] = []
    from tqdm import tqdm

    for case in tqdm(cases, desc="bench", unit="case", leave=False, disable=None):  # stderr; off when not a tty
        fn, nbytes, flops = case.make(device)
        base_ms = None
        for name, baseline in getattr(fn, "baselines", {}).items():  # the same inputs through another path
            ms = _time_ms(baseline, device, budget_s=1.0)
            base_ms = ms if base_ms is None else base_ms
            rows.append(Row(case.group, case.op, name, case.shape, ms, nbytes / ms / 1e6,
                            None if flops is None else flops / ms / 1e9))
        for backend in ops.registered_backends():
            b = _BACKENDS[backend]
            if case.op not in b.ops or b.unavailable_reason(device) is not None:
                continue
            ms = _time_ms(lambda: fn(backend), device, budget_s=1.0)
            rows.append(Row(case.group, case.op, backend, case.shape, ms, nbytes / ms / 1e6,
                            None if flops is None else flops / ms / 1e9,
                            None if base_ms is None or backend == "reference" else base_ms / ms))
    for name, why in SKIPPED_BASELINES.items():
        print(f"baseline not run: {name} ({why})")
    overhead = launch_overhead_us(device) if device.type == "cuda" and "quantize" in groups else {}
    for name, us in overhead.items():
        print(f"host time per call, {name}: {us:.1f} us")
    pct = (lambda r: "" if copy_gbps is None else f"{100 * r.gbps / copy_gbps:.0f}")
    peak = MXFP8_PEAK_TFLOPS.get(torch.cuda.get_device_capability(device)[0]) if device.type == "cuda" else None
    pct_peak = (lambda r: "" if peak is None or r.tflops is None else f"{100 * r.tflops / peak:.0f}")
    if rows:
        print(tabulate([[r.op, r.backend, r.shape, f"{r.ms:.3f}", f"{r.gbps:.3g}", pct(r),
                         "" if r.tflops is None else f"{r.tflops:.3g}", pct_peak(r),
                         "" if r.speedup is None else f"{r.speedup:.2f}x"] for r in rows],
                       headers=["op", "backend", "shape", "ms", "GB/s", "% copy", "TFLOP/s", "% MXFP8 peak",
                                "vs baseline"]))
    if "gemm" in groups and peak is None and device.type == "cuda":
        print("note: this GPU has no MXFP8 tensor cores: `mm` on sm90 is the WGMMA kernel (dequantize mainloop: bf16 "
              "WGMMA on operands scaled on the fly; 'sm90 promote mainloop' is the other design), its 'vs baseline' "
              "is against cuBLAS bf16; the other GEMM rows time the reference emulation; the tcgen05 kernels run "
              "on SM100 only (`python -m cute_mxfp8 inspect --arch sm_100f` reports their builds).")
    if device.type == "cpu":
        print("note: on CPU these time the torch reference (emulation), not kernels.")
    if hopper_block_k == 128 and any(g in groups for g in ("quantize", "swiglu")):
        print("quantize / swiglu rows: scale_block=128 casts (the Hopper fast mode's operands)"
              + ("; 'vs baseline' is against the same op in 32-blocks" if device.type == "cuda" else
                 " (no 'vs baseline' on the CPU: the baselines are GPU kernels)"))
    mlp = []
    if "mlp" in groups:
        from cute_mxfp8.cli.bench_mlp import mlp_rows

        from cute_mxfp8 import MXFP8Config

        mlp = mlp_rows(device, _time_ms, profile=getattr(args, "profile", 0) or 0,
                       config=MXFP8Config(hopper_block_k=hopper_block_k, hopper_weight_blocks=weight_blocks),
                       rounds=rounds)
        if hopper_block_k == 128:
            print(f"MXFP8 modules in the Hopper fast mode: MXFP8Config(hopper_block_k=128, hopper_weight_blocks="
                  f"{weight_blocks!r}) (SM100 ignores it)")
        print(tabulate([[w, s, f"{b:.2f}", f"{q:.2f}", f"{r:.3f}x", f"{lo:.3f}-{hi:.3f}",
                         f"{r0:.3f} / " + ("-" if r1 is None else f"{r1:.3f}"),
                         "" if pb is None else f"{pb:.0f}", "" if pq is None else f"{pq:.0f}"]
                        for w, s, b, q, r, pb, pq, lo, hi, _, _, r0, r1 in mlp],
                       headers=["fwd+bwd step", "shape", "bf16 ms", "MXFP8 ms", "MXFP8 / bf16",
                                f"ratio range ({rounds} rounds)", "ratio, bf16 first / MXFP8 first", "bf16 peak MiB",
                                "MXFP8 peak MiB"],
                       disable_numparse=True))
        footer = (f"step times: medians of {rounds} alternating rounds per step (bf16 / MXFP8 first in turn); the "
                  f"ratio: the median of the rounds' ratios (MXFP8 / bf16), also over the rounds of each order"
                  if rounds > 1 else "step times: one round per step, bf16 first")
        print(footer + ("" if device.type == "cuda" else "; peak memory is measured on CUDA only"))
    result = {"device": str(device), "copy_gbps": copy_gbps, "launch_overhead_us": overhead,
              "rows": [asdict(r) for r in rows], "mlp_steps": mlp, "skipped_baselines": SKIPPED_BASELINES,
              "mlp_hopper_block_k": hopper_block_k, "mlp_hopper_weight_blocks": weight_blocks,
              "mlp_rounds": rounds, "mlp_step_fields": MLP_STEP_FIELDS}
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if plot:
        from cute_mxfp8.cli.bench_plot import plot as draw

        draw(result, plot)
        print(f"chart written to {plot}")
    return 0
