"""The ``sm90`` and ``sm100`` backends: ops implemented by CuTe DSL kernels (compiled through :mod:`cute_mxfp8.jit`).

Both backends run the same arch-generic kernels, compiled for ``sm_90a`` or ``sm_100a``.  Implemented so far:
``quantize_rowwise`` for 2-D inputs (plain or blocked scales, no group offsets).  Other ops and variants are
not implemented by these backends yet: automatic selection passes over them (the reference runs), and an
explicit ``backend="sm90"`` for them raises with the reason (:class:`BackendUnavailableError`).
"""

from __future__ import annotations

import torch

from ..jit import compile_rowwise_quant
from .backends import Backend, register_backend
from .shapes import rowwise_shapes

_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_IN = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ARCHS = {"sm90": ((9, 0), "sm_90a"), "sm100": ((10, 0), "sm_100a")}


def _unavailable(name: str):
    (cap, _), hardware = _ARCHS[name], {"sm90": "an SM90 (H100/H200)", "sm100": "an SM100 (B200/GB200)"}[name]

    def reason(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"needs {hardware} CUDA device, got a {device.type} tensor"
        got = torch.cuda.get_device_capability(device)
        if got[0] != cap[0]:
            return f"needs {hardware} GPU (compute capability {cap[0]}.{cap[1]}), found {got[0]}.{got[1]}"
        try:
            import cutlass  # noqa: F401
        except ImportError as e:  # the DSL is a dependency; say so if it is missing
            return f"nvidia-cutlass-dsl is not importable ({e}); pip install nvidia-cutlass-dsl"
        return None

    return reason


def _rowwise_limits(x, scale_mode, elem_dtype, blocked, offs):
    if x.dim() != 2:
        return "only 2-D (M, K) inputs (3-D expert weights use the reference for now)"
    if offs is not None and blocked:
        return "grouped (offs) blocked scales are not implemented in the kernel yet"
    if x.stride(1) != 1 or x.stride(0) != x.shape[1] or x.data_ptr() % 16:
        return "x must be contiguous with a 16-byte aligned data pointer (call .contiguous())"
    return None


def _quantize_rowwise(arch: str):
    def impl(x, scale_mode, elem_dtype, blocked, offs=None):
        m, k = x.shape
        (dshape, sshape) = rowwise_shapes((m, k), blocked, None)
        q = torch.empty(dshape, dtype=elem_dtype, device=x.device)
        # blocked: the kernel writes only real scales; the padding of the last tiles must read as zero
        s = (torch.zeros if blocked else torch.empty)(sshape, dtype=torch.uint8, device=x.device)
        if m > 0:
            fn = compile_rowwise_quant(_IN[x.dtype], _ELEM[elem_dtype], scale_mode, blocked, arch)
            fn(x, q, s)
        return q, s.view(torch.float8_e8m0fnu)

    return impl


for _name, (_cap, _arch) in _ARCHS.items():
    register_backend(Backend(
        name=_name,
        priority=10,
        unavailable_reason=_unavailable(_name),
        ops={"quantize_rowwise": _quantize_rowwise(_arch)},
        limits={"quantize_rowwise": _rowwise_limits},
    ))
