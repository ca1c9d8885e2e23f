"""MXFP8 training without a module swap: a weight tensor subclass whose ``F.linear`` / ``torch._grouped_mm`` run the
MXFP8 autograd functions.

:class:`MXFP8TrainingWeight` wraps a high-precision weight (bf16/fp32, the optimizer's master copy stays that
tensor).  Two calls on it are redirected through ``__torch_function__``:

* ``F.linear(x, w, bias)`` with ``w`` (N, K) -> :func:`cute_mxfp8.ops.mxfp8_linear` (forward, dgrad, wgrad);
* ``torch._grouped_mm(x, w_t, offs=offs)`` with ``x`` (T, K) tokens sorted by group, ``w_t`` the (E, K, N)
  transpose of an (E, N, K) expert weight (the 2d-3d call torchtitan's and torchao's experts make) ->
  :func:`cute_mxfp8.ops.mxfp8_grouped_mm` (2d-3d forward / dgrad, 2d-2d wgrad).

Any other use (``F.embedding``, ``x @ w``, slicing, ``torch._grouped_mm`` with ``bias`` / ``out_dtype`` / a 2-D
weight) runs on the plain tensor, in high precision, exactly as without the wrapper.  The wrapper survives what
training does to a parameter: optimizer updates (in place on the inner tensor), ``deepcopy``, ``.to()``, views and
transposes, ``torch.compile`` (``__tensor_flatten__``), and FSDP2's sharding (``fully_shard``: the subclass stays on
each rank's shard, and ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` all-gather the inner tensor and re-wrap
the unsharded weight).  ``state_dict()`` of a module processed by :func:`quantize_weights_` holds plain tensors, so
checkpoints load into an unconverted model and back.

The field's prior art is torchao's training weight wrapper (``MXFP8TrainingWeightWrapperTensor``) and its float8
FSDP2 weight subclass; the numerics are this package's (:mod:`cute_mxfp8.formats`; OCP MX v1.0 blocks of 32, E8M0
scales).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map_only

from ..config import MXFP8Config
from ..ops.autograd import mxfp8_grouped_mm, mxfp8_linear
from ..ops.shapes import mxfp8_dims_reason
from . import fsdp
from .convert import NOT_EXPERTS, check_model_and_filter, converted_config, logger
from .modules import WEIGHT_DTYPES, layer_config, same_numerics
from .redirect import match_call

__all__ = ["MXFP8TrainingWeight", "quantize_weights_"]

aten = torch.ops.aten

# ops whose results stay wrapped (views, copies, the tensor factories FSDP2 and deepcopy use); every other op on a
# wrapper returns plain tensors
_KEEP_WRAPPED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.clone.default, aten._to_copy.default,
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten._pin_memory.default, aten.contiguous.default,
}
# host views of the values (numpy arrays, Python lists), taken of the inner tensor
_HOST_VIEWS = {Tensor.numpy, Tensor.tolist, Tensor.__array__}
# in-place ops: applied to the inner tensor, the wrapper itself returned
_INPLACE_RETURN_SELF = {aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten.uniform_.default,
                        aten.normal_.default}


class _Unwrap(torch.autograd.Function):
    """The wrapper's inner tensor as an autograd node: gradients flow back to the wrapper parameter."""

    @staticmethod
    def forward(ctx, w):
        return w._inner.detach()

    @staticmethod
    def backward(ctx, g):
        return g


