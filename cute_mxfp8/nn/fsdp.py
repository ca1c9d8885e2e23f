"""FSDP2 MXFP8 weight all-gather for :class:`~cute_mxfp8.nn.weight.MXFP8TrainingWeight`
(``MXFP8Config(fsdp_mxfp8_all_gather=True)``).

FSDP2 (``fully_shard``) shards a parameter along dim 0 and all-gathers the shards before each use.  Its extension
hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the sharded tensor subclass) let the subclass choose
what travels.  With this mode each rank quantizes its own shard and the all-gather moves MXFP8 data + E8M0 scales
(``1 + 1/32`` bytes per element) instead of the bf16/fp32 shard:

* an all-gather issued in the forward (FSDP's pre-forward unshard or its forward prefetch) moves the **rowwise**
  operand (blocks along K): the forward GEMM's ``b``;
* an all-gather issued inside the backward (FSDP re-gathers resharded parameters in its pre-backward hook) moves
  the **colwise** operand (blocks along N; for 2-D weights each rank sends its (K, N/world) transposed block): the
  dgrad GEMM's ``b``.

Both inputs of either kind have the same sizes (FSDP2 allocates its all-gather buffers once).  Quantization is
block-local: rowwise blocks lie inside one row, and colwise blocks of 32 rows lie inside one shard when each rank
holds a multiple of 32 rows (2-D; 3-D expert weights are sharded by whole experts), so the gathered operands are
byte for byte those of quantizing the unsharded weight.  The shard is cast to the mixed-precision ``param_dtype``
first, so this mode reproduces the high-precision all-gather's training bit for bit.

The unsharded parameter FSDP builds is an :class:`MXFP8GatheredWeight`: it has the weight's shape and
``param_dtype`` but holds only the gathered operands.  ``F.linear`` and the 2d-3d ``torch._grouped_mm`` on it run
the MXFP8 autograd functions with those operands; its gradient is a plain tensor that FSDP reduce-scatters as usual.
An operand the current all-gather did not bring is all-gathered on demand, synchronously, from the shard: the
colwise one in the backward of parameters FSDP keeps unsharded after the forward (the root module,
``reshard_after_forward=False``), the rowwise one when activation checkpointing recomputes a forward inside the
backward.  Any other use of the unsharded weight raises (its high-precision values never travel).

Prior art: torchao's float8 FSDP2 all-gather and TransformerEngine's MXFP8 FSDP2 tensors use the same hooks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..formats import to_blocked_scales
from ..ops import api
from ..ops.autograd import mxfp8_grouped_mm, mxfp8_linear
from .redirect import match_call

__all__ = ["MXFP8GatheredWeight", "mxfp8_all_gather_reason", "pre_all_gather", "post_all_gather"]

_U8 = torch.uint8
_E8M0 = torch.float8_e8m0fnu


def mxfp8_all_gather_reason(shape, world: int) -> str | None:
    """Why a weight of ``shape`` sharded along dim 0 over ``world`` ranks cannot use the MXFP8 all-gather, or None."""
    rows = shape[0]
    if rows % world:
        return f"dim 0 ({rows}) is not divisible by the FSDP shard world size {world} (uneven shards are padded)"
    if len(shape) == 2 and (rows // world) % 32:
        return (f"each rank's {rows // world} rows of dim 0 are not a whole number of 32-row colwise blocks "
                f"(needs dim 0 % (32 * {world}) == 0)")
    return None


def _shard_operands(shard: Tensor, kind: str, config) -> list[Tensor]:
    """One rank's all-gather inputs, ``[data, scales]`` viewed as uint8.  2-D: rowwise (n, K) + plain (n, K/32),
    colwise (K, n) + plain (K, n/32); 3-D (e, N, K): rowwise (e, N, K), colwise (e, K, N), each with (e, numel)
    blocked scales (per-expert buffers concatenate along the experts).  Both kinds have the same numels."""
    kw = dict(scale_mode=config.scale_mode, elem_dtype=config.elem_dtype, blocked=shard.dim() == 3,
              backend=config.backend)
    quantize = api.quantize_rowwise if kind == "row" else api.quantize_colwise
    data, scales = quantize(shard, **kw)
    return [data.view(_U8), scales.view(_U8)]


def _assemble(kind: str, parts, shape, world: int, elem_dtype):
    """The unsharded weight's GEMM operand ``(data, blocked scales)`` from the gathered ``parts``, laid out as
    ``quantize_rowwise`` / ``quantize_colwise`` of the whole weight return them."""
    data, scales = parts
    if len(shape) == 3:
        e, n, k = shape
        d = data.view(elem_dtype).view((e, n, k) if kind == "row" else (e, k, n))
        return d, scales.view(_E8M0).view(e, -1)
    n, k = shape
    if kind == "row":
        return data.view(elem_dtype).view(n, k), to_blocked_scales(scales.view(_E8M0).view(n, k // 32))
    nl = n // world  # rank r sent columns [r*nl, (r+1)*nl) of the (K, N) transposed operand
    d = data.view(world, k, nl).permute(1, 0, 2).reshape(k, n).view(elem_dtype)
    s = scales.view(world, k, nl // 32).permute(1, 0, 2).reshape(k, n // 32).view(_E8M0)
    return d, to_blocked_scales(s)


def _refuse_compile() -> None:
    if torch.compiler.is_compiling():
        raise NotImplementedError("cute_mxfp8: the FSDP2 MXFP8 all-gather (MXFP8Config(fsdp_mxfp8_all_gather="
                                  "True)) runs in eager mode only; compile with fsdp_mxfp8_all_gather=False")


class _GatheredOperands:
    """What the latest all-gather of one parameter brought (``kind`` "row" or "col" and its parts, views of FSDP's
    all-gather buffers), and what is needed to all-gather the other kind on demand."""

    def __init__(self, group, world: int, shape, param_dtype):
        self.kind = self.parts = self.shard = None  # set by update()
        self.group, self.world, self.shape, self.param_dtype = group, world, tuple(shape), param_dtype

    def update(self, kind: str, parts, shard) -> None:
        """What an all-gather brought (``parts``) and the rank's shard (an MXFP8TrainingWeight) it came from."""
        self.kind, self.parts, self.shard = kind, tuple(parts), shard

    @property
    def config(self):
        return self.shard.config

    def rowwise(self):
        return self._operand("row")

    def colwise(self):
        return self._operand("col")

    def _operand(self, kind: str):
        parts = self.parts
        if self.kind != kind or parts[0].untyped_storage().nbytes() == 0:  # not brought, or freed by a reshard
            parts = self._gather_now(kind)
        return _assemble(kind, parts, self.shape, self.world, self.config.elem_dtype)

    def _gather_now(self, kind: str):
        """All-gather ``kind`` now, on the current stream, into fresh buffers (used once, then freed)."""
        local = _shard_operands(self.shard._inner.to(self.param_dtype), kind, self.config)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
        outs = []
        for t in local:
            out = t.new_empty(self.world * t.numel())
            gather(out, t.reshape(-1), group=self.group)
            outs.append(out.view(-1, *t.shape[1:]))
        return outs


