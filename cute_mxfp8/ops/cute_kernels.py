"""The ``sm90`` and ``sm100`` backends: ops implemented by CuTe DSL kernels (compiled through :mod:`cute_mxfp8.jit`).

Both backends run the same arch-generic kernels, compiled for ``sm_90a`` or ``sm_100a``.  Implemented so far:
``quantize_rowwise``, ``quantize_colwise`` and ``quantize_dual`` (one read of the input) for contiguous 2-D
inputs with K % 32 == 0, plain or blocked scales; token groups (``offs``) for ``quantize_rowwise`` (grouped-M
blocked scales) only.  Other ops and variants are
not implemented by these backends yet: automatic selection passes over them (the reference runs), and an
explicit ``backend="sm90"`` for them raises with the reason (:class:`BackendUnavailableError`).
"""

from __future__ import annotations

import functools

import torch

from .. import formats as F
from ..jit import compile_grouped_rowwise_quant, compile_quant
from .backends import Backend, register_backend
from .shapes import colwise_shapes, rowwise_shapes

_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_IN = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# backend name -> (compute capability major, compile target, the hardware it needs)
_ARCHS = {"sm90": (9, "sm_90a", "an SM90 (H100/H200)"), "sm100": (10, "sm_100a", "an SM100 (B200/GB200)")}


def _unavailable(name: str):
    major, _, hardware = _ARCHS[name]

    @functools.lru_cache(maxsize=None)
    def cached(device: torch.device) -> str | None:
        got = torch.cuda.get_device_capability(device)
        if got[0] != major:
            return f"needs {hardware} GPU (compute capability {major}.x), found {got[0]}.{got[1]}"
        try:
            import cutlass  # noqa: F401
        except ImportError as e:  # the DSL is a dependency; say so if it is missing
            return f"nvidia-cutlass-dsl is not importable ({e}); pip install nvidia-cutlass-dsl"
        return None

    def reason(device: torch.device) -> str | None:
        """Checked on every op call, so the per-GPU answer is cached (capability and DSL do not change)."""
        if device.type != "cuda":
            return f"needs {hardware} CUDA device, got a {device.type} tensor"
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cached(device)

    return reason


def _limits(x, scale_mode, elem_dtype, blocked, offs=None):
    if x.dim() != 2:
        return "only 2-D (M, K) inputs (3-D expert weights use the reference for now)"
    if offs is not None:
        return "token groups (offs) are not implemented in the kernels yet"
    if x.stride(1) != 1 or x.stride(0) != x.shape[1] or x.data_ptr() % 16:
        return "x must be contiguous with a 16-byte aligned data pointer (call .contiguous())"
    if x.shape[1] % 32:
        return "the kernels need K % 32 == 0"
    return None


def _rowwise_limits(x, scale_mode, elem_dtype, blocked, offs=None):
    # rowwise blocks never cross rows, so groups only change where blocked scales go (grouped-M kernel)
    return _limits(x, scale_mode, elem_dtype, blocked, None)


def _outputs(shapes, x, elem_dtype, blocked, groups=None):
    dshape, sshape = shapes(tuple(x.shape), blocked, groups)
    q = torch.empty(dshape, dtype=elem_dtype, device=x.device)
    # blocked: the kernel writes only real scales; the padding of the last tiles must read as zero
    s = (torch.zeros if blocked else torch.empty)(sshape, dtype=torch.uint8, device=x.device)
    return q, s


def _ops(arch: str) -> dict:
    def launch(direction, x, scale_mode, elem_dtype, blocked, *outs):
        if x.numel() > 0:
            compile_quant(direction, _IN[x.dtype], _ELEM[elem_dtype], scale_mode, blocked, arch)(x, *outs)
        return tuple(t.view(torch.float8_e8m0fnu) if t.dtype == torch.uint8 else t for t in outs)

    def quantize_rowwise(x, scale_mode, elem_dtype, blocked, offs=None):
        if offs is None or not blocked:
            return launch("rowwise", x, scale_mode, elem_dtype, blocked,
                          *_outputs(rowwise_shapes, x, elem_dtype, blocked))
        F.validate_offsets(offs, x.shape[0])  # a host sync, as in the reference; bad offsets raise ValueError
        q, s = _outputs(rowwise_shapes, x, elem_dtype, True, offs.shape[0])
        if x.numel() > 0 and offs.numel() > 0:
            fn = compile_grouped_rowwise_quant(_IN[x.dtype], _ELEM[elem_dtype], scale_mode, arch)
            fn(x, q, s, offs, F.group_tile_starts(offs))
        elif x.numel() > 0:
            launch("rowwise", x, scale_mode, elem_dtype, False, q, torch.empty(x.shape[0], x.shape[1] // 32,
                                                                                dtype=torch.uint8, device=x.device))
        return q, s.view(torch.float8_e8m0fnu)

    def quantize_colwise(x, scale_mode, elem_dtype, blocked, offs=None):
        return launch("colwise", x, scale_mode, elem_dtype, blocked, *_outputs(colwise_shapes, x, elem_dtype, blocked))

    def quantize_dual(x, scale_mode, elem_dtype, blocked, offs=None):
        outs = (*_outputs(rowwise_shapes, x, elem_dtype, blocked), *_outputs(colwise_shapes, x, elem_dtype, blocked))
        return launch("dual", x, scale_mode, elem_dtype, blocked, *outs)

    return {"quantize_rowwise": quantize_rowwise, "quantize_colwise": quantize_colwise,
            "quantize_dual": quantize_dual}


for _name, (_, _arch, _) in _ARCHS.items():
    register_backend(Backend(
        name=_name,
        priority=10,
        unavailable_reason=_unavailable(_name),
        ops=_ops(_arch),
        limits={"quantize_rowwise": _rowwise_limits, "quantize_colwise": _limits, "quantize_dual": _limits},
    ))
