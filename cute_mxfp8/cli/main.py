"""Entry point of ``python -m cute_mxfp8``: argparse with the ``train`` and ``bench`` subcommands."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["build_parser", "main"]


def _run_train(args: argparse.Namespace) -> int:
    from cute_mxfp8.cli import train

    return train.run(args)


def _run_inspect(args: argparse.Namespace) -> int:
    from cute_mxfp8.cli import inspect_kernels

    return inspect_kernels.main(args)


def _run_bench(args: argparse.Namespace) -> int:
    from cute_mxfp8.cli import bench

    return bench.main(args)


MODULE_PROG = "python -m cute_mxfp8"


def _shard(text: str) -> tuple[int, int]:
    """argparse type: ``K/N`` with 0 <= K < N (the K-th of N interleaved parts of a variant list)."""
    k, sep, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        k = n = None
    if not sep or k is None or not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"must be K/N with integers 0 <= K < N (e.g. 0/4), got {text!r}")
    return k, n


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def default_prog(argv0: str | None = None) -> str:
    """The program name for usage lines: the basename of ``argv0`` (default ``sys.argv[0]``), e.g. ``cute-mxfp8``
    for the console script, or ``python -m cute_mxfp8`` when run as a module (``__main__.py``) or unknown."""
    if argv0 is None:
        argv0 = sys.argv[0] if sys.argv else ""
    name = os.path.basename(argv0)
    if not name or name in ("__main__.py", "-c", "-m"):
        return MODULE_PROG
    return name


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose ``parse_args`` also runs each subcommand's cross-argument checks, reporting a
    problem through that subcommand's ``parser.error`` (usage line, exit status 2)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.validators: dict[str, tuple[argparse.ArgumentParser, object]] = {}

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        entry = self.validators.get(getattr(ns, "command", None))
        if entry is not None:
            subparser, validate = entry
            problem = validate(ns)
            if problem:
                subparser.error(problem)
        return ns


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; each subcommand sets ``args.func``.  ``prog`` defaults to :func:`default_prog`."""
    from cute_mxfp8.cli import train

    parser = _Parser(prog=prog or default_prog(), description="MXFP8 training with CuTe kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=argparse.ArgumentParser)  # fmt: skip

    p_train = sub.add_parser(
        "train",
        help="train a small LM in high precision and in MXFP8 and compare",
        description="Train the same small byte-level LM twice (high precision, MXFP8) and compare the losses.",
    )
    train.add_args(p_train)
    p_train.set_defaults(func=_run_train)
    parser.validators["train"] = (p_train, train.validate_args)

    p_bench = sub.add_parser("bench", help="benchmark the MXFP8 ops", description="Benchmark the MXFP8 ops.")
    p_bench.add_argument("groups", nargs="*", metavar="GROUP",
                         help="op groups to time: quantize, swiglu, gemm, mlp (default: all)")
    p_bench.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    p_bench.add_argument("--device", default=None, help="device to bench on (default: cuda if available, else cpu)")
    p_bench.add_argument("--plot", metavar="PNG", default=None,
                         help="also draw the GEMM TFLOP/s and MLP step times as a bar chart (matplotlib, installed with "
                              "the package; needs the gemm or mlp group); `python -m cute_mxfp8.cli.bench_plot JSON "
                              "PNG` draws one from a saved --json")
    p_bench.add_argument("--profile", metavar="N", type=_non_negative, default=0,
                         help="mlp group on CUDA: also print the N GPU kernels that take the most time in each "
                              "MXFP8 step (torch.profiler)")
    p_bench.add_argument("--rounds", metavar="N", type=_positive, default=None,
                         help="mlp group: time each step N times, alternating bf16 and MXFP8, and report the medians, "
                              "the range of the per-round MXFP8 / bf16 ratios and their median over the rounds with "
                              "bf16 first and with MXFP8 first; even N puts each first equally often (default: 4)")
    p_bench.add_argument("--hopper-block-k", type=int, choices=[32, 128], default=32,
                         help="128: the Hopper fast mode; the mlp group's modules take MXFP8Config(hopper_block_k="
                              "128), the quantize and swiglu groups time scale_block=128 casts against the same op "
                              "in 32-blocks; not the gemm group (default: %(default)s, plain MXFP8)")
    p_bench.add_argument("--hopper-weight-blocks", choices=["1x128", "128x128"], default="1x128",
                         help="with --hopper-block-k 128: the mlp group's weights in 1x128 (default) or 128 x 128 "
                              "blocks (MXFP8Config(hopper_weight_blocks=...))")
    p_bench.set_defaults(func=_run_bench)

    p_inspect = sub.add_parser("inspect", help="compile every kernel variant for an arch (no GPU) and report",
                               description="Compile every kernel variant for an arch, without a GPU, and print a "
                                           "row per variant: registers, shared and local memory, and the SASS "
                                           "instruction counts that prove the design (PTX counts when nvdisasm "
                                           "is not installed).")
    p_inspect.add_argument("--arch", default="sm_100f", choices=["sm_100f", "sm_100a", "sm_103a", "sm_90a"],
                           help="target architecture (default: %(default)s)")
    p_inspect.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    p_inspect.add_argument("--jobs", metavar="J", type=_positive, default=None,
                           help="compile in J processes (default: the CPU count)")
    p_inspect.add_argument("--pairwise", action="store_true",
                           help="compile only a subset of each kernel's variants in which every value of each "
                                "argument and every pair of values of two arguments occur (about 60 %%; the CI "
                                "test's check; without it, every variant)")
    p_inspect.add_argument("--shard", metavar="K/N", type=_shard, default=None,
                           help="compile only every N-th variant, starting at the K-th (K counts from 0: 0 <= K < N), "
                                "so that N runs (machines, CI workers) share the list; the shards of one N cover it "
                                "once; an empty shard (N past the variant count) is an error")
    p_inspect.set_defaults(func=_run_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns 0, raises SystemExit otherwise."""
    args = build_parser().parse_args(argv)
    rc = int(args.func(args) or 0)
    if rc:
        raise SystemExit(rc)
    return rc
