"""Per-``offs`` device tensors the grouped kernels take (tile starts, the 2d-3d tile schedule, the 2d-2d aligned
columns), computed once per offsets tensor instead of once per op call.

A grouped MLP step calls a dozen grouped ops with the same ``offs`` tensor (casts, 2d-3d GEMMs, 2d-2d wgrads), and
each derived tensor is several small torch kernels: computed per call they were ~150 launches of host time per step
on the H200 (``bench mlp --profile``).  :func:`derived` keys the results on the tensor object, its version counter
(an in-place change of ``offs`` recomputes) and the op's extra key (the token count), holds them as long as ``offs``
lives, and never reads ``offs`` on the host (no sync), except :func:`validated_end`'s one read (which
:func:`check_offsets` skips for offsets :func:`mark_safe` vouches for).  Each entry is
computed with torch on ``offs``'s device, or, once a host copy of ``offs`` is known, from that copy's Python ints
and uploaded (:func:`derived_tensors`); the functions that compute each entry live with their users.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

_ENTRIES: dict[int, tuple[weakref.ref, int, dict]] = {}


def _drop(key: int, ref: weakref.ref) -> None:
    if _ENTRIES is None:  # interpreter shutdown: the module's globals are already cleared
        return
    entry = _ENTRIES.get(key)
    if entry is not None and entry[0] is ref:
        del _ENTRIES[key]


def _values(offs: torch.Tensor, create: bool) -> dict | None:
    """The cached values of this ``offs`` tensor (same object, same version): a new empty dict when ``create``
    and there are none yet, else None.  None for tensors under tracing (fake or functional tensors,
    ``torch.compile``) and inference tensors (no version counter), which are never cached."""
    if type(offs) is not torch.Tensor or torch.compiler.is_compiling() or offs.is_inference():
        return None
    slot = id(offs)
    entry = _ENTRIES.get(slot)
    if entry is None or entry[0]() is not offs or entry[1] != offs._version:
        if not create:
            return None
        ref = weakref.ref(offs, lambda r, slot=slot: _drop(slot, r))
        entry = (ref, offs._version, {})
        _ENTRIES[slot] = entry
    return entry[2]


def derived(offs: torch.Tensor, name: str, compute: Callable[[], object], *key) -> object:
    """``compute()`` for this ``offs`` tensor (same object, same version) and ``(name, *key)``, cached while
    ``offs`` is alive.  Tensors under tracing (fake or functional tensors, ``torch.compile``) are not cached."""
    values = _values(offs, create=True)
    if values is None:
        return compute()
    k = (name, *key)
    if k not in values:
        values[k] = compute()
    return values[k]


def host_copy(offs: torch.Tensor) -> torch.Tensor | None:
    """The host copy of ``offs`` that :func:`validated_end` read or :func:`known_host_copy` recorded for this
    tensor and version, or None; never reads the device."""
    values = _values(offs, create=False)
    return None if values is None else values.get(("host copy",))


def derived_tensors(offs: torch.Tensor, name: str, fn: Callable, on_host: Callable, *key):
    """:func:`derived` of ``fn(offs)``, an int32 tensor or a tuple of them computed with torch ops on ``offs``'s
    device.  When a host copy of a CUDA ``offs`` is known (:func:`host_copy`), ``on_host(ends)`` computes the same
    values instead from its Python ints (a list of ints, a list of such lists for a 2-D result, or a tuple of
    those) and they reach ``offs``'s device in one pinned, non-blocking copy: no device op at all, where ``fn``
    is one launch per torch op and the same ops on CPU tensors cost several microseconds each."""
    def compute():
        host = host_list(offs) if offs.device.type == "cuda" else None
        if host is None:
            return fn(offs)
        out = on_host(host)
        return _upload(out if isinstance(out, tuple) else (out,), offs.device, isinstance(out, tuple))

    return derived(offs, name, compute, *key)


def _upload(values: tuple, device: torch.device, as_tuple: bool):
    """int32 tensors on ``device`` from lists of ints (1-D) or lists of equal-length lists (2-D): one pinned
    buffer, one non-blocking copy; each tensor starts 16-byte aligned in it."""
    flat, parts = [], []
    for v in values:
        shape = (len(v), len(v[0])) if v and isinstance(v[0], list) else (len(v),)
        parts.append((len(flat), shape))
        flat.extend(x for row in v for x in row) if len(shape) == 2 else flat.extend(v)
        flat.extend([0] * (-len(flat) % 4))
    buf = torch.tensor(flat or [0], dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)
    out = tuple(buf[o:o + math.prod(shape)].view(shape) for o, shape in parts)
    return out if as_tuple else out[0]


def host_list(offs: torch.Tensor) -> list[int] | None:
    """:func:`host_copy` of ``offs`` as Python ints (converted once per tensor and version), or None."""
    host = host_copy(offs)
    return None if host is None else derived(offs, "host list", host.tolist)


def validated_end(offs: torch.Tensor, total: int | None) -> int:
    """:func:`cute_mxfp8.formats.validate_offsets` (same checks, same ValueError, ``offs[-1]``) on a host copy of
    ``offs`` read once per offsets tensor and version (:func:`derived`): the grouped casts of a step validate the
    same ``offs`` several times, and each read was a device sync that let the GPU run dry while the host caught
    up with its launches.  The first call syncs; later ones check the cached copy against their own ``total``.
    Like every :func:`derived` entry the copy is keyed on the version counter: a write it does not count (through
    ``.data``, ``.numpy()`` or a custom kernel) is not seen; make new offsets a new tensor, as the modules do."""
    from .. import formats as F

    if not isinstance(offs, torch.Tensor):
        return F.validate_offsets(offs, total)  # its error names the type
    host = derived(offs, "host copy", lambda: offs.to("cpu", copy=True))
    end = derived(offs, "valid end", lambda: F.validate_offsets(host, None))  # a raise caches nothing
    if total is not None and end > total:
        F.validate_offsets(host, total)  # raises its ValueError
    return end


def mark_safe(offs: torch.Tensor, total: int) -> None:
    """Record that ``offs`` was made on the device to be valid for ``total`` rows (non-decreasing, within
    ``[0, total]``: the grouped module clamps its cumulative counts so), so that :func:`check_offsets` does not read
    it back for ops on at least ``total`` rows.  Like every entry, an in-place change of ``offs`` drops it; a write
    the version counter does not see (through ``.data``, ``.numpy()`` or another tensor on the same storage) does
    not, and the kernels then trust whatever it wrote: make new offsets a new tensor.  Not recorded for inference
    tensors (they are then read and checked as any)."""
    derived(offs, "safe for", lambda: total)


def check_offsets(offs: torch.Tensor, total: int) -> None:
    """Raise :func:`validated_end`'s ValueError for offsets that are not valid for ``total`` rows, except for
    offsets :func:`mark_safe` recorded as valid for at most ``total`` rows, which are not read on the host: no
    device sync, so the GPU keeps the work queued behind them (the ops whose kernels find ``offs[-1]`` themselves
    call this instead of :func:`validated_end`)."""
    bound = safe_bound(offs) if isinstance(offs, torch.Tensor) else None
    if bound is None or bound > total:
        validated_end(offs, total)


def safe_bound(offs: torch.Tensor) -> int | None:
    """The row count :func:`mark_safe` recorded for this ``offs`` tensor and version, or None."""
    return recorded(offs, "safe for")


def recorded(offs: torch.Tensor, name: str):
    """The :func:`derived` entry ``name`` (no extra key) of this ``offs`` tensor and version if there is one, else
    None; computes and records nothing."""
    values = _values(offs, create=False)
    return None if values is None else values.get((name,))


def known_host_copy(offs: torch.Tensor, host: torch.Tensor) -> None:
    """Record ``host``, a CPU tensor equal to ``offs`` (the values ``offs`` was made from), as the copy
    :func:`validated_end` reads, so that no op reads ``offs`` back from the device."""
    derived(offs, "host copy", lambda: host)


def cached_entries() -> int:
    """How many offsets tensors have derived values cached (for tests)."""
    return len(_ENTRIES)
