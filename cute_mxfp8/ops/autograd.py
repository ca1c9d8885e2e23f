"""Autograd functions that run a Linear, a grouped GEMM and a whole SwiGLU MLP in MXFP8.

Every GEMM operand is quantized along that GEMM's contraction dim (the MLP data flow):

* Linear ``y = x·Wᵀ``: forward x rowwise along K, W rowwise along K; dgrad ``dx = dy·W`` with dy rowwise along N
  and W colwise along N; wgrad ``dW = dyᵀ·x`` with dy and x colwise along the tokens.
* SwiGLU MLP (dense, or grouped experts when ``offs`` is given): x dual-quantized once; GEMM1 against the fused
  W13 = [w1; w3]; SwiGLU + dual quantization of h from the fp32 accumulator (h in bf16 is never materialized;
  in the Hopper fast mode, ``scale_block=128``, GEMM1 writes h13 in the activation dtype and h comes from that,
  :func:`_hp_out`); GEMM2 against w2.  Backward: dy dual-quantized; w2 dgrad; dSwiGLU from the saved h13 + dual
  quantization of dh13; w13 dgrad (in the Hopper fast mode against W13 cast colwise there, the forward casting
  it rowwise only: :func:`_w13_dgrad_in_backward`); w2 and w13 wgrads (2d-2d grouped when grouped).
* ``wgrad_with_hp``: the weight gradients use the saved high-precision tensors instead (x, h, dy, dh13; h and
  dh13 in the activation dtype in the fast mode, where GEMM1 and the w2 dgrad write it).
* Fused epilogues (``MXFP8Config.fused_epilogues``; by default on where the ``sm90`` or ``sm100`` backend runs
  the GEMMs, dense and grouped, when I % 64 == 0, and never with ``hopper_block_k=128``): GEMM1 is
  ``mm_swiglu_quant`` and the w2 dgrad ``mm_dswiglu_quant``, with W13, h13 and dh13 in the interleaved gate/up
  layout (:mod:`cute_mxfp8.swiglu`); the other GEMMs are unchanged.

Non-tensor arguments are passed as plain values (str / dtype / bool) so that torch.compile treats them as
constants.  Gradients are returned in each input's dtype.  Under ``torch.autocast`` the activation is cast to the
autocast dtype first, so outputs have the dtype ``F.linear`` would give (MXFP8 ops take bf16 or fp32 only).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import Tensor

from ..config import resolve_config
from ..swiglu import GATE_UP_TILE, convert_gate_up, split_gate_up
from . import api
from .amp import autocast_input, autocast_off
from .backends import fuses_mlp, resolve_backend
from .shapes import fast_mode_hidden_reason, fused_hidden_reason, mxfp8_dims_reason
from .token_layout import prime_fast_schedules


__all__ = ["mxfp8_linear", "mxfp8_grouped_mm", "mxfp8_swiglu_mlp", "mxfp8_swiglu_mlp_packed"]


def _gemm(a, a_s, b, b_s, offs, out_dtype, backend, scale_block, b_blocks_2d=False):
    """Forward / dgrad GEMM, dense or 2d-3d; ``b_blocks_2d``: b is a weight cast in 128 x 128 blocks."""
    kw = dict(out_dtype=out_dtype, backend=backend, scale_block=scale_block, b_blocks_2d=b_blocks_2d)
    if offs is None:
        return api.mm(a, a_s, b, b_s, **kw)
    return api.grouped_mm(a, a_s, b, b_s, offs, **kw)


def _schedule_arch(device: torch.device, backend) -> str | None:
    """The build target of the fast mode's schedule kernel where the ``sm90`` backend runs the grouped GEMMs
    (:func:`~.token_layout.prime_fast_schedules`), else None (torch ops)."""
    return "sm_90a" if resolve_backend(device, backend, "grouped_mm") == "sm90" else None


def _hp_out(scale_block: int, activation_dtype: torch.dtype) -> torch.dtype:
    """The unfused SwiGLU MLP's GEMM1 / w2-dgrad output dtype: fp32 (the accumulator, the SwiGLU math's input
    in the MXFP8 contract), or in the Hopper fast mode (``scale_block=128``) the activation dtype: the SwiGLU
    casts read the bf16 h13 / dh that bf16 autograd has, half the bytes, and h13 needs no copy for the backward."""
    return activation_dtype if scale_block == 128 else torch.float32


def _wgrad(a_col, a_s, b_col, b_s, offs, backend, scale_block, out_dtype, split_halves=False):
    """``aᵀ·b`` over the token dim from two colwise-quantized operands (dense or 2d-2d grouped), accumulated in
    fp32 and rounded once to ``out_dtype`` (the weight's dtype) in the GEMM's epilogue: the same bytes as an fp32
    output followed by ``.to(out_dtype)`` (both round to nearest even), without the fp32 tensor or the extra
    pass over it.  ``split_halves`` (grouped only): the (2, G, N / 2, K) layout of ``grouped_mm_wgrad``."""
    kw = dict(out_dtype=out_dtype, backend=backend, scale_block=scale_block)
    if offs is None:
        return api.mm(a_col, a_s, b_col, b_s, **kw)
    return api.grouped_mm_wgrad(a_col, a_s, b_col, b_s, offs, split_halves=split_halves, **kw)


def _hp_wgrad(a: Tensor, b: Tensor, offs: Tensor | None) -> Tensor:
    """fp32 ``aᵀ·b`` for (M, N) and (M, K) high-precision tensors, per token group when ``offs`` is given (the
    ``cute_mxfp8::hp_grouped_wgrad`` op: traced as one call under ``torch.compile``)."""
    a, b = a.float(), b.float()
    if offs is None:
        return a.t() @ b
    return torch.ops.cute_mxfp8.hp_grouped_wgrad(a, b, offs)


def _no_autocast(fn):
    """Run a Function's forward / backward with autocast off on the device of its first tensor argument: every
    matmul and cast inside is MX math or fp32 by design (the activation was already cast to the autocast dtype
    before ``apply``, as ``F.linear`` would)."""

    @functools.wraps(fn)
    def run(ctx, *args):
        dev = next(a.device for a in args if isinstance(a, Tensor))
        with autocast_off(dev):
            return fn(ctx, *args)

    return run


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (non-reentrant activation checkpointing, ``save_on_cpu``) are in effect; True
    where this torch cannot say (private API), so those tensors take ``save_for_backward``."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top is None or top(False) is not None
    except TypeError:  # another signature of the private function: assume hooks
        return True


_RELEASED = "released"  # ctx.made after a backward that took the tensors completed
_TAKEN = "taken"  # ... while that backward runs (still there: it raised)
# whether the running backward was asked to keep the graph (retain_graph=True); private API: where this torch
# lacks it, the Functions save every tensor with save_for_backward
_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _keep(ctx, made: tuple, inputs: tuple) -> None:
    """Keep a Function's tensors for its backward.  ``inputs`` (the Function's inputs or views of them) always
    go through ``save_for_backward``, which refuses a backward after an in-place change of them.  ``made``
    (tensors this forward created, which nothing else holds) stay on ``ctx`` in eager mode without saved-tensor
    hooks, so the backward can drop each as soon as its last GEMM is queued (:func:`_kept`): saved tensors live
    until the whole backward returns, which put the h13 (M, 2I) of the SwiGLU MLP beside its wgrads' outputs.
    Under torch.compile or saved-tensor hooks (activation checkpointing, CPU offload) they are saved as usual."""
    if torch.compiler.is_compiling() or _saved_tensor_hooks_active() or _KEEP_GRAPH is None:
        ctx.save_for_backward(*made, *inputs)
        ctx.made = len(made)  # an int: how many of the saved tensors are ``made``
    else:
        ctx.save_for_backward(*inputs)
        ctx.made = list(made)  # a list: the tensors themselves (then _TAKEN / _RELEASED by the backward)


def _kept(ctx, name: str) -> tuple[list, tuple]:
    """(made, inputs) as :func:`_keep` was given them, in the backward of ``name`` (decorated with
    :func:`_frees_as_it_goes`).  The ``made`` list is the backward's only reference to those tensors when they
    stayed on ``ctx``: deleting a name bound to one frees its memory.  With ``retain_graph=True``, or inside
    compiled autograd (which traces this backward and keeps the graph's tensors itself), they stay on ``ctx``.

    Raises RuntimeError on a second backward without ``retain_graph`` (torch's message), and on a backward after
    one that raised once it had taken the tensors (they may be freed: the forward has to run again; with
    ``save_for_backward`` torch would have kept them)."""
    if isinstance(ctx.made, int):
        t = ctx.saved_tensors
        return list(t[:ctx.made]), t[ctx.made:]
    if ctx.made is _RELEASED:
        raise RuntimeError("Trying to backward through the graph a second time (or directly access saved tensors "
                           "after they have already been freed). Specify retain_graph=True if you need to "
                           "backward through the graph a second time")
    if ctx.made is _TAKEN:
        raise RuntimeError(f"cute_mxfp8: an earlier backward through {name} raised after it had begun freeing the "
                           "tensors its forward made (they are freed as the backward goes): run the forward again")
    made, inputs = ctx.made, ctx.saved_tensors
    if not torch.compiler.is_compiling() and not _KEEP_GRAPH():
        ctx.made = _TAKEN
    return list(made), inputs


def _frees_as_it_goes(fn):
    """A backward that takes its tensors with :func:`_kept`: marks them released once it returns."""

    @functools.wraps(fn)
    def run(ctx, *grads):
        out = fn(ctx, *grads)
        if ctx.made is _TAKEN:
            ctx.made = _RELEASED
        return out

    return run


def _first_order_only(name: str) -> None:
    """Double backward is not supported: raise where the engine would otherwise build a graph of the backward
    (``create_graph=True``) whose second-order terms through the MXFP8 GEMMs would silently be missing."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"cute_mxfp8: {name} does not support double backward (backward with create_graph=True, "
                           "e.g. torch.autograd.grad(..., create_graph=True) for a gradient penalty); keep the "
                           "layers that need second derivatives in high precision")


def _output(y: Tensor, shape) -> Tensor:
    """``y`` (a fresh contiguous tensor of the GEMM) in ``shape`` without making the Function's output a view
    of it, as ``F.linear`` folds batch dims: in-place ops on the output (``y.add_(residual)``) then work like on
    nn.Linear's, and FSDP2 sees no view."""
    return torch.ops.aten._unsafe_view(y, tuple(shape))


def _rows(t: Tensor) -> Tensor:
    """(..., C) -> (rows, C), also for C == 0 (where ``reshape(-1, 0)`` is ambiguous)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _quant(x, dtype, scale_mode, backend, offs, need_col, scale_block, token_align=0, need_row=True):
    """Rowwise (if ``need_row``) and colwise (if ``need_col``, in the padded group layout of ``token_align``)
    quantization: returns (row, row_s, col, col_s), None for a cast not made."""
    kw = dict(scale_mode=scale_mode, elem_dtype=dtype, offs=offs, backend=backend, scale_block=scale_block)
    if need_col and need_row:
        return api.quantize_dual(x, token_align=token_align, **kw)
    if need_col:
        return (None, None, *api.quantize_colwise(x, token_align=token_align, **kw))
    if need_row:
        return (*api.quantize_rowwise(x, **kw), None, None)
    return None, None, None, None


def _token_align(offs, scale_block: int) -> int:
    """The token alignment of the 2d-2d wgrad operands' colwise casts: 128 in the Hopper fast mode with token
    groups (each group padded with zero tokens to a multiple of 128, so the fast wgrad reads the casts as they
    are, without gathering them into 128-aligned groups), else 0."""
    return 128 if offs is not None and scale_block == 128 else 0


def _wgrad_offs(offs, token_align: int):
    """The offsets of the wgrad operands: those of the padded groups with ``token_align``, else ``offs``."""
    return api.padded_offsets(offs, token_align) if token_align else offs


def _w13_dgrad_in_backward(scale_block: int, tile) -> bool:
    """Whether the SwiGLU MLP casts W13's dgrad (colwise) operand in its backward, from w1 and w3, instead of in
    the forward's dual cast, where it would stay alive until the backward (and, grouped, beside the dSwiGLU at the
    step's peak): where one kernel casts W13 from w1 and w3 (128-blocks, concatenated [w1; w3], the Hopper fast
    mode's cast), so the late cast costs one more read of the weights and a launch.  The 32-block and interleaved
    casts pack a copy of W13 in the weights' dtype first, which a second cast would repeat: they cast both in the
    forward."""
    return scale_block == 128 and not tile


def _w13_casts(w1, w3, tile, direction: str, scale_block: int, blocks_2d: bool, qw: dict):
    """W13's casts in ``tile``'s layout (``direction`` as :func:`~.api.quantize_gate_up`'s): from w1 and w3, or,
    with ``w3`` None, from ``w1`` holding them packed, ``[w1; w3]`` along dim -2 (:func:`mxfp8_swiglu_mlp_packed`):
    cast as it is for the concatenated layout (no copy), re-packed first for the interleaved one (as the kernel
    backends' cast of w1 and w3 packs a copy).  The same bytes either way: no scale block crosses the gate / up
    boundary (I is a multiple of 32, of 128 with 128-blocks)."""
    if w3 is not None:
        return api.quantize_gate_up(w1, w3, gate_up_tile=tile or 0, scale_block=scale_block, blocks_2d=blocks_2d,
                                    direction=direction, **qw)
    w13 = convert_gate_up(w1, dim=-2, from_tile=None, to_tile=tile) if tile else w1
    cast = {"dual": api.quantize_dual, "rowwise": api.quantize_rowwise, "colwise": api.quantize_colwise}[direction]
    return cast(w13, scale_block=scale_block, blocks_2d=blocks_2d, **qw)


def _weight_forward(weight, operands, scale_mode, elem_dtype, backend, scale_block, blocks_2d=False):
    """The weight's forward operand (rowwise): ``(row, row_s)``, cast here, or ``operands.rowwise()`` when
    ``operands`` is given (always 32-blocks: the config refuses the fast mode with the MXFP8 all-gather).
    ``blocks_2d``: 128 x 128 weight blocks (fast mode).  The dgrad's colwise operand is cast in the backward
    (:func:`_weight_dgrad`), so no fp8 copy of the weight is held from the forward to the backward (bf16 autograd
    holds none either: it saves the weight itself)."""
    if operands is None:
        return api.quantize_rowwise(weight, scale_mode=scale_mode, elem_dtype=elem_dtype, backend=backend,
                                    scale_block=scale_block, blocks_2d=blocks_2d)
    return operands.rowwise()


def _weight_dgrad(operands, weight, scale_mode, elem_dtype, backend, scale_block, blocks_2d=False):
    """The weight's dgrad operand (colwise), cast now from the saved ``weight`` (right before the dgrad GEMM: one
    more read of the weight than the forward's dual cast, and no fp8 copy alive in between), or
    ``operands.colwise()`` when ``operands`` is given."""
    if operands is not None:
        return operands.colwise()
    return api.quantize_colwise(weight, scale_mode=scale_mode, elem_dtype=elem_dtype, backend=backend,
                                scale_block=scale_block, blocks_2d=blocks_2d)


def _dgrad_weight(need_dx: bool, weight, operands):
    """The weight to save for its dgrad cast in the backward (:func:`_weight_dgrad`): where the input's gradient
    is computed and no ``operands`` supply the colwise operand; else None."""
    return weight if operands is None and need_dx else None


def _needs(ctx, grad: bool) -> tuple[bool, ...]:
    """A forward's ``ctx.needs_input_grad``, all False when its call builds no graph: ``grad`` is
    ``torch.is_grad_enabled()`` where the Function was applied (inside ``forward`` grad mode is always off, and
    ``needs_input_grad`` says only which inputs require grad), so under ``torch.no_grad`` / ``inference_mode`` the
    forward makes and keeps nothing for a backward (no colwise casts of the wgrad operands)."""
    return tuple(grad and g for g in ctx.needs_input_grad)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, x, weight, bias, operands, scale_mode, elem_dtype, grad_elem_dtype, wgrad_with_hp, backend,
                sb, w2d, grad):
        x2 = _rows(x)
        need_dx, need_w = _needs(ctx, grad)[:2]  # (x colwise, or x itself, only for the wgrad)
        x_row, x_row_s, x_col, x_col_s = _quant(x2, elem_dtype, scale_mode, backend, None,
                                                need_w and not wgrad_with_hp, sb)
        w_row, w_row_s = _weight_forward(weight, operands, scale_mode, elem_dtype, backend, sb, w2d)
        # the bias joins the fp32 accumulator inside the GEMM op: one rounding to x.dtype, as F.linear
        y = api.mm(x_row, x_row_s, w_row, w_row_s, out_dtype=x.dtype, bias=bias, backend=backend, scale_block=sb,
                   b_blocks_2d=w2d)
        # x itself, not its (rows, K) view, so an in-place change of x gets torch's version-counter error; the
        # weight for its dgrad cast (only where dx is computed; an in-place change of it is refused, as bf16's)
        _keep(ctx, (None if wgrad_with_hp else x_col, x_col_s),
              (x if wgrad_with_hp and need_w else None, _dgrad_weight(need_dx, weight, operands)))
        ctx.operands = operands
        ctx.cfg = (scale_mode, elem_dtype, grad_elem_dtype, wgrad_with_hp, backend, sb, w2d)
        ctx.meta = (x.shape, x.dtype, weight.dtype, bias is not None and bias.dtype)
        return _output(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    @_no_autocast
    @_frees_as_it_goes
    def backward(ctx, dy):
        _first_order_only("mxfp8_linear")
        (x_col, x_col_s), (x_hp, weight) = _kept(ctx, "mxfp8_linear")
        x_saved = x_col if x_col is not None else (None if x_hp is None else _rows(x_hp))  # (for dW only)
        del x_hp, x_col
        scale_mode, elem_dtype, gdt, hp, backend, sb, w2d = ctx.cfg
        x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        dy2 = _rows(dy)
        need_w = ctx.needs_input_grad[1]
        dy_row, dy_row_s, dy_col, dy_col_s = _quant(dy2, gdt, scale_mode, backend, None, need_w and not hp, sb,
                                                    need_row=ctx.needs_input_grad[0])  # (rowwise: for dx)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            w_col, w_col_s = _weight_dgrad(ctx.operands, weight, scale_mode, elem_dtype, backend, sb, w2d)
            dx = api.mm(dy_row, dy_row_s, w_col, w_col_s, out_dtype=x_dtype, backend=backend,
                        scale_block=sb, b_blocks_2d=w2d).reshape(x_shape)
            del w_col, w_col_s
        del dy_row, dy_row_s, weight  # freed before the wgrad's output (_kept)
        if need_w:
            dw = _hp_wgrad(dy2, x_saved, None) if hp else _wgrad(dy_col, dy_col_s, x_saved, x_col_s, None, backend,
                                                                 sb, w_dtype)
            dw = dw.to(w_dtype)
        if b_dtype is not False and ctx.needs_input_grad[2]:
            db = dy2.float().contiguous().sum(0).to(b_dtype)  # one summation order whatever dy's layout
        return dx, dw, db, None, None, None, None, None, None, None, None, None


class _GroupedMMFn(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, x, weight, offs, operands, scale_mode, elem_dtype, grad_elem_dtype, wgrad_with_hp, backend,
                sb, w2d, grad):
        need_dx, need_w = _needs(ctx, grad)[:2]
        x_row, x_row_s, x_col, x_col_s = _quant(x, elem_dtype, scale_mode, backend, offs,
                                                need_w and not wgrad_with_hp, sb, _token_align(offs, sb))
        w_row, w_row_s = _weight_forward(weight, operands, scale_mode, elem_dtype, backend, sb, w2d)
        y = _gemm(x_row, x_row_s, w_row, w_row_s, offs, x.dtype, backend, sb, w2d)
        _keep(ctx, (None if wgrad_with_hp else x_col, x_col_s),
              (x if wgrad_with_hp and need_w else None, offs, _dgrad_weight(need_dx, weight, operands)))
        ctx.operands = operands
        ctx.cfg = (scale_mode, elem_dtype, grad_elem_dtype, wgrad_with_hp, backend, sb, w2d)
        ctx.meta = (x.dtype, weight.dtype)
        return y

    @staticmethod
    @_no_autocast
    @_frees_as_it_goes
    def backward(ctx, dy):
        _first_order_only("mxfp8_grouped_mm")
        (x_col, x_col_s), (x_hp, offs, weight) = _kept(ctx, "mxfp8_grouped_mm")
        x_saved = x_hp if x_col is None else x_col
        del x_hp, x_col
        scale_mode, elem_dtype, gdt, hp, backend, sb, w2d = ctx.cfg
        x_dtype, w_dtype = ctx.meta
        need_w = ctx.needs_input_grad[1]
        ta = _token_align(offs, sb)
        dy_row, dy_row_s, dy_col, dy_col_s = _quant(dy, gdt, scale_mode, backend, offs, need_w and not hp, sb, ta,
                                                    need_row=ctx.needs_input_grad[0])  # (rowwise: for dx)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_col, w_col_s = _weight_dgrad(ctx.operands, weight, scale_mode, elem_dtype, backend, sb, w2d)
            dx = _gemm(dy_row, dy_row_s, w_col, w_col_s, offs, x_dtype, backend, sb, w2d)
            del w_col, w_col_s
        del dy_row, dy_row_s, weight  # freed before the wgrad's output (_kept)
        if need_w:
            dw = _hp_wgrad(dy, x_saved, offs) if hp else _wgrad(dy_col, dy_col_s, x_saved, x_col_s,
                                                                _wgrad_offs(offs, ta), backend, sb, w_dtype)
            dw = dw.to(w_dtype)
        return dx, dw, None, None, None, None, None, None, None, None, None, None


class _SwiGLUMLPFn(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, x, w1, w2, w3, offs, scale_mode, elem_dtype, grad_elem_dtype, wgrad_with_hp, backend, sb, w2d,
                fused, grad):
        # w3 None: w1 is W13 = [w1; w3] packed along dim -2 (mxfp8_swiglu_mlp_packed), whose gradient is returned
        # in that layout in w1's place
        x2 = _rows(x)
        needs = _needs(ctx, grad)
        qw = dict(scale_mode=scale_mode, elem_dtype=elem_dtype, backend=backend)
        tile = GATE_UP_TILE if fused else None  # the fused epilogues want W13 (and so h13, dh13) interleaved
        # the weights first: their casts do not need the token groups, whose first host read (the counts, or
        # offs in the first grouped op) waits for the GPU, so they are queued while the GPU still has work
        # W13's dgrad operand is cast in the backward from w1 and w3 where that is one more read of them
        # (_w13_dgrad_in_backward), so no (2I, D) fp8 copy of the weights is held from the forward to the backward
        late = _w13_dgrad_in_backward(sb, tile)
        w13 = _w13_casts(w1, w3, tile, "rowwise" if late or not needs[0] else "dual", sb, w2d, qw)
        (w13_row, w13_row_s), (w13_col, w13_col_s) = w13[:2], (w13[2:] or (None, None))
        keep_w13 = late and needs[0]  # w1 and w3 for that cast: only where dx is computed
        w2_row, w2_row_s = _weight_forward(w2, None, scale_mode, elem_dtype, backend, sb, w2d)  # (colwise: backward)
        if callable(offs):  # the grouped module's offsets, made from counts read on the host
            offs = offs()
        ta = _token_align(offs, sb)  # 128 in the fast mode's grouped MLP (never fused: fused is 32-blocks only)
        if ta:  # offsets made safe on the device (the grouped module's): their schedules in one or a few launches
            prime_fast_schedules(offs, x2.shape[0], _schedule_arch(x2.device, backend))
        # what the backward computes: dh (the w2 dgrad and the dSwiGLU) for any gradient of x, w1 or w3; dW13 for
        # w1 or w3; dW2 for w2 (a frozen subset skips the others' casts, GEMMs and saved tensors)
        need_w13 = needs[1] or needs[3]  # (needs[3] is False with W13 packed: w3 is None)
        need_w2 = needs[2]
        need_dh = needs[0] or need_w13
        x_row, x_row_s, x_col, x_col_s = _quant(x2, elem_dtype, scale_mode, backend, offs,
                                                need_w13 and not wgrad_with_hp, sb, ta)
        if fused:  # GEMM1 with the SwiGLU + dual-quant epilogue (32-blocks only: fused is off when sb is 128)
            h13, h_row, h_row_s, h_col, h_col_s, h_hp = api.mm_swiglu_quant(
                x_row, x_row_s, w13_row, w13_row_s, gate_up_tile=tile, emit_hp=wgrad_with_hp, out_dtype=x.dtype,
                offs=offs, **qw)
        else:  # GEMM1 -> fp32 accumulator; h13 is saved in the activation dtype, h comes from the accumulator
            # (the Hopper fast mode: GEMM1 writes h13 in the activation dtype, the tensor saved for the backward,
            # and h comes from it, as the backward's dSwiGLU does: no fp32 copy, its write and its reads)
            acc = _gemm(x_row, x_row_s, w13_row, w13_row_s, offs, _hp_out(sb, x.dtype), backend, sb, w2d)
            h13 = acc.to(x.dtype)
            h_row, h_row_s, h_col, h_col_s, h_hp = api.swiglu_quant(acc, emit_hp=wgrad_with_hp, offs=offs,
                                                                    scale_block=sb, token_align=ta, **qw)
            del acc
        y = _gemm(h_row, h_row_s, w2_row, w2_row_s, offs, x.dtype, backend, sb, w2d)
        # the input x (wgrad_with_hp; itself, not its rows view, for torch's in-place check) and offs are saved;
        # the rest this forward made, each only where the backward reads it (w2 for its dgrad cast and h13 for the
        # dSwiGLU where dh is computed; h for dW2, x for dW13)
        _keep(ctx, (None if wgrad_with_hp else x_col, x_col_s, h13 if need_dh else None,
                    (h_hp if wgrad_with_hp else h_col) if need_w2 else None, h_col_s if need_w2 else None,
                    w13_col, w13_col_s),
              (x if wgrad_with_hp and need_w13 else None, offs, *((w1, w3) if keep_w13 else (None, None)),
               w2 if need_dh else None))
        ctx.cfg = (scale_mode, elem_dtype, grad_elem_dtype, wgrad_with_hp, backend, tile, sb, w2d)
        ctx.meta = (x.shape, x.dtype, w1.dtype, w2.dtype)
        ctx.packed = w3 is None
        return _output(y, x.shape)

    @staticmethod
    @_no_autocast
    @_frees_as_it_goes
    def backward(ctx, dy):
        name = "mxfp8_swiglu_mlp_packed" if ctx.packed else "mxfp8_swiglu_mlp"
        _first_order_only(name)
        (x_col, x_col_s, h13, h_saved, h_col_s, w13_col, w13_col_s), (x_hp, offs, w1, w3, w2) = _kept(ctx, name)
        x_saved = x_col if x_col is not None else (None if x_hp is None else _rows(x_hp))  # (for dW13 only)
        del x_hp, x_col
        scale_mode, elem_dtype, gdt, hp, backend, tile, sb, w2d = ctx.cfg
        x_shape, x_dtype, w13_dtype, w2_dtype = ctx.meta
        dy2 = _rows(dy)
        need_w13 = ctx.needs_input_grad[1] or ctx.needs_input_grad[3]
        need_w2 = ctx.needs_input_grad[2]
        need_dh = ctx.needs_input_grad[0] or need_w13  # (as the forward decided what to keep)
        need_w = need_w13 or need_w2
        ta = _token_align(offs, sb)
        # dy rowwise feeds the w2 dgrad (needed for dh), colwise the w2 wgrad
        dy_row, dy_row_s, dy_col, dy_col_s = _quant(dy2, gdt, scale_mode, backend, offs, need_w2 and not hp, sb, ta,
                                                    need_row=need_dh)
        # The order keeps the backward's peak low: each operand is dropped once its last GEMM is queued (the
        # tensors _keep left on ctx are freed then; saved ones live until the backward returns).  The w2 wgrad
        # first frees dy's and h's colwise casts before the dSwiGLU, where h13, dh and both dh13 casts are alive.
        dw1 = dw2 = dw3 = None
        wg_offs = _wgrad_offs(offs, ta) if need_w else None
        if need_w2:
            dw2 = _hp_wgrad(dy2, h_saved, offs) if hp else _wgrad(dy_col, dy_col_s, h_saved, h_col_s, wg_offs,
                                                                 backend, sb, w2_dtype)
            dw2 = dw2.to(w2_dtype)
        del dy_col, dy_col_s, h_saved, h_col_s
        if not need_dh:  # only w2 trains: no dh, dx or dW13
            return None, None, dw2, None, None, None, None, None, None, None, None, None, None, None
        qg = dict(scale_mode=scale_mode, elem_dtype=gdt, emit_hp=hp, backend=backend)
        w2_col, w2_col_s = _weight_dgrad(None, w2, scale_mode, elem_dtype, backend, sb, w2d)
        del w2
        if tile:  # w2 dgrad with the dSwiGLU + dual-quant epilogue
            dh13_row, dh13_row_s, dh13_col, dh13_col_s, dh13_hp = api.mm_dswiglu_quant(
                dy_row, dy_row_s, w2_col, w2_col_s, h13, gate_up_tile=tile, offs=offs, **qg)
            del dy_row, dy_row_s, w2_col, w2_col_s
        else:
            # w2 dgrad (M, I): dh fp32 (the accumulator; the fast mode: in h13's dtype, as bf16 autograd has it)
            # beside the saved h13 in the activation dtype: the kernel reads both
            dh = _gemm(dy_row, dy_row_s, w2_col, w2_col_s, offs, _hp_out(sb, h13.dtype), backend, sb, w2d)
            del dy_row, dy_row_s, w2_col, w2_col_s
            dh13_row, dh13_row_s, dh13_col, dh13_col_s, dh13_hp = api.dswiglu_quant(dh, h13, offs=offs,
                                                                                    scale_block=sb, token_align=ta,
                                                                                    **qg)
            del dh  # (M, I): not alive beside the dgrad and wgrad GEMMs' outputs
        del h13
        dx = None
        if ctx.needs_input_grad[0]:
            if w13_col is None:  # W13's dgrad operand, cast now that h13 and dh are freed (not held since the
                # forward, and not beside the dSwiGLU, the grouped step's peak)
                w13_col, w13_col_s = _w13_casts(w1, w3, tile, "colwise", sb, w2d,
                                                dict(scale_mode=scale_mode, elem_dtype=elem_dtype, backend=backend))
            dx = _gemm(dh13_row, dh13_row_s, w13_col, w13_col_s, offs, x_dtype, backend, sb, w2d).reshape(x_shape)
        del dh13_row, dh13_row_s, w13_col, w13_col_s, w1, w3  # (M, 2I) and W13: freed before the w13 wgrad's output
        if need_w13:
            split = not hp and bool(ta) and not ctx.packed  # (2, E, I, D): the fast grouped wgrad's split
            if hp:
                dw13 = _hp_wgrad(dh13_hp, x_saved, offs)
            else:
                # the fast mode's grouped dW13 comes as (2, E, I, D): dW1 and dW3 each contiguous, so autograd
                # takes them as the parameters' gradients without a strided copy of each (W13 is [w1; w3] there;
                # the two gradients are views of one buffer, freed when both are); for a packed W13 it comes as
                # (E, 2I, D), W13's own layout
                dw13 = _wgrad(dh13_col, dh13_col_s, x_saved, x_col_s, wg_offs, backend, sb, w13_dtype, split)
            if ctx.packed:  # one gradient in W13's concatenated layout (from the interleaved one: one copy)
                dw1 = (convert_gate_up(dw13, dim=-2, from_tile=tile, to_tile=None) if tile else dw13).to(w13_dtype)
            elif split:
                dw1, dw3 = dw13[0], dw13[1]
            else:
                dw1, dw3 = (t.to(w13_dtype) for t in split_gate_up(dw13, dim=-2, tile=tile))
        return dx, dw1, dw2, dw3, None, None, None, None, None, None, None, None, None, None


def _cfg_args(config, device):
    c = resolve_config(config)
    sb = scale_block(c, device)
    return (c.scale_mode, c.elem_dtype, c.grad_elem_dtype, c.wgrad_with_hp, c.backend, sb,
            sb == 128 and c.hopper_weight_blocks == "128x128")


def scale_block(config, device) -> int:
    """The block of the GEMM operands' shared scales for layers on ``device``: 128 with
    ``MXFP8Config(hopper_block_k=128)`` unless the ``sm100`` backend runs the GEMMs there (the tcgen05 MMA applies
    every MX scale, so Blackwell keeps plain MXFP8), else 32."""
    c = resolve_config(config)
    if c.hopper_block_k == 32:
        return 32
    return 32 if resolve_backend(device, c.backend, "mm") == "sm100" else 128


def fused_epilogues_enabled(config, device, i: int, grouped: bool) -> bool:
    """Whether :func:`mxfp8_swiglu_mlp` with hidden size ``i`` on ``device`` runs with the GEMM-fused epilogues
    (:attr:`MXFP8Config.fused_epilogues`).  Raises ValueError where ``fused_epilogues=True`` cannot hold."""
    c = resolve_config(config)
    if scale_block(c, device) == 128:  # the fused epilogues cast h / dh13 in 32-blocks (True is refused by c)
        return False
    if c.fused_epilogues is None:
        return i % GATE_UP_TILE == 0 and fuses_mlp(device, c.backend, grouped)
    reason = fused_hidden_reason(c.fused_epilogues, i)
    if reason is not None:
        raise ValueError(f"{reason}: pad the gate and up projections EACH (w1 and w3, or each half of a packed "
                         f"w13; and w2's columns) to a multiple of {GATE_UP_TILE}")
    return c.fused_epilogues


def _check_dims32(**dims: int) -> None:
    """Every GEMM dim of an MXFP8 layer is scaled in blocks of 32 in some product (forward, dgrad or wgrad): check
    them all before the forward, so no backward fails on a dim the forward did not scale."""
    why = mxfp8_dims_reason(**dims)
    if why is not None:
        raise ValueError(f"{why}: pad the weights with zeros, or keep this layer in high precision")


def _check_weight(name: str, w: Tensor, shape: tuple, hint: str = "") -> None:
    """ValueError unless ``w`` is a bf16 / fp32 tensor of ``shape`` (``hint``: appended to the shape error)."""
    if not isinstance(w, Tensor) or w.dtype not in (torch.bfloat16, torch.float32):
        got = w.dtype if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"{name} must be a bfloat16 or float32 tensor, got {got}" + _weight_dtype_hint(got))
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}{hint}")


def _weight_dtype_hint(got) -> str:
    if got == torch.float16:
        return " (a model converted to float16? use model.to(torch.bfloat16))"
    if got == torch.float64:
        return "; convert it with .to(torch.bfloat16) or .float()"
    if isinstance(got, torch.dtype) and got.is_floating_point and got.itemsize == 1:
        return "; pass the high-precision weight: the function makes its own MXFP8 casts of it"
    return ""


def _check_input(x: Tensor, d: int, rank2: bool) -> None:
    if x.dim() < 1 or x.shape[-1] != d or (rank2 and x.dim() != 2):
        want = f"(tokens, {d})" if rank2 else f"(..., {d})"
        raise ValueError(f"x has shape {tuple(x.shape)}, expected {want} to match the weights")


def mxfp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, config=None, *,
                 weight_operands=None) -> Tensor:
    """``F.linear(x, weight, bias)`` with all three GEMMs in MXFP8.

    Args:
        x: (..., K) bf16/fp32; weight: (N, K); bias: (N,) or None.  ``K % 32 == 0`` and ``N % 32 == 0``.
        config: :class:`cute_mxfp8.config.MXFP8Config` (default one if None).  x, weight and bias each bf16 or
            fp32 (x is cast to the autocast dtype first under ``torch.autocast``).
        weight_operands: None (``weight`` is quantized here), or an object whose ``rowwise()`` returns the
            weight's forward operand ``(data, blocked scales)`` exactly as :func:`~cute_mxfp8.ops.quantize_rowwise`
            of ``weight`` would, and whose ``colwise()`` (called in backward) returns its dgrad operand as
            :func:`~cute_mxfp8.ops.quantize_colwise` would, both with the config's casts (``scale_block=128``
            with ``hopper_block_k=128`` where it applies, and ``blocks_2d=True`` with
            ``hopper_weight_blocks="128x128"``: the fast-mode GEMMs read only the shared scales they promise,
            which the reference backend checks).  The FSDP2 MXFP8 all-gather passes the all-gathered shards this
            way (:mod:`cute_mxfp8.nn.fsdp`; plain MXFP8 only); ``weight`` then only gives shape, dtype and the
            gradient.
    Returns: (..., N) in ``x.dtype``; gradients in each input's dtype.
    Raises: TypeError for x or weight that is not a tensor or a ``config`` that is not an MXFP8Config;
    ValueError for a weight that is not 2-D, dtypes other than bf16 / fp32 (fp16 included), shapes that do not
    match, K or N not a multiple of 32 (checked in the forward, so no backward fails on them);
    :class:`~cute_mxfp8.ops.backends.BackendUnavailableError` for a ``config.backend`` that cannot run here.
    """
    api._check_tensors(x=x, weight=weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be (out_features, in_features), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_weight("weight", weight, (n, k))
    _check_input(x, k, rank2=False)
    _check_dims32(**{"in_features K": k, "out_features N": n})
    if bias is not None:
        _check_weight("bias", bias, (n,))
    return _LinearFn.apply(autocast_input(x), weight, bias, weight_operands, *_cfg_args(config, x.device),
                           torch.is_grad_enabled())


def mxfp8_grouped_mm(x: Tensor, weight: Tensor, offs: Tensor, config=None, *, weight_operands=None) -> Tensor:
    """Grouped ``out[rows of g] = x[rows of g] · weight[g]ᵀ`` in MXFP8 (2d-3d forward and dgrad, 2d-2d wgrad).

    Args:
        x: (M, K) tokens sorted by group, bf16/fp32; weight: (E, N, K) bf16/fp32, ``K % 32 == 0``,
            ``N % 32 == 0``; offs: (E,) int32 cumulative end offsets (``offs[-1] <= M``; rows past it give zeros).
        config: :class:`cute_mxfp8.config.MXFP8Config` (default one if None).
        weight_operands: None (``weight`` is quantized here), or the experts' (E, N, K) operands as
            :func:`mxfp8_linear` takes them (``rowwise()`` / ``colwise()`` as ``quantize_rowwise`` /
            ``quantize_colwise`` of ``weight`` with the config's casts would return them).
    Returns: (M, N) in ``x.dtype``; rows at or past ``offs[-1]`` are zero; gradients in each input's dtype.
    Raises: TypeError for x or weight that is not a tensor or a ``config`` that is not an MXFP8Config;
    ValueError for ``offs`` that is not an int32 (E,) tensor (its values as :mod:`cute_mxfp8.ops.api` says), a
    weight that is not 3-D, dtypes other than bf16 / fp32, shapes that do not match, K or N not a multiple of 32;
    :class:`~cute_mxfp8.ops.backends.BackendUnavailableError` for a ``config.backend`` that cannot run here.
    """
    api._check_tensors(x=x, weight=weight)
    api._check_offs(offs, required=True)
    if weight.dim() != 3:
        raise ValueError(f"weight must be (E, N, K) expert weights, got shape {tuple(weight.shape)}")
    _check_weight("weight", weight, tuple(weight.shape))
    _check_input(x, weight.shape[2], rank2=True)
    _check_dims32(K=weight.shape[2], N=weight.shape[1])
    return _GroupedMMFn.apply(autocast_input(x), weight, offs, weight_operands, *_cfg_args(config, x.device),
                              torch.is_grad_enabled())


def mxfp8_swiglu_mlp(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offs: Tensor | None = None,
                     config=None) -> Tensor:
    """``w2(silu(w1(x)) * w3(x))`` as one MXFP8 autograd function (the data flow of this module's docstring).

    Args:
        x: (..., D) bf16/fp32 (2-D (M, D) sorted by expert when ``offs`` is given).
        w1, w3: (I, D) or (E, I, D); w2: (D, I) or (E, D, I); all three bf16 or fp32, w1 and w3 in one dtype;
            ``D % 32 == 0``, ``I % 32 == 0`` (``I % 128 == 0`` with ``MXFP8Config(hopper_block_k=128)`` where it
            applies).
        offs: None (dense) or (E,) int32 cumulative end offsets of the token groups (grouped experts).
        config: :class:`cute_mxfp8.config.MXFP8Config` (default one if None).
    Returns: x's shape and dtype; gradients in each input's dtype.
    Raises: TypeError for an argument that is not a tensor or a ``config`` that is not an MXFP8Config;
    ValueError for ``offs`` that is not an int32 (E,) tensor (its values as :mod:`cute_mxfp8.ops.api` says),
    weights of the wrong rank or shapes, dtypes other than bf16 / fp32, w1 and w3 in two dtypes, D or I not a
    multiple of 32 (128 above), ``fused_epilogues=True`` with I % 64 != 0;
    :class:`~cute_mxfp8.ops.backends.BackendUnavailableError` for a ``config.backend`` that cannot run here.
    """
    if offs is not None:
        api._check_offs(offs, required=True)
    return _swiglu_mlp(x, w1, w2, w3, offs, config)


def mxfp8_swiglu_mlp_packed(x: Tensor, w13: Tensor, w2: Tensor, offs: Tensor | None = None,
                            config=None) -> Tensor:
    """:func:`mxfp8_swiglu_mlp` with the gate and up projections packed in one tensor, ``w13 = [w1; w3]`` along
    dim -2 (Hugging Face's experts ``gate_up_proj``, torch.cat of w1 and w3): the same result and bytes, ``w13``'s
    gradient in its own layout, and no copies of its halves outside the casts.  (Splitting a packed weight into
    ``w1`` / ``w3`` copies for :func:`mxfp8_swiglu_mlp` writes both every forward, keeps them alive until the
    backward where the fast mode casts W13 there, and sends their gradients back through two full-size slice
    gradients.)  The casts
    read ``w13`` itself in the concatenated layout (the Hopper fast mode, the unfused MLP); the fused-epilogue
    path re-packs it into its interleaved layout once per cast, as it packs w1 and w3.

    Args:
        x: as :func:`mxfp8_swiglu_mlp`.
        w13: (2I, D), or (E, 2I, D) with ``offs``; bf16 / fp32, rows ``[0, I)`` the gate projection w1, rows
            ``[I, 2I)`` the up projection w3 (of each expert).
        w2: (D, I) or (E, D, I), bf16 / fp32.  offs, config: as :func:`mxfp8_swiglu_mlp`.
    Returns: x's shape and dtype; gradients in each input's dtype and layout.
    Raises: as :func:`mxfp8_swiglu_mlp` (an odd ``w13.shape[-2]`` included: ValueError).
    """
    if offs is not None:
        api._check_offs(offs, required=True)
    return _swiglu_mlp(x, w13, w2, None, offs, config)


def swiglu_mlp_from_counts(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, make_offs: Callable[[], Tensor],
                           config=None) -> Tensor:
    """:func:`mxfp8_swiglu_mlp` with token groups whose offsets ``make_offs()`` returns, called after the weights'
    casts are queued (for :class:`~cute_mxfp8.nn.MXFP8GroupedExperts`, whose offsets come from counts read on
    the host: that read waits for the GPU, which by then has the weight casts to run instead of idling while the
    host queues them).  ``make_offs`` must return a tensor :func:`mxfp8_swiglu_mlp` would accept as ``offs``."""
    def offs():
        o = make_offs()
        api._check_offs(o, required=True)
        return o

    return _swiglu_mlp(x, w1, w2, w3, offs, config)


def _blame_first_weight(x, name: str, w1: Tensor, w2, w3, d: int, i: int, packed: bool) -> None:
    """ValueError naming ``w1`` / ``w13`` where the other tensors agree and it alone does not (the shape checks
    after it take w1's shape as the truth and would blame w2): x and w2 agreeing on a D it lacks (named as
    transposed where its other dim is that D), or a packed w13 holding one half (its rows equal w2's I)."""
    if not (isinstance(x, Tensor) and isinstance(w2, Tensor) and x.dim() >= 1 and w2.dim() == w1.dim()):
        return
    want = ("(2I, D) = [w1; w3]" if packed else "(I, D)") + (" per expert" if w1.dim() == 3 else "")
    dx = x.shape[-1]
    if dx != d and w2.shape[-2] == dx:
        fix = f"; it looks transposed: pass {name}.transpose(-2, -1)" if w1.shape[-2] == dx else ""
        raise ValueError(f"{name} has shape {tuple(w1.shape)}: its last dim D={d}, but x and w2 have D={dx} "
                         f"({name} must be {want}){fix}")
    order = "(x, w13, w2)" if packed else "(x, w1, w2, w3) = (input, gate, down, up)"
    if dx != d and tuple(w2.shape[-2:]) == (d, i) and isinstance(w3, Tensor) and w3.dim() >= 1 \
            and w3.shape[-1] == dx:  # w1 and w2 agree with each other, x and w3 with each other: a swapped pair
        raise ValueError(f"w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} do not match x and w3 (D={dx}): the "
                         f"weights look out of order (w1 and w2 swapped, or rotated with w3); the arguments are "
                         f"{order}")
    if dx != d and tuple(w2.shape[-2:]) != (d, i):  # neither x nor w2 agrees with w1 (a wrong x alone is x's error,
        # raised by the checks after this)
        raise ValueError(f"{name} has shape {tuple(w1.shape)}: its last dim D={d}, but x has D={dx} ({name} must be "
                         f"{want}; the arguments are {order})")
    if packed and dx == d and w2.shape[-2] == d and w2.shape[-1] == 2 * i:
        raise ValueError(f"w13 has shape {tuple(w1.shape)}: {2 * i} rows, but w2 has I={2 * i} columns, so w13 "
                         f"holds one half; it must be {want}: torch.cat([w1, w3], dim=-2)")


def _swiglu_mlp(x, w1, w2, w3, offs, config):
    """The checks and the Function; ``w3`` None: ``w1`` is W13 packed (:func:`mxfp8_swiglu_mlp_packed`)."""
    packed = w3 is None
    api._check_tensors(**({"x": x, "w13": w1, "w2": w2} if packed else {"x": x, "w1": w1, "w2": w2, "w3": w3}))
    grouped = offs is not None
    name = "w13" if packed else "w1"
    if w1.dim() != (3 if grouped else 2):
        want = ("(E, 2I, D)" if packed else "(E, I, D)") if grouped else ("(2I, D)" if packed else "(I, D)")
        raise ValueError(f"{name} must be {want} {'with' if grouped else 'without'} offs, got shape "
                         f"{tuple(w1.shape)}" + ("" if grouped else "; pass offs for per-expert weights"))
    *e, i, d = w1.shape
    if packed:
        if i % 2:
            raise ValueError(f"w13 must be [w1; w3] along dim -2 (2I rows), got an odd {i}")
        i //= 2
    _blame_first_weight(x, name, w1, w2, w3, d, i, packed)
    if packed:
        _check_weight("w13", w1, (*e, 2 * i, d))
    else:
        _check_weight("w1", w1, (*e, i, d))
        _check_weight("w3", w3, (*e, i, d))
    _check_weight("w2", w2, (*e, d, i), hint=f": (D, I) for w13 of shape {tuple(w1.shape)} = (2I, D) = [w1; w3] "
                                             f"(a transposed w13 would be (D, 2I))" if packed else "")
    _check_input(x, d, rank2=grouped)
    _check_dims32(D=d, I=i)
    cfg = _cfg_args(config, x.device)  # ends with the operands' scale block and the weights' 128 x 128 blocks
    reason = fast_mode_hidden_reason(cfg[-2], i)
    halves = "each half of w13 (rows [0, I) and [I, 2I))" if packed else "w1 and w3 EACH"
    if reason is not None:
        raise ValueError(f"{reason}: pad {halves} (and w2's columns) to a multiple of 128, or use "
                         f"hopper_block_k=32")
    return _SwiGLUMLPFn.apply(autocast_input(x), w1, w2, w3, offs, *cfg,
                              fused_epilogues_enabled(config, x.device, i, grouped), torch.is_grad_enabled())