# ops that only re-describe the unsharded weight (FSDP's as_strided, nn.Parameter's detach, transposes)
_aten = torch.ops.aten
_VIEWS = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten._unsafe_view.default,
          _aten.as_strided.default, _aten.t.default, _aten.transpose.int, _aten.permute.default}


class MXFP8GatheredWeight(Tensor):
    """The unsharded weight FSDP2 builds under the MXFP8 all-gather: the weight's shape and ``param_dtype``,
    holding only the all-gathered MXFP8 operands (module docstring).  Created by the FSDP2 hooks, not by users.

    ``F.linear(x, w)`` on the (N, K) weight and ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` on the
    (E, N, K) one run :func:`~cute_mxfp8.ops.mxfp8_linear` / :func:`~cute_mxfp8.ops.mxfp8_grouped_mm` with the
    gathered operands.  Views (detach, transposes, same-shape views) stay wrapped; any other op raises
    RuntimeError naming the fix."""

    _operands: _GatheredOperands

    @staticmethod
    def __new__(cls, operands: _GatheredOperands, size, stride, dtype, device, requires_grad=False):
        out = Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=dtype, device=device,
                                            requires_grad=requires_grad)
        out._operands = operands
        return out

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self):
        o = self._operands
        return (f"MXFP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, holds={o.kind}, "
                f"world={o.world})")

    def _is_weight(self) -> bool:  # the unsharded weight itself, (N, K) / (E, N, K) contiguous
        return tuple(self.shape) == self._operands.shape and self.is_contiguous()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = match_call(cls, func, args, kwargs)
        if call is not None:
            _refuse_compile()
            kind, x, w, extra = call
            if w._is_weight():
                run = mxfp8_linear if kind == "linear" else mxfp8_grouped_mm
                return run(x, w, extra, w._operands.config, weight_operands=w._operands)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0] if args and isinstance(args[0], cls) else None
        if func in _VIEWS and w is not None:
            # the view's size and strides, from the same op on a storage-less meta tensor
            meta = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device="meta")
            out = func(meta, *args[1:], **kwargs)
            return cls(w._operands, out.shape, out.stride(), w.dtype, w.device)
        raise RuntimeError(
            f"cute_mxfp8: {func} on a weight all-gathered in MXFP8 (FSDP2 with "
            "MXFP8Config(fsdp_mxfp8_all_gather=True)): only F.linear and the 2d-3d torch._grouped_mm can use it, "
            "its high-precision values never travel.  Keep this parameter on the high-precision all-gather: leave "
            "it out of quantize_weights_ (filter_fn) or wrap it with fsdp_mxfp8_all_gather=False.  (Reading the "
            "parameters outside a step, e.g. after a no_grad forward with reshard_after_forward=False, finds them "
            "still gathered: call model.reshard() first.)")


