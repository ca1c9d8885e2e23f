"""``bench mlp``: one training step (forward + backward) of a SwiGLU MLP and of grouped experts, bf16 vs MXFP8.

The bf16 side is what a user runs without this package: three ``nn.Linear`` (dense) or ``torch._grouped_mm`` with
the same token-group offsets (grouped experts, where torch has it); the MXFP8 side the drop-in module with the same
weights (``MXFP8SwiGLUMLP`` / ``MXFP8GroupedExperts``, bf16 parameters, automatic backends).  Reports the median
step time, the ratio MXFP8 / bf16, and the peak memory the step allocates above its inputs and weights.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

# (workload, shape): the shapes of issue 12's table on a GPU; small ones on the CPU
GPU_CASES = [("SwiGLU MLP", dict(m=16384, d=4096, i=14336)), ("SwiGLU MLP", dict(m=8192, d=2048, i=8192)),
             ("grouped experts", dict(m=32768, d=2048, i=1536, e=8))]
CPU_CASES = [("SwiGLU MLP", dict(m=256, d=256, i=512)), ("grouped experts", dict(m=512, d=256, i=256, e=4))]


def _dense(dev, config, m, d, i):
    from cute_mxfp8.nn import MXFP8SwiGLUMLP

    mx = MXFP8SwiGLUMLP(d, i, device=dev, dtype=torch.bfloat16, config=config)
    w1, w2, w3 = (lin.weight for lin in (mx.w1, mx.w2, mx.w3))

    def bf16(x):
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    return bf16, mx, (m, d), None


def _grouped(dev, config, m, d, i, e):
    from cute_mxfp8.nn import MXFP8GroupedExperts

    mx = MXFP8GroupedExperts(d, i, e, device=dev, dtype=torch.bfloat16, config=config)
    counts = torch.full((e,), m // e, dtype=torch.int64, device=dev)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def bf16(x):
        mm = torch._grouped_mm
        h = F.silu(mm(x, mx.w1.transpose(-2, -1), offs=offs)) * mm(x, mx.w3.transpose(-2, -1), offs=offs)
        return mm(h, mx.w2.transpose(-2, -1), offs=offs)

    return bf16, mx, (m, d), counts


def _step(fn, x, dy):
    x.grad = None
    fn(x).backward(dy)


def _peak_mib(fn, x, dy, dev, params) -> float | None:
    """Peak memory (MiB) of one fwd + bwd step above what was allocated before it, starting with no gradients
    (x's and ``params``' cleared first: a gradient left by the previous step would be freed inside this one and
    hide its size, or be accumulated into instead of allocated), so both steps count the gradients they make."""
    if dev.type != "cuda":
        return None
    x.grad = None
    for p in params:
        p.grad = None
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    _step(fn, x, dy)
    torch.cuda.synchronize(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**20


def gpu_hold(ms: float) -> None:
    """Queue a kernel that spins the GPU at least ``ms`` (``torch.cuda._sleep`` counts clock cycles; 2e6 per ms
    covers clocks up to 2 GHz), so the host can queue what follows before any of it runs."""
    torch.cuda._sleep(int(ms * 2e6))


def profiled_steps(step, device: torch.device, steps: int, warmup: int = 1, hold_ms: float = 0.0):
    """``torch.profiler`` (CUDA activity) over ``steps`` calls of ``step`` queued back to back, after ``warmup``
    calls and a synchronize; returns the profiler.  ``hold_ms`` > 0: the GPU first spins that long
    (:func:`gpu_hold`), so the host can queue every step before the first one runs and the kernels then run
    without waiting for it."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if hold_ms > 0:
            gpu_hold(hold_ms)
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    return prof


def kernel_breakdown(step, device: torch.device, top: int, steps: int = 3) -> list[list]:
    """The ``top`` GPU kernels of ``step`` by time, from ``torch.profiler`` over ``steps`` steps after a warm-up:
    rows [kernel name (cut to 90 characters), launches per step, ms per step, % of the kernels' time]."""
    prof = profiled_steps(step, device, steps)
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels) or 1.0
    kernels.sort(key=lambda e: -e.device_time_total)
    return [[e.key[:90], e.count / steps, e.device_time_total / steps / 1e3, 100 * e.device_time_total / total]
            for e in kernels[:top]]


