"""Entry point of ``python -m cute_mxfp8``: argparse with the ``train`` and ``bench`` subcommands."""

from __future__ import annotations

import argparse

__all__ = ["build_parser", "main"]


def _run_train(args: argparse.Namespace) -> int:
    from cute_mxfp8.cli import train

    return train.run(args)


def _run_bench(args: argparse.Namespace) -> int:
    from cute_mxfp8.cli import bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand sets ``args.func``."""
    from cute_mxfp8.cli import train

    parser = argparse.ArgumentParser(prog="python -m cute_mxfp8", description="MXFP8 training with CuTe kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p_train = sub.add_parser(
        "train",
        help="train a small LM in high precision and in MXFP8 and compare",
        description="Train the same small byte-level LM twice (high precision, MXFP8) and compare the losses.",
    )
    train.add_args(p_train)
    p_train.set_defaults(func=_run_train)

    p_bench = sub.add_parser("bench", help="benchmark the MXFP8 ops", description="Benchmark the MXFP8 ops.")
    p_bench.add_argument("groups", nargs="*", metavar="GROUP",
                         help="op groups to time: quantize, swiglu, gemm (default: all)")
    p_bench.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    p_bench.add_argument("--device", default=None, help="device to bench on (default: cuda if available, else cpu)")
    p_bench.set_defaults(func=_run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns 0, raises SystemExit otherwise."""
    args = build_parser().parse_args(argv)
    rc = int(args.func(args) or 0)
    if rc:
        raise SystemExit(rc)
    return rc
