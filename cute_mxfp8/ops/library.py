"""The ``cute_mxfp8`` torch.library custom ops: schema, exact fake impls, and dispatch to a backend.

Each op is defined once with ``torch.library.custom_op``; its fake impl returns empty tensors of the exact output
shapes, dtypes and (contiguous) strides from :mod:`cute_mxfp8.ops.shapes`, so the ops trace under torch.compile
and pass ``torch.library.opcheck``; the real impl returns exactly those strides for inputs of any layout and runs
with autocast off (:func:`_call`).  The real impl validates the inputs and calls the implementation chosen by
:func:`cute_mxfp8.ops.backends.get_impl` (``backend=""`` means "automatic"; see that module for the rules).

Public, documented entry points are the wrappers in :mod:`cute_mxfp8.ops.api` (re-exported by ``cute_mxfp8.ops``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import Tensor

from ..formats import group_bounds
from . import shapes as S
from .amp import autocast_off
from .backends import check_backend_name, get_impl
from .gate_up import GATE_UP_DIRECTIONS
from .group_meta import host_copy, validated_end

_E8M0 = torch.float8_e8m0fnu
_NS = "cute_mxfp8"


def _call(op: str, device: torch.device, backend: str, *args):
    """Run ``op``'s implementation from the chosen backend on contiguous inputs with autocast off, and return
    outputs with the declared strides.

    * Layouts: a transposed or sliced input is copied to a contiguous one first, so it runs on the same kernel
      (and, on the reference, the same matmul) as its contiguous copy and gives the same bytes.
    * Autocast: the ops' arithmetic is fixed by the MX numerics, so ``torch.autocast`` must change nothing
      (no fp32 matmul of the reference running in bf16, no ``torch.cat`` / ``torch.stack`` of fp8 or E8M0
      tensors reaching autocast's type promotion, which rejects them).
    * Strides: the fakes declare every output contiguous; an implementation that computes from a transposed or
      sliced input may produce other strides (a no-op for outputs that already are contiguous).
    """
    args = tuple(a.contiguous() if isinstance(a, Tensor) else a for a in args)
    impl = get_impl(op, device, backend or None, args)
    with autocast_off(device):
        out = impl(*args)
    if isinstance(out, tuple):
        return tuple(_as_declared(t) for t in out)
    return _as_declared(out)


def _as_declared(t: Tensor) -> Tensor:
    """``t`` with exactly the strides of ``torch.empty(t.shape)`` (what the fakes return): a copy where they differ,
    which ``is_contiguous()`` alone misses for empty tensors and size-1 dims."""
    if t.is_contiguous() and t.numel() and 1 not in t.shape:  # then its strides are the contiguous ones
        return t
    if t.stride() == _contiguous_strides(t.shape):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _contiguous_strides(shape) -> tuple:
    """The strides of ``torch.empty(shape)`` (size-0 and size-1 dims count as 1), computed in plain Python: torch's
    own helper validates the shape first and costs ~15x more host time per call."""
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= d if d > 1 else 1
    return tuple(reversed(strides))


def _fake_of(op):
    """``op.register_fake`` for a fake impl that, after its own checks (the real impl's order), also refuses an
    unregistered ``backend`` name as the real op's dispatch would (:func:`~.backends.check_backend_name`): an
    exported or compiled program with a misspelt backend fails when traced, not when first run."""
    def register(fake):
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            out = fake(*args, **kwargs)
            check_backend_name(signature.bind(*args, **kwargs).arguments["backend"] or None)
            return out

        return op.register_fake(checked if "backend" in signature.parameters else fake)

    return register


def _empty(like: Tensor, shape, dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def _flag(on: bool) -> tuple:
    """A new trailing flag (``blocks_2d``, ``b_blocks_2d``) as the backends' positional argument only when set: a
    backend written before it (its functions without the parameter) still takes every call that does not use it."""
    return (True,) if on else ()


def _num_groups(offs: Optional[Tensor]) -> Optional[int]:
    return None if offs is None else offs.shape[0]


def _hp_shape(emit_hp: bool, shape):
    return shape if emit_hp else (0,)


# ---- quantize -------------------------------------------------------------------------------------------

def quantize_rowwise_impl(x: Tensor, scale_mode: str, elem_dtype: torch.dtype, blocked: bool,
                          offs: Optional[Tensor], backend: str, scale_block: int = 32,
                          blocks_2d: bool = False) -> tuple[Tensor, Tensor]:
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_blocks_2d(blocks_2d, scale_block, offs)
    S.check_quantize_input(x, offs, colwise=False, rowwise=True)
    return _call("quantize_rowwise", x.device, backend, x, scale_mode, elem_dtype, blocked, offs, scale_block,
                 *_flag(blocks_2d))


_quantize_rowwise = torch.library.custom_op(f"{_NS}::quantize_rowwise", quantize_rowwise_impl, mutates_args=())


@_fake_of(_quantize_rowwise)
def _(x, scale_mode, elem_dtype, blocked, offs, backend, scale_block=32, blocks_2d=False):
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_blocks_2d(blocks_2d, scale_block, offs)
    S.check_quantize_input(x, offs, colwise=False, rowwise=True)
    d, s = S.rowwise_shapes(tuple(x.shape), blocked, _num_groups(offs))
    return _empty(x, d, elem_dtype), _empty(x, s, _E8M0)


def quantize_colwise_impl(x: Tensor, scale_mode: str, elem_dtype: torch.dtype, blocked: bool,
                          offs: Optional[Tensor], backend: str, scale_block: int = 32,
                          token_align: int = 0, blocks_2d: bool = False) -> tuple[Tensor, Tensor]:
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_quantize_input(x, offs, colwise=True, rowwise=False)
    S.check_token_align(token_align, offs)
    S.check_blocks_2d(blocks_2d, scale_block, offs, token_align)
    return _call("quantize_colwise", x.device, backend, x, scale_mode, elem_dtype, blocked, offs, scale_block,
                 token_align, *_flag(blocks_2d))


_quantize_colwise = torch.library.custom_op(f"{_NS}::quantize_colwise", quantize_colwise_impl, mutates_args=())


@_fake_of(_quantize_colwise)
def _(x, scale_mode, elem_dtype, blocked, offs, backend, scale_block=32, token_align=0, blocks_2d=False):
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_quantize_input(x, offs, colwise=True, rowwise=False)
    S.check_token_align(token_align, offs)
    S.check_blocks_2d(blocks_2d, scale_block, offs, token_align)
    d, s = S.colwise_shapes(tuple(x.shape), blocked, _num_groups(offs), token_align)
    return _empty(x, d, elem_dtype), _empty(x, s, _E8M0)


def quantize_dual_impl(x: Tensor, scale_mode: str, elem_dtype: torch.dtype, blocked: bool,
                       offs: Optional[Tensor], backend: str, scale_block: int = 32,
                       token_align: int = 0, blocks_2d: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_quantize_input(x, offs, colwise=True, rowwise=True)
    S.check_token_align(token_align, offs)
    S.check_blocks_2d(blocks_2d, scale_block, offs, token_align)
    return _call("quantize_dual", x.device, backend, x, scale_mode, elem_dtype, blocked, offs, scale_block,
                 token_align, *_flag(blocks_2d))


_quantize_dual = torch.library.custom_op(f"{_NS}::quantize_dual", quantize_dual_impl, mutates_args=())


def _dual_fake(x_shape, like, elem_dtype, blocked, g, token_align=0):
    rd, rs = S.rowwise_shapes(x_shape, blocked, g)
    cd, cs = S.colwise_shapes(x_shape, blocked, g, token_align)
    return (_empty(like, rd, elem_dtype), _empty(like, rs, _E8M0),
            _empty(like, cd, elem_dtype), _empty(like, cs, _E8M0))


@_fake_of(_quantize_dual)
def _(x, scale_mode, elem_dtype, blocked, offs, backend, scale_block=32, token_align=0, blocks_2d=False):
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_quantize_input(x, offs, colwise=True, rowwise=True)
    S.check_token_align(token_align, offs)
    S.check_blocks_2d(blocks_2d, scale_block, offs, token_align)
    return _dual_fake(tuple(x.shape), x, elem_dtype, blocked, _num_groups(offs), token_align)


def _check_gate_up(w1: Tensor, w3: Tensor, gate_up_tile: int = 0, scale_block: int = 32) -> tuple:
    S.check_hp("w1", w1, ranks=(2, 3))
    S.check_hp("w3", w3, ranks=(2, 3))
    if w1.shape != w3.shape or w1.dtype != w3.dtype:
        raise ValueError(f"w1 and w3 must match in shape and dtype, got {tuple(w1.shape)} {w1.dtype} and "
                         f"{tuple(w3.shape)} {w3.dtype}")
    S.check_same_device(w1, w3)
    S.check_mult32("I (w1.shape[-2])", w1.shape[-2])
    S.check_mult32("D (w1.shape[-1])", w1.shape[-1])
    if gate_up_tile < 0:
        raise ValueError(f"gate_up_tile must be 0 (concatenated W13) or a positive multiple of 32, got {gate_up_tile}")
    if gate_up_tile % 32:
        raise ValueError(f"gate_up_tile must be 0 (concatenated W13) or a positive multiple of 32, got {gate_up_tile}")
    if gate_up_tile and w1.shape[-2] % gate_up_tile:
        raise ValueError(f"gate_up_tile = {gate_up_tile} must divide I = {w1.shape[-2]} (pad w1/w3 to a multiple of "
                         f"{gate_up_tile} rows, or pass gate_up_tile=0)")
    if scale_block == 128 and (w1.shape[-2] % 128 or gate_up_tile % 128):
        # W13's colwise 128-blocks run along 2I: each must hold features of one projection only
        raise ValueError(f"scale_block=128 needs I % 128 == 0 and gate_up_tile 0 or a multiple of 128 (a 128-block "
                         f"of W13 along 2I must not mix gate and up features), got I = {w1.shape[-2]}, gate_up_tile "
                         f"= {gate_up_tile}; pad I or use scale_block=32")
    packed = list(w1.shape)
    packed[-2] *= 2
    return tuple(packed)


def _check_direction(direction) -> None:
    """``quantize_gate_up``'s ``direction``: TypeError for a non-str (as for its other arguments), ValueError for
    another string."""
    if not isinstance(direction, str):
        raise TypeError(f"direction must be a str ('dual', 'rowwise' or 'colwise'), got {direction!r}")
    if direction not in GATE_UP_DIRECTIONS:
        raise ValueError(f"direction must be 'dual', 'rowwise' or 'colwise', got {direction!r}")


def quantize_gate_up_impl(w1: Tensor, w3: Tensor, scale_mode: str, elem_dtype: torch.dtype, blocked: bool,
                          gate_up_tile: int, backend: str, scale_block: int = 32, blocks_2d: bool = False,
                          direction: str = "dual") -> list[Tensor]:
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_blocks_2d(blocks_2d, scale_block)
    _check_direction(direction)
    _check_gate_up(w1, w3, gate_up_tile, scale_block)
    # (the trailing flags as the backends' positional arguments only when set: see _flag)
    tail = _flag(blocks_2d) if direction == "dual" else (blocks_2d, direction)
    return list(_call("quantize_gate_up", w1.device, backend, w1, w3, scale_mode, elem_dtype, blocked, gate_up_tile,
                      scale_block, *tail))


_quantize_gate_up = torch.library.custom_op(f"{_NS}::quantize_gate_up", quantize_gate_up_impl, mutates_args=())


@_fake_of(_quantize_gate_up)
def _(w1, w3, scale_mode, elem_dtype, blocked, gate_up_tile, backend, scale_block=32, blocks_2d=False,
      direction="dual"):
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_blocks_2d(blocks_2d, scale_block)
    _check_direction(direction)
    outs = _dual_fake(_check_gate_up(w1, w3, gate_up_tile, scale_block), w1, elem_dtype, blocked, None)
    return list(outs[GATE_UP_DIRECTIONS[direction]])


# ---- GEMMs ----------------------------------------------------------------------------------------------

def mm_impl(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, out_dtype: torch.dtype, backend: str,
            bias: Optional[Tensor] = None, scale_block: int = 32, b_blocks_2d: bool = False) -> Tensor:
    S.check_scale_block(scale_block)  # (the fake's order: a call with two faults names the same one)
    S.check_b_blocks_2d(b_blocks_2d, scale_block)
    S.check_mm(a, a_scales, b, b_scales, out_dtype, bias)
    return _call("mm", a.device, backend, a, a_scales, b, b_scales, out_dtype, bias, scale_block,
                 *_flag(b_blocks_2d))


_mm = torch.library.custom_op(f"{_NS}::mm", mm_impl, mutates_args=())


@_fake_of(_mm)
def _(a, a_scales, b, b_scales, out_dtype, backend, bias=None, scale_block=32, b_blocks_2d=False):
    S.check_scale_block(scale_block)
    S.check_b_blocks_2d(b_blocks_2d, scale_block)
    return _empty(a, S.check_mm(a, a_scales, b, b_scales, out_dtype, bias), out_dtype)


def grouped_mm_impl(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, out_dtype: torch.dtype,
                    backend: str, scale_block: int = 32, b_blocks_2d: bool = False) -> Tensor:
    S.check_scale_block(scale_block)
    S.check_b_blocks_2d(b_blocks_2d, scale_block)
    S.check_grouped_mm(a, a_scales, b, b_scales, offs, out_dtype)
    return _call("grouped_mm", a.device, backend, a, a_scales, b, b_scales, offs, out_dtype, scale_block,
                 *_flag(b_blocks_2d))


_grouped_mm = torch.library.custom_op(f"{_NS}::grouped_mm", grouped_mm_impl, mutates_args=())


@_fake_of(_grouped_mm)
def _(a, a_scales, b, b_scales, offs, out_dtype, backend, scale_block=32, b_blocks_2d=False):
    S.check_scale_block(scale_block)
    S.check_b_blocks_2d(b_blocks_2d, scale_block)
    return _empty(a, S.check_grouped_mm(a, a_scales, b, b_scales, offs, out_dtype), out_dtype)


def grouped_mm_wgrad_impl(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor,
                          out_dtype: torch.dtype, backend: str, scale_block: int = 32,
                          split_halves: bool = False) -> Tensor:
    S.check_scale_block(scale_block)
    S.check_grouped_mm_wgrad(a, a_scales, b, b_scales, offs, out_dtype, split_halves)
    return _call("grouped_mm_wgrad", a.device, backend, a, a_scales, b, b_scales, offs, out_dtype, scale_block,
                 split_halves)


_grouped_mm_wgrad = torch.library.custom_op(f"{_NS}::grouped_mm_wgrad", grouped_mm_wgrad_impl, mutates_args=())


@_fake_of(_grouped_mm_wgrad)
def _(a, a_scales, b, b_scales, offs, out_dtype, backend, scale_block=32, split_halves=False):
    S.check_scale_block(scale_block)
    return _empty(a, S.check_grouped_mm_wgrad(a, a_scales, b, b_scales, offs, out_dtype, split_halves), out_dtype)


def hp_grouped_wgrad_impl(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """fp32 ``a[g]ᵀ·b[g]`` per token group for fp32 (M, N) and (M, K) tensors -> (G, N, K): the high-precision
    wgrad of ``wgrad_with_hp`` (no backend: torch matmuls per group, bounds read from ``offs`` on the host; rows
    past ``offs[-1]`` belong to no group, an empty group's gradient is zero).  An op so that ``torch.compile``
    traces it as one opaque call instead of guarding on ``offs``'s values.  ValueError for inputs that are not
    fp32 (M, N) / (M, K) on one device, or ``offs`` that is not valid int32 END offsets within M."""
    _check_hp_grouped_wgrad(a, b, offs)
    validated_end(offs, a.shape[0])  # (one host read per offsets tensor, kept for the bounds below)
    host = host_copy(offs)  # (None for inference tensors, which are not cached: read again)
    out = a.new_zeros(offs.numel(), a.shape[1], b.shape[1])
    for g, (start, end) in enumerate(group_bounds(offs if host is None else host)):
        if end > start:
            out[g] = a[start:end].t() @ b[start:end]
    return out


_hp_grouped_wgrad = torch.library.custom_op(f"{_NS}::hp_grouped_wgrad", hp_grouped_wgrad_impl, mutates_args=())


@_fake_of(_hp_grouped_wgrad)
def _(a, b, offs):
    _check_hp_grouped_wgrad(a, b, offs)
    return _empty(a, (offs.shape[0], a.shape[1], b.shape[1]), a.dtype)


def _check_hp_grouped_wgrad(a: Tensor, b: Tensor, offs: Tensor) -> None:
    if (a.dtype != torch.float32 or b.dtype != torch.float32 or a.dim() != 2 or b.dim() != 2
            or a.shape[0] != b.shape[0]):
        raise ValueError(f"hp_grouped_wgrad takes fp32 (M, N) and (M, K) tensors, got {a.dtype} {tuple(a.shape)} and "
                         f"{b.dtype} {tuple(b.shape)}")
    S.check_same_device(a, b)
    S.check_offs(offs, a.device)


# ---- SwiGLU + dual quantization -------------------------------------------------------------------------

def swiglu_quant_impl(h13: Tensor, scale_mode: str, elem_dtype: torch.dtype, blocked: bool, emit_hp: bool,
                      offs: Optional[Tensor], backend: str, scale_block: int = 32,
                      token_align: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_swiglu(h13, offs)
    S.check_token_align(token_align, offs)
    return _call("swiglu_quant", h13.device, backend, h13, scale_mode, elem_dtype, blocked, emit_hp, offs,
                 scale_block, token_align)


_swiglu_quant = torch.library.custom_op(f"{_NS}::swiglu_quant", swiglu_quant_impl, mutates_args=())


@_fake_of(_swiglu_quant)
def _(h13, scale_mode, elem_dtype, blocked, emit_hp, offs, backend, scale_block=32, token_align=0):
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    i = S.check_swiglu(h13, offs)
    S.check_token_align(token_align, offs)
    m = h13.shape[0]
    return (*_dual_fake((m, i), h13, elem_dtype, blocked, _num_groups(offs), token_align),
            _empty(h13, _hp_shape(emit_hp, (m, i)), h13.dtype))


def dswiglu_quant_impl(dh: Tensor, h13: Tensor, scale_mode: str, elem_dtype: torch.dtype, blocked: bool,
                       emit_hp: bool, offs: Optional[Tensor], backend: str, scale_block: int = 32,
                       token_align: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_swiglu(h13, offs, dh)
    S.check_token_align(token_align, offs)
    return _call("dswiglu_quant", dh.device, backend, dh, h13, scale_mode, elem_dtype, blocked, emit_hp, offs,
                 scale_block, token_align)


_dswiglu_quant = torch.library.custom_op(f"{_NS}::dswiglu_quant", dswiglu_quant_impl, mutates_args=())


@_fake_of(_dswiglu_quant)
def _(dh, h13, scale_mode, elem_dtype, blocked, emit_hp, offs, backend, scale_block=32, token_align=0):
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    S.check_swiglu(h13, offs, dh)
    S.check_token_align(token_align, offs)
    shape = tuple(h13.shape)
    return (*_dual_fake(shape, h13, elem_dtype, blocked, _num_groups(offs), token_align),
            _empty(h13, _hp_shape(emit_hp, shape), dh.dtype))


# ---- GEMM + fused SwiGLU epilogues ------------------------------------------------------------------------

def mm_swiglu_quant_impl(a: Tensor, a_scales: Tensor, b13: Tensor, b13_scales: Tensor, scale_mode: str,
                         elem_dtype: torch.dtype, emit_hp: bool, out_dtype: torch.dtype, backend: str,
                         offs: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    S.check_quant_args(scale_mode, elem_dtype)
    S.check_mm_swiglu(a, a_scales, b13, b13_scales, out_dtype, offs)
    return _call("mm_swiglu_quant", a.device, backend, a, a_scales, b13, b13_scales, scale_mode, elem_dtype,
                 emit_hp, out_dtype, offs)


_mm_swiglu_quant = torch.library.custom_op(f"{_NS}::mm_swiglu_quant", mm_swiglu_quant_impl, mutates_args=())


@_fake_of(_mm_swiglu_quant)
def _(a, a_scales, b13, b13_scales, scale_mode, elem_dtype, emit_hp, out_dtype, backend, offs=None):
    S.check_quant_args(scale_mode, elem_dtype)
    i = S.check_mm_swiglu(a, a_scales, b13, b13_scales, out_dtype, offs)
    m = a.shape[0]
    return (_empty(a, (m, 2 * i), out_dtype), *_dual_fake((m, i), a, elem_dtype, True, _num_groups(offs)),
            _empty(a, _hp_shape(emit_hp, (m, i)), torch.float32))


def mm_dswiglu_quant_impl(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, h13: Tensor, scale_mode: str,
                          elem_dtype: torch.dtype, emit_hp: bool, backend: str,
                          offs: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    S.check_quant_args(scale_mode, elem_dtype)
    S.check_mm_dswiglu(a, a_scales, b, b_scales, h13, offs)
    return _call("mm_dswiglu_quant", a.device, backend, a, a_scales, b, b_scales, h13, scale_mode, elem_dtype,
                 emit_hp, offs)


_mm_dswiglu_quant = torch.library.custom_op(f"{_NS}::mm_dswiglu_quant", mm_dswiglu_quant_impl, mutates_args=())


@_fake_of(_mm_dswiglu_quant)
def _(a, a_scales, b, b_scales, h13, scale_mode, elem_dtype, emit_hp, backend, offs=None):
    S.check_quant_args(scale_mode, elem_dtype)
    i = S.check_mm_dswiglu(a, a_scales, b, b_scales, h13, offs)
    m = a.shape[0]
    return (*_dual_fake((m, 2 * i), a, elem_dtype, True, _num_groups(offs)),
            _empty(a, _hp_shape(emit_hp, (m, 2 * i)), torch.float32))


# ---- no gradient ----------------------------------------------------------------------------------------

def _no_gradient(name: str):
    """The backward of op ``name``: a RuntimeError naming the differentiable entry points.  The casts' outputs
    are MXFP8 data and E8M0 scales and the GEMMs take them, so the ops have no useful gradient of their own; the
    training paths (:mod:`cute_mxfp8.ops.autograd`) call them inside ``autograd.Function`` s with their own
    backward.  The error is raised when a gradient reaches the op (under torch.compile: when AOTAutograd traces
    the backward), as torch's own message for an op without a formula was, which named only
    ``register_autograd``."""
    def backward(ctx, *grads):
        raise RuntimeError(
            f"cute_mxfp8::{name} has no autograd formula (the training paths call it inside their own "
            f"autograd Functions), but a gradient reached it: an input required grad.  To train through MXFP8 "
            f"GEMMs use cute_mxfp8.ops.mxfp8_linear / mxfp8_grouped_mm / mxfp8_swiglu_mlp / "
            f"mxfp8_swiglu_mlp_packed, the MXFP8 modules or cute_mxfp8.convert_to_mxfp8; to call the op without "
            f"a graph pass detached inputs (x.detach()) or call it under torch.no_grad()")

    return backward


for _op in (_quantize_rowwise, _quantize_colwise, _quantize_dual, _quantize_gate_up, _mm, _grouped_mm,
            _grouped_mm_wgrad, _hp_grouped_wgrad, _swiglu_quant, _dswiglu_quant, _mm_swiglu_quant, _mm_dswiglu_quant):
    _op.register_autograd(_no_gradient(_op._name))
del _op
