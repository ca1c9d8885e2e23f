"""Host-side cost of one eager MXFP8 op call and CUDA-graph capture of the SwiGLU MLP (GPU only; a dev tool).

python tools/profile_host.py [--calls N] [--out DIR]: prints the per-call host time of the three levels the bench
reports, a cProfile of the documented wrapper (top functions by own time), and whether the dense MXFP8 SwiGLU MLP
forward + backward captures into CUDA graphs (torch.cuda.make_graphed_callables), with eager vs replay times.
``--grouped``: instead, the grouped experts step's wall / host / kernel time, launches and longest kernels (fast
mode, plain MXFP8, bf16), where the GPU idles between its kernels (:func:`step_gaps`) and where its host time
goes (:func:`grouped_step`; ``--weight-blocks 128x128`` for the fast mode's 128 x 128 weight blocks)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch


def _per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def breakdown(x, dev, calls: int) -> dict:
    """Each piece of the eager rowwise cast's planned path, timed alone (they add up to about the whole call)."""
    import os

    from cute_mxfp8 import ops
    from cute_mxfp8.ops import backends as B

    ops.quantize_rowwise(x)
    key = next(k for k in B.PLANS if k[0] == "quantize_rowwise" and k[1] == x.shape)
    run = B.PLANS[key]
    q, s = run(x)
    fp8, e8m0, u8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8
    pieces = {
        "whole ops.quantize_rowwise": lambda: ops.quantize_rowwise(x),
        "plan run(x) (2 empty + kernel + view)": lambda: run(x),
        "key tuple": lambda: ("quantize_rowwise", x.shape, x.dtype, x.device, "rceil", fp8, True, None,
                              os.environ.get(B.ENV_VAR)),
        "key tuple + PLANS.get": lambda: B.PLANS.get(("quantize_rowwise", x.shape, x.dtype, x.device, "rceil", fp8,
                                                      True, None, os.environ.get(B.ENV_VAR))),
        "os.environ.get": lambda: os.environ.get(B.ENV_VAR),
        "x.device": lambda: x.device,
        "checks (contiguous, ptr, grad, modes)": lambda: (
            x.is_contiguous() and not x.data_ptr() % 16 and not (x.requires_grad and torch.is_grad_enabled())
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._len_torch_dispatch_stack()),
        "torch.empty fp8 (128,128)": lambda: torch.empty((128, 128), dtype=fp8, device=dev),
        "torch.empty u8 (512,)": lambda: torch.empty((512,), dtype=u8, device=dev),
        "torch.empty e8m0 (512,)": lambda: torch.empty((512,), dtype=e8m0, device=dev),
        "s.view(e8m0)": lambda: s.view(u8).view(e8m0),
        "torch.empty one u8 buffer (16896,)": lambda: torch.empty((16896,), dtype=u8, device=dev),
        "buffer split (2 slices + 2 views)": lambda: (q.view(u8).reshape(-1)[:16384].view(fp8).view(128, 128),
                                                      q.view(u8).reshape(-1)[:512].view(e8m0)),
    }
    return {name: _per_call_us(fn, calls) for name, fn in pieces.items()}


