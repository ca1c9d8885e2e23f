"""Backend registry: which implementation of each op runs on which device.

A backend is a name, an availability check per device and a table ``op name -> callable``.  Backends:

* ``reference`` — pure torch, every device, the oracle (this package's :mod:`cute_mxfp8.ops.reference`).
* ``sm90`` / ``sm100`` — CuTe DSL kernels, registered by later modules when their kernels exist.

Selection for one op call: an explicit request (the op's ``backend`` argument, else the
``CUTE_MXFP8_BACKEND`` environment variable) must be able to run that op on that device, otherwise
:class:`BackendUnavailableError` is raised with the reason — never a silent fallback.  With no request, the
highest-priority backend that is available on the device *and* implements the op is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "ENV_VAR",
    "register_backend",
    "registered_backends",
    "resolve_backend",
    "check_backend_name",
    "fuses_mlp",
    "get_impl",
]

ENV_VAR = "CUTE_MXFP8_BACKEND"


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the op on the given device."""


@dataclass
class Backend:
    """One implementation family.

    ``unavailable_reason(device)`` returns None when the backend can run on ``device``, else a sentence saying why
    not (e.g. "needs an SM100 GPU, found SM90").  ``priority`` orders the automatic choice (higher first).
    """

    name: str
    priority: int
    unavailable_reason: Callable[[torch.device], str | None]
    ops: dict[str, Callable] = field(default_factory=dict)
    # op name -> ``limits(*op_args) -> None or the reason this backend cannot take these arguments``; ops without
    # an entry take every valid input.  Automatic selection passes over a backend whose limits refuse the call.
    limits: dict[str, Callable[..., str | None]] = field(default_factory=dict)
    # The SwiGLU MLP runs GEMM1 / GEMM3 as this backend's fused ``mm_swiglu_quant`` / ``mm_dswiglu_quant`` by
    # default when this backend runs its GEMMs (the reference implements those ops too, as their oracle, but the
    # MLP fuses there only when asked: ``MXFP8Config(fused_epilogues=True)``).
    fuses_mlp: bool = False
    # ... and does so with token groups too (its fused ops take ``offs``)
    fuses_grouped_mlp: bool = False
    # op name -> ``plan(*op_args) -> launcher or None``: ``op_args`` are exactly the arguments the library passes
    # the implementation (``ops[op]``) on the first call of a key; the launcher repeats the op for later eager calls
    # whose key (tensor shapes, dtypes, devices, the other arguments; with token groups the offsets' shape) equals
    # this one's, without re-checking what the key fixes (:mod:`cute_mxfp8.ops.api` keeps them; host time per
    # call).  It is called with the call's tensors: ``run(x)`` for a cast without ``offs``, ``run(x, offs)`` with
    # them, ``run(h13, offs)`` / ``run(dh, h13, offs)`` for the SwiGLU casts, and the GEMMs' launcher with every
    # implementation argument (:func:`same_op_plans`).  A plan must do per call whatever depends on values the
    # key does not fix (offsets' values: the kernel backends' grouped casts check them); return None for calls it
    # does not take (e.g. ``offs`` given), which then take the full path every time.
    plans: dict[str, Callable] = field(default_factory=dict)

    def refusal(self, op: str, device: torch.device, args: tuple | None) -> str | None:
        """Why this backend cannot run ``op`` on ``device`` with ``args`` (None: it can)."""
        reason = self.unavailable_reason(device)
        if reason is not None:
            return f"cannot run on {device}: {reason}"
        if op not in self.ops:
            return f"does not implement op {op!r}"
        if args is not None and op in self.limits:
            why = self.limits[op](*args)
            if why is not None:
                return f"cannot run {op} on these inputs: {why}"
        return None


_BACKENDS: dict[str, Backend] = {}


_ORDER: list[str] = []  # registered names, highest priority first (kept sorted by register_backend)


