"""Checks of command-line arguments the subcommands share: each returns None or the error message."""

from __future__ import annotations

import torch


def device_problem(name: str) -> str | None:
    """None if ``--device name`` ('auto', 'cpu', 'cuda', 'cuda:N') is usable here, else the error message."""
    if name == "auto":
        return None
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        return f"argument --device: invalid device {name!r} (expected 'auto', 'cpu', 'cuda' or 'cuda:N')"
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return f"argument --device: {name!r} requested but CUDA is not available (use --device cpu or auto)"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"argument --device: {name!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
        return None
    return f"argument --device: unsupported device type {dev.type!r} (expected 'auto', 'cpu', 'cuda' or 'cuda:N')"