def sampled_frames(step, steps: int) -> dict:
    """Share of samples (every ~0.2 ms, all threads: the backward runs on autograd's device thread) in which each
    ``file:function`` of the package is on some thread's stack while ``step`` runs ``steps`` times; unlike
    cProfile it sees through torch's dynamo-disable wrappers.  The shares say which functions are on the stack,
    not where the time goes: torch ops release the GIL, so the sampler lands on lines that call them whatever
    they cost (2026-12-02; cProfile of single ops in a loop measured their host time instead)."""
    import collections
    import os
    import sys
    import threading

    hits, samples, done = collections.Counter(), [0], threading.Event()

    def sample():
        me = threading.get_ident()  # the sampler's own thread is not sampled
        while not done.is_set():
            seen = set()
            for tid, frame in sys._current_frames().items():
                while frame is not None and tid != me:
                    if "cute_mxfp8" in frame.f_code.co_filename:
                        seen.add(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
                    frame = frame.f_back
            hits.update(seen)
            samples[0] += 1
            time.sleep(0.0002)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        done.set()
        th.join()
        sys.setswitchinterval(interval)
    return {k: v / max(samples[0], 1) for k, v in hits.most_common(40)}


def cpu_ops(step, steps: int, top: int = 45) -> list[list]:
    """Host time per step of each op (``torch.profiler`` CPU events over ``steps`` steps after a warm-up, the
    backward's autograd thread included): [name, calls, total CPU ms, self CPU ms] per step, by total."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [[e.key[:80], e.count / steps, e.cpu_time_total / steps / 1e3, e.self_cpu_time_total / steps / 1e3]
            for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def live_at_peak(step, dev, top: int = 25) -> dict:
    """The tensors alive at the peak of one ``step`` (after a warm-up), from torch's CUDA memory history: the peak
    above the memory allocated before the step, and the live blocks then, largest first, each with the
    ``cute_mxfp8`` (else torch) frame that allocated it."""
    import os

    step()
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    try:
        step()
        torch.cuda.synchronize(dev)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, cur, peak, at_peak = {}, 0, 0, {}
    for ev in snap["device_traces"][dev.index or 0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]

    def where(ev):
        frames = ev.get("frames", [])
        mine = [f for f in frames if "cute_mxfp8" in f["filename"]]
        f = (mine or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
        return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"

    rows = sorted(at_peak.values(), key=lambda e: -e["size"])
    return {"base_mib": base / 2**20, "peak_above_step_start_mib": peak / 2**20,
            "live": [[round(e["size"] / 2**20, 2), where(e)] for e in rows[:top]]}


# the ops the autograd functions call through cute_mxfp8.ops.api (per_op_host_us, step_timeline)
_API_OPS = ("quantize_dual", "quantize_rowwise", "quantize_gate_up", "grouped_mm", "grouped_mm_wgrad", "mm",
            "swiglu_quant", "dswiglu_quant", "padded_offsets")


def _idle_gpu_us(fn, reps: int) -> list[float]:
    """Host time (us) of ``reps`` calls of ``fn``, each queued on an idle GPU (synchronize, time until it returns)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times

def per_op_host_us(step, reps: int = 30) -> list[list]:
    """Host time of each op call one ``step`` makes through :mod:`cute_mxfp8.ops.api` (and the MLP's offsets
    priming): the calls are recorded during a step, then each is replayed ``reps`` times, each time queued on an
    idle GPU (synchronize, time until the call returns): [name, median us, min us] in step order."""
    from cute_mxfp8.ops import api
    from cute_mxfp8.ops import autograd as A

    calls, real = [], {}

    def spy(mod, name):
        fn = getattr(mod, name)
        real[(mod, name)] = fn

        def run(*args, **kw):
            calls.append((name, fn, args, kw, torch.is_grad_enabled()))
            return fn(*args, **kw)

        setattr(mod, name, run)

    for n in _API_OPS:
        spy(api, n)
    spy(A, "prime_fast_schedules")
    try:
        step()
        torch.cuda.synchronize()
    finally:
        for (mod, name), fn in real.items():
            setattr(mod, name, fn)
    rows = []
    for name, fn, args, kw, grad in calls:
        def call(fn=fn, args=args, kw=kw, grad=grad):  # in the grad mode of the step's call (the autograd
            with torch.set_grad_enabled(grad):  # Function runs its ops under no_grad: plans need it)
                return fn(*args, **kw)
        times = _idle_gpu_us(call, reps)  # called here, before the loop moves on
        rows.append([name, statistics.median(times), min(times)])
    torch.cuda.synchronize()
    return rows


def split_host_us(forward, x, dy, module, counts, reps: int = 30) -> dict:
    """Host time (median us, each part queued on an idle GPU) of the grouped step's forward, its backward, and the
    module's pieces outside the ops: the offsets from the counts, and the config / dispatch before the
    autograd Function runs."""
    from cute_mxfp8.nn.modules import device_offsets_from_counts
    from cute_mxfp8.ops import autograd as A

    def timed(fn):
        return statistics.median(_idle_gpu_us(fn, reps))

    out, fwd, bwd = {}, [], []
    for _ in range(reps):
        x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = forward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        y.backward(dy)
        t3 = time.perf_counter()
        fwd.append((t1 - t0) * 1e6)
        bwd.append((t3 - t2) * 1e6)
    out["forward"], out["backward"] = statistics.median(fwd), statistics.median(bwd)
    e = module.num_experts
    out["device_offsets_from_counts"] = timed(lambda: device_offsets_from_counts(counts, e, x.shape[0]))
    out["_cfg_args"] = timed(lambda: A._cfg_args(module.config, x.device))
    out["fused_epilogues_enabled"] = timed(lambda: A.fused_epilogues_enabled(module.config, x.device, 1536, True))
    out["module._weights"] = timed(lambda: module._weights())
    with torch.no_grad():
        out["forward under no_grad"] = timed(forward)
    return out


def step_timeline(step, reps: int = 20) -> list[list]:
    """Where one step's host time goes, on an idle GPU: every op call through :mod:`cute_mxfp8.ops.api` (and the
    offsets priming) and the MLP Function's forward / backward timed in place during ``reps`` real steps; rows
    [event, median start us, median us] from the step's start, in order, plus "gap" rows for the time between
    consecutive events (autograd, glue, allocations)."""
    from cute_mxfp8.ops import api
    from cute_mxfp8.ops import autograd as A

    events, real = [], {}
    t00 = [0.0]

    def wrap(mod, name, fn):
        real[(mod, name)] = getattr(mod, name)

        def run(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            events.append((name, (t0 - t00[0]) * 1e6, (time.perf_counter() - t0) * 1e6))
            return out

        setattr(mod, name, run)

    for n in _API_OPS:
        wrap(api, n, getattr(api, n))
    wrap(A, "prime_fast_schedules", A.prime_fast_schedules)
    from cute_mxfp8.nn import modules as NM

    wrap(NM, "device_offsets_from_counts", NM.device_offsets_from_counts)
    wrap(NM, "mxfp8_swiglu_mlp", NM.mxfp8_swiglu_mlp)
    fn_cls = A._SwiGLUMLPFn
    saved = fn_cls.forward, fn_cls.backward
    for which in ("forward", "backward"):
        inner = getattr(fn_cls, which)

        def timed(ctx, *args, inner=inner, which=which):
            t0 = time.perf_counter()
            events.append((f"{which} starts", (t0 - t00[0]) * 1e6, 0.0))
            out = inner(ctx, *args)
            events.append((f"{which} ends", (time.perf_counter() - t00[0]) * 1e6, 0.0))
            return out

        setattr(fn_cls, which, staticmethod(timed))
    runs = []
    try:
        for _ in range(reps):
            events.clear()
            torch.cuda.synchronize()
            t00[0] = time.perf_counter()
            step()
            events.append(("step returns", (time.perf_counter() - t00[0]) * 1e6, 0.0))
            runs.append(sorted(events, key=lambda e: e[1]))
    finally:
        for (mod, name), fn in real.items():
            setattr(mod, name, fn)
        fn_cls.forward, fn_cls.backward = (staticmethod(f) for f in saved)
    torch.cuda.synchronize()
    rows, prev_end = [], 0.0
    for i, (name, _, _) in enumerate(runs[0]):
        start = statistics.median(r[i][1] for r in runs)
        dur = statistics.median(r[i][2] for r in runs)
        if start - prev_end > 5:
            rows.append(["gap", prev_end, start - prev_end])
        rows.append([name, start, dur])
        prev_end = start + dur
    return rows


def cprofiled(step, steps: int) -> str:
    """cProfile of ``steps`` steps with the backward on the calling thread (autograd's multithreading off, so
    the profiler sees it), each step queued on an idle GPU (the wait is in ``synchronize``): the top functions
    by own time, then by cumulative time."""
    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(steps):
            step()
            torch.cuda.synchronize()  # each step queued on an idle GPU: no launch waits for a full queue
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats(70)
    return out.getvalue()


def idle_gaps(kernels: list[tuple[str, float, float]], top: int = 12) -> dict:
    """Where the GPU idles between kernels: ``kernels`` as (name, start us, end us) on one device timeline (any
    order; overlapping kernels merge).  Returns the total idle us, the number of gaps, and the ``top`` longest as
    [us, kernel before, kernel after] (names cut to 60 characters)."""
    gaps, busy_until, last = [], None, None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if busy_until is not None and start > busy_until:
            gaps.append([start - busy_until, last[:60], name[:60]])
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    gaps.sort(key=lambda g: -g[0])
    return {"idle_us": sum(g[0] for g in gaps), "gaps": len(gaps), "longest": gaps[:top]}


def step_gaps(step, dev, steps: int = 5, hold_ms: float = 0.0) -> dict:
    """:func:`idle_gaps` of ``steps`` steps queued back to back (no sync between them, as do_bench runs them,
    without its L2 flush), per step: is the wall-minus-kernel time a few long waits (the GPU waiting for the
    host: a sync, a slow host stretch) or many short launch gaps?  The profiler slows the host, so a step near
    the host's limit idles more under it; ``hold_ms`` (:func:`~cute_mxfp8.cli.bench_mlp.profiled_steps`) queues
    every step first and leaves only the gaps the GPU makes itself between queued kernels."""
    from cute_mxfp8.cli.bench_mlp import profiled_steps

    prof = profiled_steps(step, dev, steps, warmup=3, hold_ms=hold_ms)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
               and "spin_kernel" not in e.name]  # (torch.cuda._sleep's kernel: at::cuda::spin_kernel)
    out = idle_gaps(kernels)
    out["idle_us_per_step"] = out["idle_us"] / steps
    return out


def queued_step_ms(step, dev, steps: int = 10, hold_ms: float = 100.0) -> float:
    """ms per step of ``steps`` steps that the host queued while the GPU spun ``hold_ms`` (events after the spin
    and after the last step): the step's GPU time with every launch already queued (its kernels and the gaps the
    GPU makes between them), whatever the host's speed.  Against do_bench's wall: how much the host costs."""
    from cute_mxfp8.cli.bench_mlp import gpu_hold

    for _ in range(3):
        step()
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu_hold(hold_ms)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize(dev)
    return start.elapsed_time(end) / steps


def grouped_step(steps: int, weight_blocks: str = "1x128", plain: bool = True, quick: bool = False) -> dict:
    """One fwd + bwd step of the bench's grouped experts (T=32768 D=2048 I=1536 E=8, bf16) in the fast mode, in
    plain MXFP8 and as bf16 ``torch._grouped_mm``: do_bench wall ms; host ms, the median time the host takes to
    queue one step that starts on an idle GPU (so nothing in it waits for the GPU: the counts read returns at
    once; ``steps`` steps queued back to back would instead measure the GPU once its launch queue fills); GPU
    kernel ms and launches per step (torch.profiler), its 15 longest kernels, and the MXFP8 steps' sampled
    Python frames.  ``quick``: wall, queued, host, kernel ms, the top kernels and the ops' host us only (no gaps,
    memory, profiles or timeline).  First run on the H200 on 2026-12-01 (ninth session, docs/sm90_gemm.md)."""
    from cute_mxfp8 import MXFP8Config
    from cute_mxfp8.cli.bench import _time_ms
    from cute_mxfp8.cli.bench_mlp import _grouped, _step, kernel_breakdown

    dev = torch.device("cuda")
    shape = dict(m=32768, d=2048, i=1536, e=8)
    report = {}
    fast = MXFP8Config(hopper_block_k=128, hopper_weight_blocks=weight_blocks)
    configs = ((f"fast mode, {weight_blocks} weights", fast), ("plain MXFP8", MXFP8Config()))
    for name, config in configs if plain else configs[:1]:
        bf16, mx, xshape, counts = _grouped(dev, config, **shape)
        x = torch.randn(*xshape, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(*xshape, device=dev, dtype=torch.bfloat16)
        fns = {name: lambda mx=mx, counts=counts: _step(lambda x: mx(x, counts), x, dy)}
        if not report:
            fns["bf16"] = lambda bf16=bf16: _step(bf16, x, dy)
        for label, step in fns.items():
            wall = _time_ms(step, dev, 1.0)
            queued = statistics.median(queued_step_ms(step, dev) for _ in range(3))
            host_ms = statistics.median(_idle_gpu_us(step, steps)) / 1e3
            kernels = kernel_breakdown(step, dev, top=10**6)
            report[label] = {"wall_ms": wall, "queued_ms": queued, "host_ms": host_ms,
                             "kernel_ms": sum(r[2] for r in kernels),
                             "launches": sum(r[1] for r in kernels), "top_kernels": kernels[:15]}
            if quick:
                if label != "bf16":
                    report[label]["per_op_us"] = per_op_host_us(step)
                    print(label, "ops' host us:", [[r[0], round(r[1]), round(r[2])]
                                                   for r in report[label]["per_op_us"]])
                print(label, {k: round(v, 3) for k, v in report[label].items() if isinstance(v, (int, float))})
                for row in kernels[:15]:  # [kernel, launches per step, ms per step, % of the step's kernel time]
                    print("   ", [round(v, 4) if isinstance(v, float) else v for v in row])
                continue
            report[label]["gaps"] = step_gaps(step, dev)
            print(label, "GPU idle between kernels:", json.dumps(report[label]["gaps"]))
            report[label]["gaps_queued"] = step_gaps(step, dev, hold_ms=100.0)
            print(label, "GPU idle between kernels, every step queued first:",
                  json.dumps(report[label]["gaps_queued"]))
            report[label]["memory"] = live_at_peak(step, dev)
            print(label, "memory", json.dumps(report[label]["memory"]))
            if label != "bf16":
                report[label]["frames"] = sampled_frames(step, steps)
                report[label]["cpu_ops"] = cpu_ops(step, 5)
                report[label]["cprofile"] = cprofiled(step, 20)
                report[label]["per_op_us"] = per_op_host_us(step)
                report[label]["split_us"] = split_host_us(lambda mx=mx, counts=counts: mx(x, counts), x, dy, mx,
                                                          counts)
                print(label, "host split us:", {k: round(v) for k, v in report[label]["split_us"].items()})
                report[label]["timeline"] = step_timeline(step)
                for row in report[label]["timeline"]:
                    print("   ", row[0], round(row[1]), round(row[2]))
                total = sum(r[1] for r in report[label]["per_op_us"])
                print(label, f"ops' host us (sum {total:.0f}):", [[r[0], round(r[1]), round(r[2])]
                                                                 for r in report[label]["per_op_us"]])
                print(report[label]["cprofile"])
                for row in report[label]["cpu_ops"]:
                    print("    cpu", [round(v, 3) if isinstance(v, float) else v for v in row])
            print(label, {k: round(v, 3) for k, v in report[label].items()
                          if k not in ("frames", "top_kernels", "cpu_ops", "cprofile", "memory", "per_op_us",
                                       "split_us", "timeline", "gaps", "gaps_queued")})
            for row in kernels[:15]:
                print("   ", row)
    return report


def _without_group_plans() -> None:
    """Make no launch plan for the token-group casts, the SwiGLU casts and the GEMMs (keys holding ``"offs"`` or
    naming those ops): they take the full path on every call, as before 2026-12-05 (the weights' casts keep
    theirs)."""
    from cute_mxfp8.ops import backends as B

    remember = B.remember_plan

    def no_group_plans(key, launcher):
        grouped = key[0] in ("swiglu_quant", "dswiglu_quant", "mm", "grouped_mm", "grouped_mm_wgrad") or "offs" in key
        remember(key, None if grouped else launcher)

    B.remember_plan = no_group_plans


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--grouped", action="store_true",
                    help="only the grouped experts step's host profile (grouped_step), then exit")
    ap.add_argument("--weight-blocks", default="1x128", choices=("1x128", "128x128"),
                    help="--grouped: the fast mode's weight scale blocks (MXFP8Config(hopper_weight_blocks=...))")
    ap.add_argument("--no-plain", action="store_true", help="--grouped: the fast mode and bf16 only")
    ap.add_argument("--quick", action="store_true",
                    help="--grouped: times and the ops' host us only (no gaps, memory, profiles, timeline)")
    ap.add_argument("--group-plans", default="on", choices=("on", "off"),
                    help="off: no launch plans for the token-group and SwiGLU casts and the GEMMs (the host "
                         "path before 2026-12-05), for an A/B in separate processes")
    args = ap.parse_args()
    if args.group_plans == "off":
        _without_group_plans()
    if args.grouped:
        report = grouped_step(50, args.weight_blocks, plain=not args.no_plain, quick=args.quick)
        if args.out:
            with open(f"{args.out}/host_grouped.json", "w") as f:
                json.dump(report, f, indent=1)
        return
    from cute_mxfp8 import MXFP8SwiGLUMLP, ops
    from cute_mxfp8.cli.bench import launch_overhead_us
    import cute_mxfp8.cli.bench as bench

    bench._q = ops
    dev = torch.device("cuda")
    report = {"levels_us": launch_overhead_us(dev)}
    print("host time per call:", {k: round(v, 2) for k, v in report["levels_us"].items()})
    x = torch.randn(128, 128, device=dev, dtype=torch.bfloat16)
    for _ in range(100):
        ops.quantize_rowwise(x)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        ops.quantize_rowwise(x)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    print(s.getvalue())
    report["cprofile"] = s.getvalue()

    report["breakdown_us"] = breakdown(x, dev, args.calls)
    print("components (us per call):", {k: round(v, 2) for k, v in report["breakdown_us"].items()})

    # CUDA graphs: the dense MLP forward + backward
    torch.manual_seed(0)
    mlp = MXFP8SwiGLUMLP(1024, 2048).to(dev)
    xin = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    eager = lambda: mlp(xin).sum().backward()  # noqa: E731
    for _ in range(3):
        eager()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        eager()
    torch.cuda.synchronize()
    report["mlp_eager_ms"] = (time.perf_counter() - t0) / 50 * 1e3
    try:
        g = torch.cuda.make_graphed_callables(mlp, (xin,))
        y_ref = mlp(xin).detach().clone()
        y = g(xin)
        y.sum().backward()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            g(xin).sum().backward()
        torch.cuda.synchronize()
        report["mlp_graph_ms"] = (time.perf_counter() - t0) / 50 * 1e3
        report["graph_equal"] = bool(torch.equal(y.detach(), y_ref))
        report["graph"] = "captured"
    except Exception as exc:  # report, do not hide: the tool's job is to say whether capture works
        report["graph"] = f"failed: {type(exc).__name__}: {exc}"[:2000]
    print({k: v for k, v in report.items() if k != "cprofile"})
    if args.out:
        with open(f"{args.out}/host.json", "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
