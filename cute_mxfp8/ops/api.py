"""Documented Python entry points to the ``cute_mxfp8`` custom ops (``torch.ops.cute_mxfp8.*``).

Conventions shared by every function here (the numerics and layouts of :mod:`cute_mxfp8.formats`):

* MXFP8 data is ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; scales are ``torch.float8_e8m0fnu``, one per
  32 elements along the scaled dim.  All outputs are new contiguous tensors.
* ``blocked=True`` returns scales in the tcgen05/cuBLAS blocked layout as a flat buffer
  (:func:`cute_mxfp8.formats.to_blocked_scales`); ``blocked=False`` the plain layout.  The GEMM ops take blocked.
* ``offs``: int32 cumulative END offsets of token groups, shape (G,), ``offs[-1] <= M``; empty groups and groups
  of any size are legal.  Rows at or past ``offs[-1]`` belong to no group: they get no grouped scales and zero
  colwise data, while rowwise data (and plain rowwise scales) still quantize them from ``x``.  ``offs`` that is
  not an int32 1-D tensor on ``x``'s device raises ``ValueError`` (a list too).  Its *values* (non-decreasing,
  within ``[0, M]``) are checked with ``ValueError`` by the casts and SwiGLU casts on every backend and by every
  op of the ``reference`` backend: checking reads ``offs`` on the host (one device sync, once per offsets tensor
  and version), except for offsets made valid on the device and marked so
  (:func:`cute_mxfp8.ops.group_meta.mark_safe`: :func:`cute_mxfp8.nn.modules.device_offsets_from_counts`, what
  ``MXFP8GroupedExperts`` does with CUDA counts, and the transformers experts forward), which are not read.  The
  kernel backends' grouped GEMMs (``grouped_mm``, ``grouped_mm_wgrad``, the fused ``mm_*_quant`` with ``offs``)
  read offsets only on the device and clamp them into range: out-of-contract values there give a meaningless but
  in-bounds result, not an error.
* ``scale_mode`` ``"rceil"`` (default; cuBLAS's "block scaling factors for FP8 with UE8M0 scales": the smallest
  power of two ``>= amax / max_elem``) or ``"floor"`` (OCP MX v1.0: ``2**(floor(log2(amax)) - emax_elem)``);
  ``elem_dtype`` ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.  :mod:`cute_mxfp8.formats` has the
  full math (rounding, saturation, NaN / Inf and zero blocks).
* Inputs of any strides are accepted: a non-contiguous tensor is copied to a contiguous one first (one more pass
  over it), then the same kernel runs, so the bytes equal those of the contiguous copy.
* ``backend``: ``None`` picks automatically (``CUTE_MXFP8_BACKEND`` if set, else the best backend for the
  device); an explicit backend that cannot run raises :class:`~cute_mxfp8.ops.backends.BackendUnavailableError`.
* Bad shapes, dtypes, devices or offsets raise ``ValueError`` naming the rule, before any kernel runs; an argument
  of the wrong type (a tensor argument other than ``offs`` that is not one, a flag that is not a bool) raises
  ``TypeError``.  Under
  ``torch.compile`` the ops' fake impls raise the same errors while tracing, which torch reports as its
  ``TorchRuntimeError`` with the message inside; offsets' values are checked when the program runs.
* In eager mode every wrapper here calls the op's implementation directly (see :func:`_direct`),
  which saves the custom-op dispatcher's host time; ``torch.ops.cute_mxfp8.*`` and torch.compile give the same
  results either way.  The ops are not differentiable (inputs that require grad go through the dispatcher, which
  says so on backward); :mod:`cute_mxfp8.ops.autograd` holds the differentiable functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch.utils._python_dispatch import _get_current_dispatch_mode

import os

from ..swiglu import GATE_UP_TILE
from . import backends as B
from . import library as L
from . import shapes as S
from .amp import _autocast_enabled

E4M3 = torch.float8_e4m3fn
# nn.Parameter is a Tensor subclass without a __torch_function__ of its own: the ops see a plain tensor
_PLAIN = (Tensor, torch.nn.Parameter)


def _direct(*tensors) -> bool:
    """Whether an op call may skip the custom-op dispatcher and run the op's own implementation: eager mode with
    plain tensors (or ``nn.Parameter``; not on the meta device, which the op's fake answers) and no torch function /
    dispatch mode active.  The result is the same (the custom op calls that implementation); only the dispatcher's
    host time (tens of microseconds) is saved.  Under torch.compile, fake tensors, subclasses, modes or inputs that
    require grad the call goes through ``torch.ops.cute_mxfp8`` as usual (the ops have no autograd formula on any
    path: their backward raises an error naming :mod:`cute_mxfp8.ops.autograd`'s functions)."""
    grad = torch.is_grad_enabled()  # under no_grad (e.g. inside an autograd.Function) no graph is built anyway
    return (not torch.compiler.is_compiling()
            and all(t is None or (type(t) in _PLAIN and not t.is_meta and not (grad and t.requires_grad))
                    for t in tensors)
            and not torch._C._is_torch_function_mode_enabled() and _get_current_dispatch_mode() is None)


def _op(impl, op, tensors: tuple, scale_mode: str = "", elem_dtype: torch.dtype = E4M3):
    """``impl`` (the op's implementation) when :func:`_direct` allows it for ``tensors``, else ``op`` (the custom
    op).  The wrappers check their other arguments' types first (:func:`_check_call`, :func:`_check_types`); a
    cast's ``scale_mode`` / ``elem_dtype`` of another type goes to the op, whose schema says so."""
    plain = _direct(*tensors) and type(scale_mode) is str and isinstance(elem_dtype, torch.dtype)
    return impl if plain else op


_NO_ALIGN = object()  # the rowwise cast has no token_align argument


def _cast(name: str, impl, op, x, scale_mode, elem_dtype, blocked, offs, backend, scale_block,
          token_align=_NO_ALIGN, blocks_2d=False):
    """One eager cast call, with a launch plan (:attr:`~cute_mxfp8.ops.backends.Backend.plans`) for repeats.

    The first call of a key (op, shape, dtypes, flags, device, backend request; with token groups also
    ``token_align`` and the shape, dtype and device of ``offs``) runs the full path (checks, backend choice, the
    op) and then asks the chosen backend for a plan; later calls of that key with a contiguous, 16-byte aligned
    ``x`` (and a contiguous ``offs``) under :func:`_direct`'s conditions run the plan (allocation + kernel; a
    grouped plan still checks the offsets' values, as the op does).  Everything a plan skips is fixed by the key,
    so results are the same bytes; only host time differs.  ``token_align``: the colwise casts' argument (absent
    for the rowwise cast, which has none); ``blocks_2d``: every cast's last argument."""
    key = None
    # exact types where a key must not equal another type's (True == 1, 128.0 == 128: the full path refuses those)
    if (not torch.compiler.is_compiling() and type(x) in _PLAIN and type(blocked) is bool
            and type(scale_block) is int and type(blocks_2d) is bool
            and (token_align is _NO_ALIGN or (type(token_align) is int and (token_align == 0 or offs is not None)))
            and (offs is None or type(offs) in _PLAIN)):
        # (a token_align other than 0 without offs takes the full path, which raises)
        key = (name, x.shape, x.dtype, x.device, scale_mode, elem_dtype, blocked, backend, scale_block,
               os.environ.get(B.ENV_VAR)) + (("blocks_2d",) if blocks_2d else ())
        if offs is not None:
            key += ("offs", offs.shape, offs.dtype, offs.device, token_align)
        try:
            run = B.PLANS.get(key)
        except TypeError:  # an unhashable argument: the full path says what is wrong with it
            key = run = None
        if run is not None and _plan_ready(x):
            if offs is None:
                return run(x)
            if _offs_ready(offs):
                return run(x, offs)
    _check_types(blocked, offs=offs, backend=backend, x=x)
    if type(blocks_2d) is not bool:
        raise TypeError(f"blocks_2d must be a bool, got {type(blocks_2d).__name__}")
    if token_align is not _NO_ALIGN:  # (before the dispatcher, whose schema would take False as 0)
        _check_token_align(token_align, offs)
    direct = _direct(x, offs)
    extra = () if token_align is _NO_ALIGN else (token_align,)
    out = (impl if direct else op)(x, scale_mode, elem_dtype, blocked, offs, backend or "", scale_block, *extra,
                                   blocks_2d)
    if key is not None and direct and key not in B.PLANS and _plan_ready(x) and (offs is None or _offs_ready(offs)):
        # the plan's arguments as the library passes the implementation its own (blocks_2d only when set)
        B.remember_plan(key, B.make_plan(name, x.device, backend,
                                         (x, scale_mode, elem_dtype, blocked, offs, scale_block, *extra,
                                          *((True,) if blocks_2d else ()))))
    return out


def _check_token_align(token_align, offs) -> None:
    """TypeError for a ``token_align`` that is not an int (False, 1.0: the dispatcher's schema would take them as
    0 / 1 under torch.compile), then the op's own value check (0 or 128, 128 with ``offs``)."""
    if type(token_align) is not int:
        raise TypeError(f"token_align must be an int (0 or 128), got {token_align!r}")
    S.check_token_align(token_align, offs)


def _check_offs(offs, required: bool = False) -> None:
    """``offs`` is a tensor (the checks of its dtype, shape and values follow in the op): a list or a missing
    ``offs`` gets the ValueError the module docstring promises, not the dispatcher's schema error."""
    if (offs is not None or required) and not isinstance(offs, Tensor):
        raise ValueError(f"offs must be a 1-D torch.int32 tensor of cumulative group END offsets, got "
                         f"{type(offs).__name__}" + ("; the grouped GEMMs require it" if required else ""))


def _check_tensors(**tensors) -> None:
    """TypeError naming the first argument (name -> value) that is not a tensor."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_call(backend=None, out_dtype=None, **tensors) -> None:
    """The schema's type checks of a GEMM or gate/up wrapper, with errors naming the argument: every named tensor
    a tensor (an optional one may be None: pass it only when given), ``backend`` None or a str, ``out_dtype`` a
    torch.dtype (when given)."""
    _check_tensors(**tensors)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be None or a str ('reference', 'sm90', 'sm100'), got {type(backend).__name__}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype (torch.bfloat16 or torch.float32), got {out_dtype!r}")


def _check_types(blocked, emit_hp=False, offs=None, backend=None, **tensors) -> None:
    """The schema's type checks, for calls that skip the dispatcher (``tensors``: argument name -> value)."""
    _check_offs(offs)
    _check_call(backend, **tensors)
    for name, flag in (("blocked", blocked), ("emit_hp", emit_hp)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def quantize_rowwise(x: Tensor, *, scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3,
                     blocked: bool = True, offs: Tensor | None = None, backend: str | None = None,
                     scale_block: int = 32, blocks_2d: bool = False):
    """Rowwise ("dim0", 1x32) MXFP8 quantization: blocks along the last dim.

    Args:
        x: (M, K) activations or (E, N, K) expert weights, bf16/fp32, ``K % 32 == 0``.
        offs: token groups of a 2-D ``x`` (2d-3d GEMM operand): with ``blocked=True`` each group's scales start
            on a fresh 128-row tile (:func:`cute_mxfp8.formats.to_blocked_scales_grouped_m`).
        scale_block: 32 (MXFP8, OCP MX v1.0) or 128, the Hopper fast mode's shared scales: every run of 4 blocks
            along the scaled dim takes the largest of their 4 scales (:func:`cute_mxfp8.formats.quantize_mxfp8`);
            same layouts, the 4 stored scales equal.  Here and in the other casts the kernels take one launch
            for it (each CTA reduces a 128-row run's amaxes, then casts it, kept in registers or reloaded from
            L2); so do the SwiGLU casts of bf16 inputs (fp32 inputs: an amax pass, then the cast).
        blocks_2d: with ``scale_block=128`` and no ``offs``, for weights: every 128 x 128 tile of the last two
            dims shares one scale (:func:`cute_mxfp8.formats.quantize_mxfp8`'s ``blocks_2d``; the fast mode's
            ``hopper_weight_blocks="128x128"``), so the rowwise and colwise casts hold the same elements and the
            fast-mode GEMMs take the operand with ``b_blocks_2d=True``.  ValueError otherwise.
    Returns:
        ``(data, scales)``: data of ``x``'s shape; scales plain (M, K/32) / (E, N, K/32), or blocked: 1-D
        ``blocked_scales_numel(M, K/32)`` (grouped: ``(M // 128 + G) * 128 * ceil4(K/32)``) / (E, numel).
    """
    return _cast("quantize_rowwise", L.quantize_rowwise_impl, L._quantize_rowwise, x, scale_mode, elem_dtype, blocked,
                 offs, backend, scale_block, blocks_2d=blocks_2d)


def quantize_colwise(x: Tensor, *, scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3,
                     blocked: bool = True, offs: Tensor | None = None, backend: str | None = None,
                     scale_block: int = 32, token_align: int = 0, blocks_2d: bool = False):
    """Colwise ("dim1", 32x1) MXFP8 quantization: blocks along dim -2, data stored transposed.

    The result is the K-major operand of the transposed product (``xᵀ`` as the ``a`` or ``b`` of
    :func:`mm` / :func:`grouped_mm_wgrad`): quantizing ``x`` colwise equals quantizing ``x.t()`` rowwise.

    Args:
        x: (M, K) activations (bf16/fp32, any M) or (E, N, K) expert weights (``N % 32 == 0``).
        offs: token groups along M (2d-2d wgrad operand): blocks never cross a group end, a group's last partial
            block is quantized as if zero-padded (:func:`cute_mxfp8.formats.quantize_mxfp8_grouped_k`).
        scale_block: 32 or 128 (as :func:`quantize_rowwise`; with ``offs`` the runs of 4 start at each group's
            first token).
        token_align: 0, or 128 with ``offs``: the cast of the groups padded with zero tokens to multiples of 128
            (:func:`cute_mxfp8.formats.pad_token_groups`), i.e. exactly ``quantize_colwise(xp, offs=padded)`` for
            ``xp, padded = pad_token_groups(x, offs, 128)``: data_t (K, 128 * (M // 128 + G)) with group g from
            column ``padded[g - 1]``, zeros between groups and after the last; scales of that cast.  Pass
            :func:`padded_offsets` ``(offs)`` as the offsets of :func:`grouped_mm_wgrad` (the unpadded ``offs``
            give a wrong result there, which no check can see): the result is the same as for the unpadded
            operands (the zero tokens add nothing).  The kernel backends then skip their gather into aligned
            groups where the host values of ``offs`` are known (an earlier grouped op read them; not under
            torch.compile).
        blocks_2d: 128 x 128 weight blocks (as :func:`quantize_rowwise`; no ``offs``).
    Returns:
        ``(data_t, scales)``:
        * 2-D, no offs: data_t (K, Mp) with Mp = ceil(M/32)*32, columns >= M are zero (padding written by the
          op); scales (K, Mp/32) plain or blocked 1-D.
        * 2-D with offs: data_t (K, M); scales (K, 4 * (M // 128 + G)) plain, group g's block columns starting at
          ``4 * group_tile_starts(offs)[g]``, or blocked per group
          (:func:`cute_mxfp8.formats.to_blocked_scales_grouped_k`: each group's tiles blocked on their own and
          stored one group after the other, byte for byte the 2d-2d scale buffer of ``torch._scaled_grouped_mm``).
        * 3-D (E, N, K): data_t (E, K, N); scales (E, K, N/32) or (E, blocked numel).
    """
    return _cast("quantize_colwise", L.quantize_colwise_impl, L._quantize_colwise, x, scale_mode, elem_dtype, blocked,
                 offs, backend, scale_block, token_align, blocks_2d)


def quantize_dual(x: Tensor, *, scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3,
                  blocked: bool = True, offs: Tensor | None = None, backend: str | None = None,
                  scale_block: int = 32, token_align: int = 0, blocks_2d: bool = False):
    """Rowwise and colwise quantization from one read of ``x``: ``(row_data, row_scales, col_data, col_scales)``,
    each exactly as :func:`quantize_rowwise` and :func:`quantize_colwise` return them for the same arguments:
    ``x`` (M, K) bf16/fp32 (with ``offs``: token groups along M, each cast's grouped layout) or (E, N, K) expert
    weights, ``K % 32 == 0`` (and ``N % 32 == 0`` for 3-D); ``scale_block`` and ``blocks_2d`` as there;
    ``token_align`` applies to the colwise outputs only; ``scale_mode``, ``elem_dtype``, ``blocked`` and
    ``backend`` as in the module conventions.  Raises what those two raise."""
    return _cast("quantize_dual", L.quantize_dual_impl, L._quantize_dual, x, scale_mode, elem_dtype, blocked,
                 offs, backend, scale_block, token_align, blocks_2d)


def quantize_gate_up(w1: Tensor, w3: Tensor, *, scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3,
                     blocked: bool = True, gate_up_tile: int = 0, backend: str | None = None,
                     scale_block: int = 32, blocks_2d: bool = False, direction: str = "dual"):
    """Quantize the gate (``w1``) and up (``w3``) projections into the fused W13 layout (:mod:`cute_mxfp8.swiglu`):
    the same bytes as casting each projection and packing the casts.  The kernel backends cast W13 once: with
    ``scale_block=128`` and ``gate_up_tile=0`` one dual cast reading w1 and w3 themselves, otherwise of a packed
    copy in the weights' dtype; the reference casts each and packs the casts.

    Args:
        w1, w3: (I, D) or (E, I, D), bf16/fp32, ``I % 32 == 0`` and ``D % 32 == 0``.
        gate_up_tile: 0 for the concatenated ``[w1; w3]`` layout; T (a multiple of 32 dividing I; the SM90 and
            SM100 fused epilogues use :data:`cute_mxfp8.swiglu.GATE_UP_TILE`) for runs of T gate then T up features.
        scale_block: 32 or 128 (:func:`quantize_rowwise`); 128 needs ``I % 128 == 0`` and ``gate_up_tile`` 0 or
            a multiple of 128, so that no 128-block of W13 along 2I mixes gate and up features (ValueError).
        blocks_2d: 128 x 128 blocks of each projection (:func:`quantize_rowwise`; with ``scale_block=128``, whose
            rule already keeps every tile of W13 inside one projection).
        direction: ``"dual"`` (both casts from one read), ``"rowwise"`` or ``"colwise"`` (that pair only: the
            SwiGLU MLP casts W13 rowwise in its forward and colwise in its backward; ValueError otherwise).
    Returns:
        ``(row, row_scales, col, col_scales)``: ``row`` (2I, D) / (E, 2I, D) blocked along D (GEMM1's ``b``);
        ``col`` (D, 2I) / (E, D, 2I) blocked along 2I (the w13 dgrad ``b``); scales as :func:`quantize_dual`.
        ``(row, row_scales)`` or ``(col, col_scales)`` for one ``direction``.
    """
    key = None
    # a launch plan for repeats, as _cast's (the MLP casts W13 every step): exact types, so no key equals another
    # type's (True == 1); the plan runs for contiguous, 16-byte aligned weights under _direct's conditions
    if (not torch.compiler.is_compiling() and type(w1) in _PLAIN and type(w3) in _PLAIN and type(blocked) is bool
            and type(gate_up_tile) is int and type(scale_block) is int and type(blocks_2d) is bool
            and type(direction) is str):
        key = ("quantize_gate_up", w1.shape, w1.dtype, w1.device, w3.shape, w3.dtype, w3.device, scale_mode,
               elem_dtype, blocked, gate_up_tile, backend, scale_block, blocks_2d, direction,
               os.environ.get(B.ENV_VAR))
        try:
            run = B.PLANS.get(key)
        except TypeError:  # an unhashable argument: the full path says what is wrong with it
            key = run = None
        if run is not None and _plan_ready(w1) and _plan_ready(w3):
            return run(w1, w3)
    # before the schema's type checks, which would raise a RuntimeError (a list scale_mode, a str elem_dtype)
    S.check_quant_args(scale_mode, elem_dtype, scale_block)
    _check_types(blocked, backend=backend, w1=w1, w3=w3)
    if type(gate_up_tile) is not int:
        raise TypeError(f"gate_up_tile must be an int (0, or a multiple of 32 dividing I), got {gate_up_tile!r}")
    S.check_blocks_2d(blocks_2d, scale_block)
    L._check_direction(direction)
    direct = _direct(w1, w3) and type(scale_mode) is str  # (elem_dtype: one of ELEM_DTYPES by the check above)
    args = (w1, w3, scale_mode, elem_dtype, blocked, gate_up_tile, backend or "", scale_block, blocks_2d, direction)
    out = tuple((L.quantize_gate_up_impl if direct else L._quantize_gate_up)(*args))
    if key is not None and direct and key not in B.PLANS and _plan_ready(w1) and _plan_ready(w3):
        B.remember_plan(key, B.make_plan("quantize_gate_up", w1.device, backend,
                                         (w1, w3, scale_mode, elem_dtype, blocked, gate_up_tile, scale_block,
                                          blocks_2d, direction)))
    return out


def _plan_ready(x: Tensor) -> bool:
    """Whether a launch plan may run on ``x`` (or be made from it; :func:`_cast`, :func:`quantize_gate_up`):
    contiguous, strided, 16-byte aligned, not a functorch wrapper, no autograd graph to build, no torch function /
    dispatch mode (:func:`_direct`'s conditions, spelled out with the cheapest checks: the planned call's host time
    is what plans are for), and autocast off for its device (the full path runs the op with autocast off; a plan
    runs it as it is)."""
    return (not torch._C._functorch.is_functorch_wrapped_tensor(x)  # (first: a vmap-batched tensor has no
            and x.layout == torch.strided and x.is_contiguous() and not x.data_ptr() % 16  # data pointer)
            and not (x.requires_grad and torch.is_grad_enabled())
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._len_torch_dispatch_stack()
            and not _autocast_enabled(x.device.type))


def _offs_ready(offs: Tensor) -> bool:
    """Whether a launch plan may take ``offs`` (with an ``x`` that is :func:`_plan_ready`): contiguous (what the
    kernels' limits ask), strided, not a functorch wrapper."""
    return (not torch._C._functorch.is_functorch_wrapped_tensor(offs) and offs.layout == torch.strided
            and offs.is_contiguous())


def _plan_key(name: str, tensors: tuple, offs, flags: tuple, backend):
    """The launch-plan key of an eager call of op ``name`` (as :func:`_cast`'s): the shapes, dtypes and devices of
    ``tensors`` (None for an optional one left out), ``flags`` (the op's other arguments, whose exact types the
    caller checked), the backend request and ``CUTE_MXFP8_BACKEND``, and the shape, dtype and device of ``offs``.
    None: the call takes the full path (traced, a tensor of another type, an unhashable argument)."""
    if (torch.compiler.is_compiling() or not all(t is None or type(t) in _PLAIN for t in tensors)
            or (offs is not None and type(offs) not in _PLAIN)):
        return None
    key = (name, *(None if t is None else (t.shape, t.dtype, t.device) for t in tensors), *flags, backend,
           os.environ.get(B.ENV_VAR))
    if offs is not None:
        key += ("offs", offs.shape, offs.dtype, offs.device)
    try:
        hash(key)
    except TypeError:  # the full path says what is wrong with the argument
        return None
    return key


def _plans_may_take(tensors: tuple, offs) -> bool:
    """Whether a launch plan may run on (or be made from) these tensors: :func:`_plan_ready` /
    :func:`_offs_ready`."""
    return all(t is None or _plan_ready(t) for t in tensors) and (offs is None or _offs_ready(offs))


def _planned(key, tensors: tuple, offs):
    """The launch plan of ``key`` if there is one and it may take this call's tensors, else None."""
    run = None if key is None else B.PLANS.get(key)
    return run if run is not None and _plans_may_take(tensors, offs) else None


def _remember(key, name: str, tensors: tuple, offs, args: tuple, backend) -> None:
    """After a direct full-path call of ``key``: ask the backend that ran it for a launch plan, made from ``args``
    (the implementation's arguments, as the library passes them)."""
    if key is not None and key not in B.PLANS and _plans_may_take(tensors, offs):
        device = next(t.device for t in tensors if t is not None)
        B.remember_plan(key, B.make_plan(name, device, backend, args))


def _with_plan(name: str, tensors: tuple, offs, flags: tuple, exact: bool, backend, run_args: tuple,
               plan_args: tuple, full):
    """One eager call of a wrapper with launch plans (the SwiGLU casts, the GEMMs): the plan of its key
    (:func:`_plan_key` of ``tensors``, ``offs``, ``flags``; no key unless the flags have ``exact`` types) called with
    ``run_args`` when there is one that may take the call; otherwise ``full()`` (the wrapper's checks and the op;
    returns ``(out, direct)``) and, after a ``direct`` call, a plan made from ``plan_args`` (the implementation's
    arguments)."""
    key = _plan_key(name, tensors, offs, flags, backend) if exact else None
    run = _planned(key, tensors, offs)
    if run is not None:
        out = run(*run_args)
        return tuple(map(L._as_declared, out)) if isinstance(out, tuple) else L._as_declared(out)
    out, direct = full()
    if direct:
        _remember(key, name, tensors, offs, plan_args, backend)
    return out


def mm(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
       bias: Tensor | None = None, backend: str | None = None, scale_block: int = 32,
       b_blocks_2d: bool = False) -> Tensor:
    """MXFP8 GEMM ``out = a · bᵀ (+ bias)`` with fp32 accumulation.

    Args:
        a: (M, K) and b: (N, K) MXFP8 data (e4m3 or e5m2 each), both K-major (blocks along K), ``K % 32 == 0``.
        a_scales, b_scales: E8M0 blocked scales of (M, K/32) and (N, K/32), flat 1-D tensors of
            :func:`cute_mxfp8.formats.blocked_scales_numel` bytes (``quantize_rowwise(..., blocked=True)``; plain
            2-D scales are refused).
        out_dtype: bf16 (default) or fp32.
        bias: optional (N,) bf16/fp32, added in fp32 to the fp32 accumulator before the one rounding to
            ``out_dtype`` (never rounded on its own first), as cuBLAS's bias epilogue does.
        scale_block: 128 states that both operands were quantized with ``scale_block=128`` (their 4 scales of
            every 128-run along K are equal).  The ``sm90`` backend then runs the Hopper fast mode's GEMM (fp8
            WGMMA, one promotion per 128 of K), which reads only the first scale of each run: on operands that
            keep the promise it computes the same product as with 32, on operands that break it a wrong one.
            The ``reference`` backend checks the promise (ValueError); the ``sm100`` kernel ignores the hint.
        b_blocks_2d: with ``scale_block=128``, states that ``b`` was quantized in 128 x 128 blocks
            (``blocks_2d=True``: its scales also equal along each 128 rows).  The ``sm90`` backend then runs the
            fast-mode GEMM with one scalar B scale per block (one FFMA per element and 128 of K instead of two; it
            reads only the first row's scale of each block); the reference checks the promise (ValueError); the
            ``sm100`` kernel applies every scale anyway.
    Returns: (M, N) in ``out_dtype``, contiguous.
    Raises: TypeError for a non-tensor operand or a non-bool ``b_blocks_2d``; ValueError for shapes, dtypes
    (fp16 ``out_dtype`` or bias included), scale buffers of the wrong size, devices, or ``scale_block`` /
    ``b_blocks_2d`` values (naming the fix); BackendUnavailableError for a ``backend`` that cannot run it.
    """
    def full():
        S.check_scale_block(scale_block)
        S.check_b_blocks_2d(b_blocks_2d, scale_block)
        _check_call(backend, out_dtype, a=a, a_scales=a_scales, b=b, b_scales=b_scales,
                    **({} if bias is None else {"bias": bias}))
        op = _op(L.mm_impl, L._mm, tensors)
        return op(a, a_scales, b, b_scales, out_dtype, backend or "", bias, scale_block, b_blocks_2d), op is L.mm_impl

    tensors = (a, a_scales, b, b_scales, bias)
    args = (a, a_scales, b, b_scales, out_dtype, bias, scale_block, *L._flag(b_blocks_2d))
    exact = type(out_dtype) is torch.dtype and type(scale_block) is int and type(b_blocks_2d) is bool
    return _with_plan("mm", tensors, None, (out_dtype, scale_block, b_blocks_2d), exact, backend, args, args, full)


def grouped_mm(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, *,
               out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None, scale_block: int = 32,
               b_blocks_2d: bool = False) -> Tensor:
    """2d-3d grouped MXFP8 GEMM (MoE forward and dgrad): ``out[rows of group g] = a[rows of g] · b[g]ᵀ``.

    Args:
        a: (M, K) MXFP8 data (e4m3 or e5m2, K-major, ``K % 32 == 0``) with grouped-M blocked scales
            (``quantize_rowwise(x, offs=offs)``: each group's rows from their own 128-row scale tile).
        b: (E, N, K) MXFP8 expert weights (either element type) with (E, numel) blocked scales
            (``quantize_rowwise(w)``); ``offs`` (E,) int32 cumulative group ends.
        out_dtype: bf16 (default) or fp32.
        scale_block: 128 states that both operands were quantized with ``scale_block=128`` (equal scales in
            every run of 4 along K).  The ``sm90`` backend then runs the Hopper fast mode's 2d-3d GEMM, which reads
            only the first scale of each run (a wrong product for operands that break the promise); the
            ``reference`` backend checks it (ValueError); the ``sm100`` kernel ignores the hint.
        b_blocks_2d: states that every expert of ``b`` was quantized in 128 x 128 blocks (as :func:`mm`).
    Returns: (M, N) in ``out_dtype``; rows at or past ``offs[-1]`` are zero.
    Raises: ValueError for shapes, dtypes, ``scale_block`` or an ``offs`` that is not an int32 (G,) tensor (its
    values: the reference backend only, below), naming the fix.

    ``offs`` must be the offsets ``a`` was quantized with: the scales' layout depends on them, and other offsets
    with the same group count give wrong results that no check can see.  The reference backend validates the
    values (``ValueError``); the kernel backends read them only on the device (no sync) and stay in bounds.
    """
    def full():
        _check_offs(offs, required=True)
        S.check_scale_block(scale_block)
        _check_call(backend, out_dtype, a=a, a_scales=a_scales, b=b, b_scales=b_scales)
        S.check_b_blocks_2d(b_blocks_2d, scale_block)
        op = _op(L.grouped_mm_impl, L._grouped_mm, (*tensors, offs))
        return (op(a, a_scales, b, b_scales, offs, out_dtype, backend or "", scale_block, b_blocks_2d),
                op is L.grouped_mm_impl)

    tensors = (a, a_scales, b, b_scales)
    args = (a, a_scales, b, b_scales, offs, out_dtype, scale_block, *L._flag(b_blocks_2d))
    exact = type(out_dtype) is torch.dtype and type(scale_block) is int and type(b_blocks_2d) is bool
    return _with_plan("grouped_mm", tensors, offs, (out_dtype, scale_block, b_blocks_2d), exact, backend, args,
                      args, full)


def grouped_mm_wgrad(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, offs: Tensor, *,
                     out_dtype: torch.dtype = torch.float32, backend: str | None = None,
                     scale_block: int = 32, split_halves: bool = False) -> Tensor:
    """2d-2d grouped MXFP8 GEMM (MoE wgrad): ``out[g] = a[:, tokens of g] · b[:, tokens of g]ᵀ``.

    Args:
        a: (N, M) and b: (K, M) token-major MXFP8 data (e4m3 or e5m2 each; any N, K, M) with grouped-K blocked
            scales (blocks of 32 tokens from each group's start), as ``quantize_colwise(dy, offs=offs)`` and
            ``quantize_colwise(x, offs=offs)`` return them; ``offs`` (G,) int32 cumulative group ends.
        out_dtype: fp32 (default) or bf16.
        scale_block: 128 states that both operands were quantized with ``scale_block=128`` (equal scales in
            every run of 4 blocks from each group's start).  The ``sm90`` backend then runs the Hopper fast mode's
            2d-2d GEMM, which reads only the first scale of each run; the ``reference`` backend checks the promise
            (ValueError); the ``sm100`` kernel ignores the hint.
        split_halves: return (2, G, N / 2, K) instead: ``[0]`` the first N / 2 rows of every group's product,
            ``[1]`` the others (``N % 256 == 0``, ValueError otherwise).  When ``a`` is the colwise cast of a
            concatenated gradient ``[dg | du]`` (the SwiGLU MLP's dh13, whose W13 is ``[w1; w3]``), these are dW1
            and dW3, each contiguous in its parameter's (E, I, D) layout (two views of one buffer).  The ``sm90``
            fast-mode kernel (``scale_block=128``) writes that layout directly; the other kernels' outputs are
            rearranged by one copy.
    Returns: (G, N, K) in ``out_dtype`` (or (2, G, N / 2, K), above); an empty group's slice is exactly zero.
    Raises: ValueError for shapes, dtypes, ``scale_block`` or an ``offs`` that is not an int32 (G,) tensor (its
    values: the reference backend only, below), naming the fix.

    ``offs`` must be the offsets ``a`` and ``b`` were quantized with (their scale layout depends on them; other
    offsets with the same group count give wrong results no check can see), or for operands cast with
    ``token_align=128``, :func:`padded_offsets` of those.  The reference backend validates the values
    (``ValueError``); the kernel backends read them only on the device (no sync) and stay in bounds.
    """
    def full():
        _check_offs(offs, required=True)
        S.check_scale_block(scale_block)
        _check_call(backend, out_dtype, a=a, a_scales=a_scales, b=b, b_scales=b_scales)
        if type(split_halves) is not bool:  # (before the dispatcher, whose schema would take 1 as True)
            raise TypeError(f"split_halves must be a bool, got {type(split_halves).__name__}")
        op = _op(L.grouped_mm_wgrad_impl, L._grouped_mm_wgrad, (*tensors, offs))
        return (op(a, a_scales, b, b_scales, offs, out_dtype, backend or "", scale_block, split_halves),
                op is L.grouped_mm_wgrad_impl)

    tensors = (a, a_scales, b, b_scales)
    args = (a, a_scales, b, b_scales, offs, out_dtype, scale_block, split_halves)
    exact = type(out_dtype) is torch.dtype and type(scale_block) is int and type(split_halves) is bool
    return _with_plan("grouped_mm_wgrad", tensors, offs, (out_dtype, scale_block, split_halves), exact, backend,
                      args, args, full)


def padded_offsets(offs: Tensor, token_align: int = 128) -> Tensor:
    """The offsets of 2d-2d operands cast with ``token_align`` (:func:`quantize_colwise`), to pass to
    :func:`grouped_mm_wgrad`: :func:`cute_mxfp8.formats.padded_group_offsets` of ``offs``, int32 (G,) on its
    device, computed once per offsets tensor.  Where the host values of ``offs`` are known (an earlier grouped op
    on a kernel backend read them), they are computed from those, so the wgrad knows its groups are aligned and
    reads the operands without a gather.  Raises ValueError for ``offs`` that is not a 1-D int32 tensor or a
    ``token_align`` other than 128; the values of ``offs`` are not read here (the casts validate them)."""
    if offs is None:
        raise ValueError("offs must be a 1-D torch.int32 tensor of cumulative group END offsets, got None")
    _check_offs(offs)
    S.check_offs(offs, offs.device)
    if type(token_align) is not int or token_align != 128:
        raise ValueError(f"token_align must be 128 (the padded group layout of the colwise casts), got "
                         f"{token_align!r}")
    from .token_layout import padded_offsets as _padded

    return _padded(offs, token_align)


def swiglu_quant(h13: Tensor, *, scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3, blocked: bool = True,
                 emit_hp: bool = False, offs: Tensor | None = None, backend: str | None = None,
                 scale_block: int = 32, token_align: int = 0):
    """Fused SwiGLU + dual MXFP8 quantization (forward): ``h = silu(g) · u`` in fp32 from ``h13 = [g | u]``.

    Args:
        h13: (M, 2I) bf16/fp32, the concatenated ``[g | u]`` layout (gate columns ``[0, I)``, up ``[I, 2I)``;
            :mod:`cute_mxfp8.swiglu`; the interleaved layout is the fused GEMM epilogues' only), ``I % 32 == 0``.
        emit_hp: also return ``h`` in ``h13.dtype``; otherwise the last output is an empty (0,) tensor.
        offs: token groups (grouped experts): colwise blocks never cross a group end.  Unlike the quantize ops,
            rows at or past ``offs[-1]`` (padding tokens) are zero in every output, rowwise and ``h`` included.
        scale_block: 32 or 128, h's casts as :func:`quantize_dual`.
        token_align: 0, or 128 with ``offs``: h's colwise outputs in the padded group layout of
            :func:`quantize_colwise`.
        scale_mode, elem_dtype, blocked, backend: as in the module conventions.
    Returns:
        ``(h_row, h_row_scales, h_col, h_col_scales, h_hp)`` with the layouts of :func:`quantize_dual` for an
        (M, I) tensor.
    Raises: TypeError for a non-tensor ``h13`` or non-bool flags; ValueError for its dtype, an odd width or one
    not a multiple of 64, ``offs`` / ``token_align`` / ``scale_block`` values (naming the fix);
    BackendUnavailableError for a ``backend`` that cannot run it.
    """
    def full():
        _check_types(blocked, emit_hp, offs, backend, h13=h13)
        _check_token_align(token_align, offs)
        op = _op(L.swiglu_quant_impl, L._swiglu_quant, (h13, offs))
        return (op(h13, scale_mode, elem_dtype, blocked, emit_hp, offs, backend or "", scale_block, token_align),
                op is L.swiglu_quant_impl)

    flags = (scale_mode, elem_dtype, blocked, emit_hp, scale_block, token_align)
    return _with_plan("swiglu_quant", (h13,), offs, flags, _exact_swiglu_flags(*flags[2:]), backend, (h13, offs),
                      (h13, *flags[:4], offs, *flags[4:]), full)


def dswiglu_quant(dh: Tensor, h13: Tensor, *, scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3,
                  blocked: bool = True, emit_hp: bool = False, offs: Tensor | None = None,
                  backend: str | None = None, scale_block: int = 32, token_align: int = 0):
    """Fused SwiGLU backward + dual MXFP8 quantization: ``dg = dh·u·silu'(g)``, ``du = dh·silu(g)`` in fp32.

    Args:
        dh: (M, I) upstream gradient of ``h``; h13: (M, 2I) saved pre-activation, concatenated ``[g | u]``; each
            bf16 or fp32 (they may differ), ``I % 32 == 0``.
        emit_hp: also return ``dh13 = [dg | du]`` in ``dh.dtype``; otherwise an empty (0,) tensor.
        offs: token groups, as for :func:`swiglu_quant` (rows at or past ``offs[-1]`` are zero in every output).
        scale_block: 32 or 128, dh13's casts as :func:`quantize_dual` (128-blocks along 2I may hold dg and du).
        token_align: 0, or 128 with ``offs``: dh13's colwise outputs in the padded group layout of
            :func:`quantize_colwise`.
        scale_mode, elem_dtype, blocked, backend: as in the module conventions.
    Returns:
        ``(dh13_row, row_scales, dh13_col, col_scales, dh13_hp)``, layouts of :func:`quantize_dual` for (M, 2I).
    Raises: TypeError for non-tensor inputs or non-bool flags; ValueError for dtypes, shapes that do not match
    (``h13`` must be ``dh``'s rows x 2I), ``offs`` / ``token_align`` / ``scale_block`` values (naming the fix);
    BackendUnavailableError for a ``backend`` that cannot run it.
    """
    def full():
        _check_types(blocked, emit_hp, offs, backend, dh=dh, h13=h13)
        _check_token_align(token_align, offs)
        op = _op(L.dswiglu_quant_impl, L._dswiglu_quant, (dh, h13, offs))
        return (op(dh, h13, scale_mode, elem_dtype, blocked, emit_hp, offs, backend or "", scale_block,
                   token_align), op is L.dswiglu_quant_impl)

    flags = (scale_mode, elem_dtype, blocked, emit_hp, scale_block, token_align)
    return _with_plan("dswiglu_quant", (dh, h13), offs, flags, _exact_swiglu_flags(*flags[2:]), backend,
                      (dh, h13, offs), (dh, h13, *flags[:4], offs, *flags[4:]), full)


def _exact_swiglu_flags(blocked, emit_hp, scale_block, token_align) -> bool:
    """Whether a SwiGLU cast's flags have the exact types a plan key needs (True == 1: the full path refuses 1)."""
    return (type(blocked) is bool and type(emit_hp) is bool and type(scale_block) is int
            and type(token_align) is int)


def _check_gate_up_tile(gate_up_tile) -> None:
    """The fused-epilogue ops take W13 / h13 interleaved; a concatenated tensor has the same shape and would give
    wrong results silently, so the caller states the layout."""
    if gate_up_tile != GATE_UP_TILE:
        raise ValueError(f"gate_up_tile must be {GATE_UP_TILE}: the fused epilogues read W13 / h13 interleaved in runs "
                         f"of {GATE_UP_TILE} (quantize_gate_up(w1, w3, gate_up_tile={GATE_UP_TILE})), got "
                         f"{gate_up_tile!r}")


def mm_swiglu_quant(a: Tensor, a_scales: Tensor, b13: Tensor, b13_scales: Tensor, *, gate_up_tile: int,
                    scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3, emit_hp: bool = False,
                    out_dtype: torch.dtype = torch.bfloat16, offs: Tensor | None = None,
                    backend: str | None = None):
    """GEMM1 of the SwiGLU MLP with its fused epilogue: ``acc = a · b13ᵀ`` (fp32), then h13 = acc in ``out_dtype``
    and ``h = silu(g) · u`` from the fp32 accumulator, dual-quantized (h itself is never rounded to bf16).

    Args:
        a: (M, K) MXFP8 (``x_row``), b13: (2I, K) MXFP8 W13 in the interleaved gate/up layout, as
            ``quantize_gate_up(w1, w3, gate_up_tile=GATE_UP_TILE)`` returns it (``I % 64 == 0``); blocked scales as
            for :func:`mm`.
        gate_up_tile: must be :data:`cute_mxfp8.swiglu.GATE_UP_TILE` (64), stating that b13 is interleaved: a
            concatenated ``[w1; w3]`` has the same shape and would give wrong results (ValueError otherwise).
        elem_dtype / scale_mode: h's MXFP8 cast.  emit_hp: also return h in fp32 (else an empty (0,)).
        out_dtype: h13's dtype, bf16 (default) or fp32.  backend: as in the module conventions.
        offs: token groups (2d-3d, as :func:`grouped_mm`): ``a`` with grouped-M scales, ``b13`` (E, 2I, K) with
            (E, numel) scales; rows at or past ``offs[-1]`` of every output are zero.  The SM90 and
            SM100 kernels take ``offs`` (SM100: compile-checked only, no SM100 GPU has run it); as for
            :func:`grouped_mm`, only the reference backend checks its values.
    Returns:
        ``(h13, h_row, h_row_scales, h_col, h_col_scales, h_hp)``: h13 (M, 2I) ``out_dtype`` interleaved like b13;
        the h outputs as :func:`quantize_dual` of an (M, I) tensor with blocked scales (grouped layouts with
        ``offs``: colwise blocks never cross a group end).
    Raises: TypeError for non-tensor operands or flags of the wrong type; ValueError for another
    ``gate_up_tile``, shapes, dtypes (an fp16 ``out_dtype`` included), scale buffer sizes, ``offs`` that is not
    an int32 (G,) tensor; BackendUnavailableError for a ``backend`` that cannot run it.
    """
    _check_gate_up_tile(gate_up_tile)
    _check_offs(offs)
    _check_types(True, emit_hp, backend=backend, a=a, a_scales=a_scales, b13=b13, b13_scales=b13_scales)
    _check_call(out_dtype=out_dtype)
    op = _op(L.mm_swiglu_quant_impl, L._mm_swiglu_quant, (a, a_scales, b13, b13_scales, offs), scale_mode, elem_dtype)
    return op(a, a_scales, b13, b13_scales, scale_mode, elem_dtype, emit_hp, out_dtype, backend or "", offs)


def mm_dswiglu_quant(a: Tensor, a_scales: Tensor, b: Tensor, b_scales: Tensor, h13: Tensor, *, gate_up_tile: int,
                     scale_mode: str = "rceil", elem_dtype: torch.dtype = E4M3, emit_hp: bool = False,
                     offs: Tensor | None = None, backend: str | None = None):
    """GEMM3 of the SwiGLU MLP (w2 dgrad) with its fused epilogue: ``dh = a · bᵀ`` (fp32), then
    ``dg = dh·u·silu'(g)``, ``du = dh·silu(g)`` with g, u from the saved ``h13``, dual-quantized as dh13.

    Args:
        a: (M, D) MXFP8 (``dy_row``), b: (I, D) MXFP8 (w2 colwise), blocked scales as for :func:`mm`;
            h13: (M, 2I) bf16/fp32 in the interleaved gate/up layout (``mm_swiglu_quant``'s first output).
        gate_up_tile: must be 64, stating that h13 is interleaved (as for :func:`mm_swiglu_quant`).
        emit_hp: also return dh13 in fp32 (else an empty (0,)).
        scale_mode, elem_dtype, backend: dh13's MXFP8 cast and the backend, as in the module conventions.
        offs: token groups (2d-3d): ``b`` (E, I, D) with (E, numel) scales, as for :func:`mm_swiglu_quant`; rows
            at or past ``offs[-1]`` of dh13 are zero whatever h13 holds there (values checked by the reference
            backend only).
    Returns:
        ``(dh13_row, row_scales, dh13_col, col_scales, dh13_hp)``: :func:`quantize_dual` of the (M, 2I) dh13 in
        the interleaved layout, blocked scales (grouped layouts with ``offs``).
    Raises: as :func:`mm_swiglu_quant`.
    """
    _check_gate_up_tile(gate_up_tile)
    _check_offs(offs)
    _check_types(True, emit_hp, backend=backend, a=a, a_scales=a_scales, b=b, b_scales=b_scales, h13=h13)
    op = _op(L.mm_dswiglu_quant_impl, L._mm_dswiglu_quant, (a, a_scales, b, b_scales, h13, offs), scale_mode,
             elem_dtype)
    return op(a, a_scales, b, b_scales, h13, scale_mode, elem_dtype, emit_hp, backend or "", offs)
