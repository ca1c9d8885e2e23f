"""Bar chart of a ``bench`` result (the dict ``--json`` writes): GEMM TFLOP/s per shape and backend / baseline, and
the MLP fwd+bwd step times bf16 vs MXFP8.  ``python -m cute_mxfp8.cli.bench_plot RESULT.json OUT.png``.

Needs matplotlib (a dependency of the package); without it :func:`plot` raises ``RuntimeError`` naming the
install."""

from __future__ import annotations

import json
import os
import sys


_GEMM_PANELS = {"mm": "dense GEMM", "grouped_mm": "grouped GEMM 2d-3d", "grouped_mm_wgrad": "grouped GEMM 2d-2d (wgrad)"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the bench chart needs matplotlib: pip install matplotlib") from e
    return plt


def path_problem(path: str) -> str | None:
    """Why :func:`plot` could not write ``path`` (None: it can): matplotlib missing, or a file type it does not
    write, named by the file name's suffix (none, or a directory: matplotlib would write elsewhere, adding .png).
    ``bench`` asks before it times anything."""
    try:
        plt = _pyplot()
    except RuntimeError as e:
        return str(e)
    kinds = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    names = f"name it .png (or {', '.join('.' + k for k in sorted(kinds))})"
    if os.path.isdir(path) or path.endswith(os.sep):
        return f"is a directory: give a file name in it; {names}"
    stem, suffix = os.path.splitext(os.path.basename(path))
    if not stem or not suffix:
        return f"has no file suffix, so matplotlib would write another file; {names}"
    if suffix.lstrip(".").lower() not in kinds:
        return f"matplotlib writes no {suffix} files; {names}"
    return None


def plot(result: dict, path: str) -> None:
    """Draw ``result`` (``bench --json``'s dict) into the PNG ``path``: a panel of TFLOP/s per GEMM op that has rows
    (``mm``, ``grouped_mm``, ``grouped_mm_wgrad``; one bar group per shape, one bar per backend / baseline), and
    one of MLP step times (ms) if the result has any."""
    plt = _pyplot()
    gemms = {op: [r for r in result.get("rows", []) if r.get("op") == op and r.get("tflops")] for op in _GEMM_PANELS}
    steps = result.get("mlp_steps", [])
    panels = [op for op, rows in gemms.items() if rows] + (["mlp"] if steps else [])
    if not panels:
        raise ValueError("nothing to draw: the result has no GEMM rows with TFLOP/s and no MLP steps")
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.5 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        if panel in gemms:
            rows = gemms[panel]
            shapes = list(dict.fromkeys(r["shape"] for r in rows))
            names = list(dict.fromkeys(r["backend"] for r in rows))
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                vals = [next((r["tflops"] for r in rows if r["shape"] == s and r["backend"] == name), 0.0)
                        for s in shapes]
                ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=name)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{_GEMM_PANELS[panel]} ({result.get('device', '')})")
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
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m cute_mxfp8.cli.bench_plot RESULT.json OUT.png", file=sys.stderr)
        return 2
    from cute_mxfp8.cli.checks import output_file_problem

    problem = output_file_problem("OUT.png", argv[1])  # (its message names the path; path_problem's does not)
    if problem is None and (why := path_problem(argv[1])) is not None:
        problem = f"{argv[1]}: {why}"
    if problem:
        print(f"bench_plot: {problem}", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:  # a missing / unreadable file, or no JSON
        print(f"bench_plot: {argv[0]}: {e}", file=sys.stderr)
        return 2
    try:
        plot(result, argv[1])
    except ValueError as e:  # nothing to draw
        print(f"bench_plot: {argv[0]}: {e}", file=sys.stderr)
        return 2
    except (AttributeError, KeyError, TypeError) as e:  # another JSON than bench --json writes
        print(f"bench_plot: {argv[0]}: not a `bench --json` result ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(f"chart written to {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