def _written(func, args, kwargs):
    """The tensors ``func`` writes (its schema's ``Tensor(a!)`` arguments, lists included)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            yield from tree_leaves(args[i] if i < len(args) else kwargs.get(arg.name))


class MXFP8TrainingWeight(Tensor):
    """A bf16/fp32 weight whose ``F.linear`` and 2d-3d ``torch._grouped_mm`` run in MXFP8 (module docstring).

    Args:
        inner: the weight, a plain bf16/fp32 tensor: (N, K) for ``F.linear``, (E, N, K) for grouped experts
            (``torch._grouped_mm`` receives its (E, K, N) transpose).  Shared, not copied.
        config: :class:`~cute_mxfp8.MXFP8Config` (None: defaults).
        requires_grad: the wrapper's ``requires_grad`` (None: ``inner``'s).  The wrapper holds ``inner`` detached;
            gradients flow to the wrapper (the parameter), as for any leaf.
    Raises:
        TypeError: ``inner`` is not a bf16/fp32 tensor (or is already wrapped), or ``config`` is not an MXFP8Config.
        ValueError: ``config.backend`` names no registered backend.
    The shape is not checked here (FSDP2 and torch.compile re-wrap shards and fakes of any shape): an ``F.linear``
    / ``torch._grouped_mm`` call on a wrapped weight that is not (N, K) / (E, N, K) with N and K multiples of 32
    raises the MXFP8 functions' ValueError naming the dim; :func:`quantize_weights_` wraps only weights that pass.
    The wrapper reports ``inner``'s shape, strides, dtype and device; ``.inner`` returns the plain tensor.
    """

    _inner: Tensor
    config: MXFP8Config

    @staticmethod
    def __new__(cls, inner: Tensor, config: MXFP8Config | None = None, requires_grad: bool | None = None):
        if not isinstance(inner, Tensor) or isinstance(inner, MXFP8TrainingWeight):
            raise TypeError(f"MXFP8TrainingWeight wraps a plain tensor, got {type(inner).__name__}")
        if inner.dtype not in WEIGHT_DTYPES:
            raise TypeError(f"MXFP8TrainingWeight wraps a bfloat16 or float32 weight, got {inner.dtype}")
        rg = inner.requires_grad if requires_grad is None else requires_grad
        out = Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                            storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                            device=inner.device, layout=inner.layout, requires_grad=rg)
        out._inner = inner.detach() if inner.requires_grad else inner
        out.config = layer_config(config, cls.__name__)
        return out

    def __init__(self, inner, config=None, requires_grad=None):
        pass

    @property
    def inner(self) -> Tensor:
        return self._inner

    @property
    def data(self) -> Tensor:
        return Tensor.data.__get__(self, type(self))  # a detached wrapper, as for any tensor

    @data.setter
    def data(self, value: Tensor) -> None:
        """``w.data = t`` (what ``Module._apply`` does when a conversion returns a plain tensor): ``t`` (a plain
        bf16/fp32 tensor, or a wrapper's) becomes the inner tensor; any other dtype raises TypeError, so
        ``model.half()`` on a model with wrapped weights fails rather than leaving a wrapper that says float16
        around a bf16 tensor."""
        inner = value._inner if isinstance(value, MXFP8TrainingWeight) else value  # (this wrapper's config stays)
        if not isinstance(inner, Tensor):
            raise TypeError(f"MXFP8TrainingWeight: .data must be set to a tensor, got {type(inner).__name__}")
        if inner.dtype not in WEIGHT_DTYPES:
            got = inner.dtype
            raise TypeError(f"MXFP8TrainingWeight: the weight's data must stay bfloat16 or float32, got {got} (e.g. "
                            "model.half() on a model with MXFP8 weights, which then stops here with the modules "
                            "before this weight already converted): use model.to(torch.bfloat16) instead, or "
                            "quantize_weights_ a model that holds plain weights")
        Tensor.data.__set__(self, MXFP8TrainingWeight(inner, self.config, requires_grad=False))  # shape, dtype, ...
        self._inner = inner.detach() if inner.requires_grad else inner

    def __repr__(self):
        return f"MXFP8TrainingWeight({self._inner!r}, config={self.config})"

    # ---- the two redirected calls -------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_VIEWS and isinstance(args[0], cls):  # numpy / lists: the plain tensor's (torch refuses
            # them for subclasses; logging / hooks use them), with torch's refusal for a tensor that requires grad
            inner = args[0]._inner.detach().requires_grad_(args[0].requires_grad and func is not Tensor.tolist)
            return func(inner, *args[1:], **kwargs)
        call = match_call(cls, func, args, kwargs)
        if call is not None:
            kind, x, w, extra = call  # w: the (N, K) / (E, N, K) weight, still a wrapper
            run = mxfp8_linear if kind == "linear" else mxfp8_grouped_mm
            return run(x, _Unwrap.apply(w), extra, w.config)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # ---- everything else: on the inner tensor -------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        config = next(a.config for a in tree_leaves((args, kwargs)) if isinstance(a, cls))  # lists included
        plain_args, plain_kwargs = tree_map_only(cls, lambda t: t._inner, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        for t in _written(func, args, kwargs):  # (below autograd, the op on the inner tensor bumps no version)
            if isinstance(t, cls):  # an in-place change of the weight reaches autograd's check of the tensors
                # saved from it (the Linear / grouped GEMM backward casts its dgrad operand from it: refused, as
                # for bf16); arguments the op only reads are left alone
                torch.autograd.graph.increment_version(t._inner)
        if func in _INPLACE_RETURN_SELF:
            return args[0]
        if func in _KEEP_WRAPPED:  # a copy to another dtype (fp16, fp64, integers) comes back plain
            return tree_map_only(Tensor, lambda t: cls(t, config, requires_grad=False)
                                 if t.dtype in WEIGHT_DTYPES else t, out)
        return out

    # ---- torch.compile ------------------------------------------------------------------------------------
    def _stable_hash_for_caching(self) -> str:
        return f"MXFP8TrainingWeight:{self.config}"

    def __tensor_flatten__(self):
        return ["_inner"], self.config

    @staticmethod
    def __tensor_unflatten__(inner_tensors, config, outer_size, outer_stride):
        return MXFP8TrainingWeight(inner_tensors["_inner"], config, requires_grad=False)

    # ---- FSDP2 (fully_shard) ------------------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh=None, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        """FSDP2 hook: all-gather this shard's inner tensor (cast to the mixed-precision param dtype, if any)."""
        inner = self._inner
        param_dtype = getattr(mp_policy, "param_dtype", None)
        if param_dtype is not None and param_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"cute_mxfp8: MixedPrecisionPolicy(param_dtype={param_dtype}) for an MXFP8 weight: the "
                             "MXFP8 layers take bfloat16 or float32 weights; use param_dtype=torch.bfloat16")
        if param_dtype is not None and inner.dtype != param_dtype:
            inner = inner.to(param_dtype)
        if self.config.fsdp_mxfp8_all_gather:  # MXFP8 data + scales travel instead (cute_mxfp8.nn.fsdp)
            return fsdp.pre_all_gather(self, inner, mesh, outer_size, module)
        return (_padded_shard(inner, mesh, outer_size),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: the unsharded weight, wrapped again (so its F.linear / _grouped_mm stay MXFP8); under the
        MXFP8 all-gather an :class:`~cute_mxfp8.nn.fsdp.MXFP8GatheredWeight`."""
        if self.config.fsdp_mxfp8_all_gather:
            return fsdp.post_all_gather(self, all_gather_outputs, metadata, param_dtype, out=out)
        (data,) = all_gather_outputs
        if out is not None:
            return
        return MXFP8TrainingWeight(data, self.config, requires_grad=False), (data,)


def _padded_shard(inner: Tensor, mesh, outer_size) -> Tensor:
    """``inner`` (this rank's dim-0 shard) zero-padded to FSDP2's padded shard size, ceil(rows / ranks) rows: an
    uneven split (3 experts on 2 ranks) leaves the last ranks short, and FSDP2 all-gathers equal inputs (it then
    views the gathered rows as the parameter's own size, so the padding is never read)."""
    if mesh is None or outer_size is None or inner.dim() == 0:
        return inner
    rows = -(-outer_size[0] // mesh.size())
    if inner.size(0) >= rows:  # an even shard (or FSDP sharding another dim: its size is then the full one)
        return inner
    return torch.cat([inner, inner.new_zeros(rows - inner.size(0), *inner.shape[1:])])


def _dims_reason(module: nn.Module, name: str, param: Tensor) -> str | None:
    """Why a Linear's weight or a 3-D expert weight (E, N, K) has no MXFP8 dims (None: it has, or it is neither)."""
    if isinstance(module, nn.Linear) and name == "weight":
        n, k = param.shape
        return mxfp8_dims_reason(**{"in_features K": k, "out_features N": n})
    if param.dim() == 3 and not isinstance(module, NOT_EXPERTS) and param.shape[0] > 1:
        # (E > 1: a (1, tokens, dim) position embedding or a cls token is no expert weight; the 2d-3d forward's K is
        # the last dim, the dgrad's the middle one)
        _, a, b = param.shape
        return mxfp8_dims_reason(**{"3-D weight (E, N, K): N": a, "3-D weight (E, N, K): K": b})
    return None


def _default_filter(module: nn.Module, name: str, param: Tensor) -> bool:
    if isinstance(module, nn.Linear) and name == "weight":
        return _dims_reason(module, name, param) is None
    if param.dim() == 3 and not isinstance(module, NOT_EXPERTS):
        return param.shape[0] > 0 and mxfp8_dims_reason(N=param.shape[1], K=param.shape[2]) is None
    return False


def _gathers_mxfp8(module: nn.Module, name: str, param: Tensor) -> bool:
    """Whether this place of a parameter uses it only through F.linear / torch._grouped_mm, as far as the module
    type tells: a Linear's weight, or a 3-D expert weight of a module that is no Linear / Embedding."""
    if isinstance(module, nn.Linear):
        return name == "weight"
    return param.dim() == 3 and not isinstance(module, NOT_EXPERTS)


def _plain_state_dict_hook(module, state_dict, prefix, local_metadata):
    for key, value in state_dict.items():
        if isinstance(value, MXFP8TrainingWeight):
            state_dict[key] = value._inner
        elif type(value).__name__ == "DTensor" and isinstance(getattr(value, "_local_tensor", None),
                                                             MXFP8TrainingWeight):
            from torch.distributed.tensor import DTensor
            state_dict[key] = DTensor.from_local(value._local_tensor._inner, value.device_mesh, value.placements,
                                                 run_check=False, shape=value.shape, stride=value.stride())
    return state_dict


def quantize_weights_(model: nn.Module, config: MXFP8Config | None = None, *, filter_fn=None) -> list[str]:
    """Wrap the model's weights as :class:`MXFP8TrainingWeight` in place; no module is replaced.

    Args:
        model: any ``nn.Module`` (before ``fully_shard`` / ``torch.compile``, after ``init`` / loading weights).
        config: :class:`~cute_mxfp8.MXFP8Config` for every wrapped weight (None: defaults).
        filter_fn: ``(module, param_name, param) -> bool`` choosing the parameters to wrap.  Default: the
            ``weight`` of every ``nn.Linear`` (subclasses included) whose dims are multiples of 32, and every 3-D
            (E, N, K) parameter of other modules (not embeddings or convolutions) with E > 0 and N, K multiples
            of 32 (grouped experts, used through ``torch._grouped_mm``); parameters lazy modules have not
            materialized are left plain (logged; a ``filter_fn`` choosing one gets a ValueError).  A wrapped
            weight used by anything but ``F.linear`` / the 2d-3d ``torch._grouped_mm`` simply runs in high
            precision.
    Returns:
        The fully qualified names of the wrapped parameters.  A ``UserWarning`` says when the model ends with no
        MXFP8 weight although the default filter found candidates it left plain (fp16 / fp64, dims not multiples
        of 32, lazy modules), naming the first and why.
    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``filter_fn`` not callable (or not taking the three
        arguments above), ``config`` not an MXFP8Config, or ``filter_fn`` chose a parameter that is not bfloat16 / float32 (the default filter
        leaves such weights plain and logs them, as ``convert_to_mxfp8`` does).
        ValueError: the model's parameters are already sharded (DTensors): wrap before ``fully_shard``;
        ``config.backend`` names no registered backend; or ``filter_fn`` chose a parameter that is not 2-D / 3-D
        with its last two dims multiples of 32 (a bias, a 40-wide Linear: the default filter leaves Linears of
        such dims plain and logs them).

    The model's ``state_dict()`` keeps plain tensors (a state-dict hook unwraps them), so checkpoints interchange
    with the unconverted model; ``load_state_dict`` copies into the wrapped weights in place (with ``assign=True``
    it replaces them by the loaded plain tensors: wrap after such a load).  Tied weights stay tied: the one
    parameter is wrapped once and set on every module that holds it.  A second call leaves wrapped weights (and
    their config) as they are.  With ``config.fsdp_mxfp8_all_gather`` (:mod:`cute_mxfp8.nn.fsdp`), a weight that
    some other module also holds (an embedding tied to the output Linear), and a weight of a module
    ``convert_to_mxfp8`` made (it casts its weights itself), keeps the high-precision all-gather (logged).
    """
    check_model_and_filter("quantize_weights_", "whose weights it wraps in place", model, filter_fn,
                           "(module, parameter name, parameter)")
    config = layer_config(config, "quantize_weights_")
    choose = filter_fn or _default_filter
    for name, param in model.named_parameters():
        if type(param).__name__ == "DTensor" or hasattr(param, "_local_tensor"):
            raise ValueError(f"quantize_weights_: parameter {name!r} is already sharded (a DTensor): call "
                             "quantize_weights_ before fully_shard / parallelize (FSDP2 then shards the wrappers)")
    # every place each parameter object sits (tied weights: one parameter, several modules)
    places: dict[int, list] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((mod_name, module, name, param))
    # parameters of modules convert_to_mxfp8 made: they already run in MXFP8 with that module's config
    converted = {id(p): (n or "the model", cfg) for n, m in model.named_modules()
                 if (cfg := converted_config(m)) is not None for p in m.parameters()}
    todo = []  # decided (and every choice checked) before any parameter changes
    left = []  # (fqn, reason) of the weights the default filter would take but leaves in high precision
    had_wrapped = False  # (an earlier call's MXFP8 weights: then a call that wraps nothing is no surprise)
    for entries in places.values():
        param = entries[0][3]
        if isinstance(param, MXFP8TrainingWeight):
            had_wrapped = True
            continue
        fqn = ", ".join(f"{m}.{n}" if m else n for m, _, n, _ in entries)
        if isinstance(param, nn.parameter.UninitializedParameter):  # a lazy module's: no shape yet
            if filter_fn is not None and any(choose(m, n, p) for _, m, n, p in entries):
                raise ValueError(f"quantize_weights_: filter_fn chose {fqn}, which its lazy module has not "
                                 "materialized yet: run one forward first, then wrap; nothing was wrapped")
            logger.info("cute_mxfp8: left %s in high precision: not materialized yet (a lazy module; wrap after "
                        "one forward)", fqn)
            left.append((fqn, "not materialized yet (a lazy module; wrap after one forward)"))
            continue
        if not any(choose(m, n, p) for _, m, n, p in entries):
            why = None if filter_fn is not None else next(
                (r for _, m, n, p in entries if (r := _dims_reason(m, n, p)) is not None), None)
            if why is not None:  # as convert_to_mxfp8 reports such layers
                logger.info("cute_mxfp8: left %s in high precision: %s", fqn, why)
                left.append((fqn, why))
            continue
        if id(param) in converted and not same_numerics(converted[id(param)][1], config):
            owner, owner_cfg = converted[id(param)]  # (the same numerics: wrapped, e.g. for the MXFP8 all-gather)
            logger.info("cute_mxfp8: left %s as it is: %s (made by convert_to_mxfp8) runs it in MXFP8 with its "
                        "own config, %s", fqn, owner, owner_cfg)
            continue
        if param.dtype not in WEIGHT_DTYPES:
            if filter_fn is None:  # as convert_to_mxfp8 does with such layers: left as they are, and logged
                logger.info("cute_mxfp8: left %s in high precision: a %s weight (MXFP8 weights are bfloat16 or "
                            "float32)", fqn, param.dtype)
                left.append((fqn, f"a {param.dtype} weight (MXFP8 weights are bfloat16 or float32)"))
                continue
            raise TypeError(f"quantize_weights_: filter_fn chose {fqn}, a {param.dtype} parameter; MXFP8 weights "
                            "are bfloat16 or float32: convert the model first (model.to(torch.bfloat16)); "
                            "nothing was wrapped")
        if filter_fn is not None and (param.dim() not in (2, 3)
                                      or mxfp8_dims_reason(N=param.shape[-2], K=param.shape[-1]) is not None):
            raise ValueError(f"quantize_weights_: filter_fn chose {fqn} of shape {tuple(param.shape)}; MXFP8 "
                             "weights are 2-D (N, K) or 3-D (E, N, K) with N and K multiples of 32: leave it out of "
                             "filter_fn (it stays in high precision); nothing was wrapped")
        cfg = config
        if cfg.fsdp_mxfp8_all_gather and id(param) in converted:
            # a module convert_to_mxfp8 made casts its weights itself: an MXFP8-gathered weight has no
            # high-precision values for it to cast
            cfg = dataclasses.replace(cfg, fsdp_mxfp8_all_gather=False)
            logger.info("cute_mxfp8: %s all-gathers in high precision: %s (made by convert_to_mxfp8) casts it "
                        "itself; fsdp_mxfp8_all_gather applies to weights used through F.linear / "
                        "torch._grouped_mm", fqn, converted[id(param)][0])
        elif cfg.fsdp_mxfp8_all_gather and not all(_gathers_mxfp8(m, n, p) for _, m, n, p in entries):
            cfg = dataclasses.replace(cfg, fsdp_mxfp8_all_gather=False)  # e.g. tied to an embedding
        todo.append((entries, cfg))
    wrapped = []
    for entries, cfg in todo:
        param = entries[0][3]
        new = nn.Parameter(MXFP8TrainingWeight(param.data, cfg), requires_grad=param.requires_grad)
        for attr in ("_param_init",):  # framework per-parameter hooks travel with the tensor object
            if hasattr(param, attr):
                setattr(new, attr, getattr(param, attr))
        for mod_name, module, name, _ in entries:  # a tie stays a tie (an embedding's use runs plain)
            setattr(module, name, new)
            wrapped.append(f"{mod_name}.{name}" if mod_name else name)
    for module in model.modules():
        if not getattr(module, "_mxfp8_plain_state_dict", False):
            module._register_state_dict_hook(_plain_state_dict_hook)
            module._mxfp8_plain_state_dict = True
    if not wrapped and left and not had_wrapped:
        # (logged one by one above; a call that leaves the model with no MXFP8 weight should not pass unseen)
        fqn, why = left[0]
        warnings.warn(f"quantize_weights_ wrapped no weight: {len(left)} left in high precision, e.g. {fqn}: {why} "
                      "(each is logged at INFO level on the 'cute_mxfp8' logger)", stacklevel=2)
    return wrapped
