"""Host-side cost of one eager MXFP8 op call and CUDA-graph capture of the SwiGLU MLP (GPU only; a dev tool).

python tools/profile_host.py [--calls N] [--out DIR]: prints the per-call host time of the three levels the bench
reports, a cProfile of the documented wrapper (top functions by own time), and whether the dense MXFP8 SwiGLU MLP
forward + backward captures into CUDA graphs (torch.cuda.make_graphed_callables), with eager vs replay times."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
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
