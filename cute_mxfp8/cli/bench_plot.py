"""Bar chart of a ``bench`` result (the dict ``--json`` writes): GEMM TFLOP/s per shape and backend / baseline, and
the MLP fwd+bwd step times bf16 vs MXFP8.  ``python -m cute_mxfp8.cli.bench_plot RESULT.json OUT.png``.

Needs matplotlib (``pip install 'cute_mxfp8[plot]'``); without it :func:`plot` raises ``RuntimeError`` naming that
install."""

from __future__ import annotations

import json
import sys


def plot(result: dict, path: str) -> None:
    """Draw ``result`` (``bench --json``'s dict) into the PNG ``path``: one panel of GEMM TFLOP/s (rows whose op is
    ``mm``, one bar group per shape), one of MLP step times (ms) if the result has any."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the bench chart needs matplotlib: pip install 'cute_mxfp8[plot]'") from e
    gemm = [r for r in result.get("rows", []) if r.get("op") == "mm" and r.get("tflops")]
    steps = result.get("mlp_steps", [])
    panels = [p for p in ("gemm", "mlp") if (p == "gemm" and gemm) or (p == "mlp" and steps)]
    if not panels:
        raise ValueError("nothing to draw: the result has no `mm` rows with TFLOP/s and no MLP steps")
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.5 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == "gemm":
            shapes = list(dict.fromkeys(r["shape"] for r in gemm))
            names = list(dict.fromkeys(r["backend"] for r in gemm))
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                vals = [next((r["tflops"] for r in gemm if r["shape"] == s and r["backend"] == name), 0.0)
                        for s in shapes]
                ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=name)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"dense GEMM ({result.get('device', '')})")
        else:
            labels = [f"{s[0]}\n{s[1]}" for s in steps]
            xs = range(len(steps))
            ax.bar([x - 0.2 for x in xs], [s[2] for s in steps], 0.4, label="bf16")
            ax.bar([x + 0.2 for x in xs], [s[3] for s in steps], 0.4, label="MXFP8")
            ax.set_xticks(list(xs), labels)
            ax.set_ylabel("fwd+bwd step, ms")
            ax.set_title("MLP training step")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m cute_mxfp8.cli.bench_plot RESULT.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        plot(json.load(f), argv[1])
    print(f"chart written to {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