def register_backend(backend: Backend) -> None:
    """Add or replace a backend (launch plans made for the old set are dropped).

    ``backend``: a :class:`Backend` (``from cute_mxfp8.ops.backends import Backend``) with a non-empty str name;
    one of the same name is replaced.  TypeError for anything else."""
    if not isinstance(backend, Backend) or not isinstance(backend.name, str) or not backend.name:
        raise TypeError(f"register_backend takes a cute_mxfp8.ops.backends.Backend with a non-empty str name, got "
                        f"{backend!r}")
    _BACKENDS[backend.name] = backend
    _ORDER[:] = [b.name for b in sorted(_BACKENDS.values(), key=lambda b: -b.priority)]
    PLANS.clear()


# launch plans of eager calls: key -> launcher, or None where the chosen backend has no plan for the op
PLANS: dict = {}
_MAX_PLANS = 4096


def same_op_plans(ops: dict, names) -> dict:
    """Launch plans that are the ops themselves (for :attr:`Backend.plans`), for ``names`` in ``ops``: a repeat of
    a key then skips the wrappers' and the library's checks, the backend choice and the limits, which the key
    fixes; the op does its own work (allocation, compile-cache lookup, launch) on every call."""
    return {name: (lambda op: lambda *args: op)(ops[name]) for name in names if name in ops}


def make_plan(op: str, device, requested: str | None, args: tuple):
    """The chosen backend's launcher for calls like ``op(*args)`` (None when it has none)."""
    plan = _BACKENDS[resolve_backend(device, requested, op, args)].plans.get(op)
    return None if plan is None else plan(*args)


def remember_plan(key, launcher) -> None:
    if len(PLANS) >= _MAX_PLANS:  # shapes that keep changing: start over rather than grow without bound
        PLANS.clear()
    PLANS[key] = launcher


def registered_backends() -> list[str]:
    """Names of the registered backends, highest priority first."""
    return list(_ORDER)


def _requested(requested: str | None) -> str | None:
    name = requested or os.environ.get(ENV_VAR) or None
    if name is not None and name not in _BACKENDS:
        raise BackendUnavailableError(
            f"unknown cute_mxfp8 backend {name!r} (from {'the backend argument' if requested else ENV_VAR}); "
            f"registered backends: {registered_backends()}"
        )
    return name


def check_backend_name(requested: str | None) -> None:
    """:class:`BackendUnavailableError` for an unregistered backend name (``requested``, else ``CUTE_MXFP8_BACKEND``;
    None or "" with the variable unset: automatic): the part of :func:`resolve_backend`'s checks that needs no
    device, which the ops' fake impls run at trace time."""
    _requested(requested)


def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def resolve_backend(device, requested: str | None = None, op: str | None = None, args: tuple | None = None) -> str:
    """Name of the backend that runs ``op`` (or, with ``op=None``, the GEMM ops) on ``device`` with ``args``.

    Raises:
        BackendUnavailableError: the requested backend is unknown, cannot run on ``device``, lacks ``op``, or
            refuses these inputs (the message says which).
    """
    device = _device(device)
    name = _requested(requested)
    probe = op or "mm"
    if name is not None:
        reason = _BACKENDS[name].refusal(probe, device, args if op is not None else None)
        if reason is not None:
            others = [n for n in registered_backends() if _BACKENDS[n].refusal(probe, device, args) is None]
            raise BackendUnavailableError(f"cute_mxfp8 backend {name!r} {reason}; backends that can: {others}")
        return name
    for n in _ORDER:  # checked on every op call: no copy, no sort
        if _BACKENDS[n].refusal(probe, device, args) is None:
            return n
    raise BackendUnavailableError(f"no cute_mxfp8 backend implements {probe!r} on {device}")


def get_impl(op: str, device, requested: str | None = None, args: tuple | None = None) -> Callable:
    """The callable that implements ``op`` on ``device`` for ``args`` under the selection rules above."""
    return _BACKENDS[resolve_backend(device, requested, op, args)].ops[op]


def fuses_mlp(device, requested: str | None = None, grouped: bool = False) -> bool:
    """Whether the backend that runs the GEMMs on ``device`` (``requested`` or automatic) fuses the SwiGLU MLP's
    epilogues by default (:attr:`Backend.fuses_mlp`; with token groups :attr:`Backend.fuses_grouped_mlp`)."""
    b = _BACKENDS[resolve_backend(device, requested, "mm")]
    return b.fuses_grouped_mlp if grouped else b.fuses_mlp