def _param_name(module, weight) -> str:
    for name, p in (module.named_parameters(recurse=False) if module is not None else ()):
        if getattr(p, "_local_tensor", p) is weight:
            return f"{type(module).__name__}.{name} "
    return ""


def pre_all_gather(weight, inner: Tensor, mesh, outer_size, module=None):
    """``fsdp_pre_all_gather`` of an MXFP8TrainingWeight shard in this mode: ``((data, scales), metadata)``.

    ``inner`` is the shard already in ``param_dtype``.  Raises ValueError when the sharding cannot carry MXFP8
    blocks (:func:`mxfp8_all_gather_reason`, or a placement other than FSDP's default ``Shard(0)``) and
    NotImplementedError under torch.compile (this mode is eager only)."""
    _refuse_compile()
    dim = mesh.ndim - 1  # the shard dim (HSDP meshes are (replicate, shard))
    world = mesh.size(dim)
    what = f"the MXFP8 all-gather of {_param_name(module, weight)}(shape {tuple(outer_size)})"
    if tuple(inner.shape[1:]) != tuple(outer_size)[1:]:
        raise ValueError(f"cute_mxfp8: {what}: the shard {tuple(inner.shape)} is not a block of rows; the MXFP8 "
                         "all-gather needs FSDP's default Shard(0) placement (no shard_placement_fn for it)")
    why = mxfp8_all_gather_reason(tuple(outer_size), world)
    if why is not None:
        raise ValueError(f"cute_mxfp8: {what}: {why}. Use MXFP8Config(fsdp_mxfp8_all_gather=False) for it "
                         "(quantize_weights_ filter_fn), or pad")
    # inside the autograd engine = FSDP's pre-backward unshard (or its backward prefetch): the dgrad operand
    kind = "col" if torch._C._current_graph_task_id() != -1 else "row"
    parts = _shard_operands(inner, kind, weight.config)
    packed = None
    if world == 1:  # FSDP2 hands a world of one only the first input: one flat buffer of both
        packed = [(p.numel(), tuple(p.shape[1:])) for p in parts]
        parts = [torch.cat([p.reshape(-1) for p in parts])]
    return tuple(parts), (kind, mesh.get_group(dim), world, tuple(outer_size), packed)


def _unpack(outputs, packed):
    if packed is None:
        return tuple(outputs)
    (flat,) = outputs
    pieces = flat.reshape(-1).split([n for n, _ in packed])
    return tuple(p.view(-1, *tail) for p, (_, tail) in zip(pieces, packed))


def post_all_gather(weight, outputs, metadata, param_dtype, out=None):
    """``fsdp_post_all_gather`` in this mode: the :class:`MXFP8GatheredWeight` (first call) or an update of ``out``."""
    kind, group, world, shape, packed = metadata
    if out is not None:
        out._operands.update(kind, _unpack(outputs, packed), weight)
        return None
    operands = _GatheredOperands(group, world, shape, param_dtype)
    operands.update(kind, _unpack(outputs, packed), weight)
    stride = torch.empty(shape, device="meta").stride()
    return MXFP8GatheredWeight(operands, shape, stride, param_dtype, weight.device), tuple(outputs)
