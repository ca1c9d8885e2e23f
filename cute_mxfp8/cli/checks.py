"""Checks of command-line arguments the subcommands share: each returns None or the error message."""

from __future__ import annotations

import os

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


def output_file_problem(flag: str, path: str | None) -> str | None:
    """None if the file ``flag path`` can be written (checked before a run that takes minutes), else the error
    message: a directory, a missing or read-only directory, or an existing read-only file."""
    if not path:
        return None
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory; give a file name in it"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"{flag} {path}: {parent} is a file, not a directory"
    if not os.path.isdir(parent):
        return f"{flag} {path}: its directory does not exist"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{flag} {path}: the file exists and is not writable"
    if not os.path.exists(path) and not os.access(parent, os.W_OK):
        return f"{flag} {path}: its directory {parent} is not writable"
    return None