def _grouped_mm_problem(device: torch.device) -> str | None:
    """Why this torch's ``torch._grouped_mm`` (the grouped step's bf16 baseline) does not run a bf16 2d-3d product
    on ``device`` (None: it does; CUDA, and the CPU since torch 2.9 or so)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        x = torch.zeros(32, 32, dtype=torch.bfloat16, device=device)
        torch._grouped_mm(x, torch.zeros(2, 32, 32, dtype=torch.bfloat16, device=device),
                          offs=torch.tensor([16, 32], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0][:120]
    return None


def mlp_rows(device: torch.device, time_ms, profile: int = 0, config=None, rounds: int = 4) -> list[list]:
    """One row per workload: [workload, shape, bf16 ms, MXFP8 ms, MXFP8 / bf16, bf16 peak MiB, MXFP8 peak MiB,
    lowest ratio, highest ratio, bf16 ms per round, MXFP8 ms per round, median ratio of the rounds with bf16
    first, median ratio of the rounds with MXFP8 first (None with one round: bf16 runs first)].

    The two steps are timed ``rounds`` times each, alternating (bf16 first in even rounds, MXFP8 first in odd ones),
    so a drift of the machine during the run (clocks, temperature, other tenants) reaches both alike: the ms
    columns are the medians over the rounds, the ratio the median of the rounds' ratios, with its lowest and
    highest beside it.  An even ``rounds`` puts each step first equally often (an odd one gives bf16 the extra
    round); the two per-order medians show whether the order moves the ratio (it did: the step timed second ran
    up to 15 % slower in some H100 runs).  ``profile`` > 0 (CUDA only) also prints, per workload, that many of the
    MXFP8 step's GPU kernels by time.  ``config``: the MXFP8 modules' :class:`~cute_mxfp8.MXFP8Config` (default
    one if None)."""
    if type(rounds) is not int or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    rows = []
    if profile > 0 and device.type != "cuda":
        print("bench mlp: --profile needs a CUDA device (torch.profiler's GPU kernel times); ignored on the CPU")
    for name, shape in (GPU_CASES if device.type == "cuda" else CPU_CASES):
        make = _grouped if "e" in shape else _dense
        why = _grouped_mm_problem(device) if make is _grouped else None
        if why is not None:
            print(f"bench mlp: {name} skipped (its bf16 baseline, torch._grouped_mm, does not run here: {why})")
            continue
        bf16, mx, xshape, counts = make(device, config, **shape)
        x = torch.randn(*xshape, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(*xshape, device=device, dtype=torch.bfloat16)
        mxfp8 = mx if counts is None else (lambda x, mx=mx, counts=counts: mx(x, counts))
        peaks = [_peak_mib(fn, x, dy, device, list(mx.parameters())) for fn in (bf16, mxfp8)]
        per_round = ([], [])  # bf16's, MXFP8's
        for r in range(rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                fn = (bf16, mxfp8)[which]
                per_round[which].append(time_ms(lambda fn=fn: _step(fn, x, dy), device, budget_s=1.0 / rounds))
        ratios = [q / b for b, q in zip(*per_round)]
        label = " ".join(f"{k.upper()}={v}" for k, v in shape.items())
        if profile > 0 and device.type == "cuda":
            from tabulate import tabulate

            print(f"MXFP8 {name} {label}: top {profile} GPU kernels of a fwd+bwd step (torch.profiler)")
            print(tabulate([[k, f"{n:g}", f"{ms:.3f}", f"{pct:.1f}"]
                            for k, n, ms, pct in kernel_breakdown(lambda: _step(mxfp8, x, dy), device, profile)],
                           headers=["kernel", "launches", "ms", "%"]))
        by_order = [statistics.median(ratios[first::2]) if ratios[first::2] else None for first in (0, 1)]
        rows.append([name, label, statistics.median(per_round[0]), statistics.median(per_round[1]),
                     statistics.median(ratios), *peaks, min(ratios), max(ratios), *per_round, *by_order])
        del bf16, mx, mxfp8, x, dy
    return rows
