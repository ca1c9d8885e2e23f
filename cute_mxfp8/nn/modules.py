"""Drop-in MXFP8 modules with the stock parameter names, so state dicts interchange with the bf16 modules.

* :class:`MXFP8Linear` — an ``nn.Linear`` subclass (``weight`` (N, K), ``bias`` (N,)).
* :class:`MXFP8SwiGLUMLP` — torchtitan ``FeedForward`` naming: children ``w1`` (gate, D->I), ``w2`` (down, I->D),
  ``w3`` (up, D->I), all bias-free ``nn.Linear``; ``forward(x) = w2(silu(w1(x)) * w3(x))``.  ``names`` keeps
  another model's child names (Hugging Face ``gate_proj`` / ``down_proj`` / ``up_proj``).
* :class:`MXFP8GroupedExperts` — torchtitan ``GroupedExperts`` naming: parameters ``w1`` (E, I, D), ``w2``
  (E, D, I), ``w3`` (E, I, D) (``names``: torchtitan 0.3's ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD``);
  ``forward(x, num_tokens_per_expert)`` with ``x`` (T, D) sorted by expert.

All MXFP8 dims (in/out features, D, I) must be multiples of the MX block size 32; constructors raise ValueError
otherwise (``convert_to_mxfp8`` skips such layers and reports why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import numbers
import operator

import torch
from torch import Tensor, nn

from ..config import MXFP8Config, resolve_config
from ..ops.autograd import mxfp8_linear, mxfp8_swiglu_mlp, swiglu_mlp_from_counts
from ..ops.backends import registered_backends
from ..ops.group_meta import known_host_copy, mark_safe
from ..ops.shapes import mlp_hidden_reason, mxfp8_dims_reason

_INT32_MAX = 2**31 - 1

__all__ = ["MXFP8Linear", "MXFP8SwiGLUMLP", "MXFP8GroupedExperts", "device_offsets_from_counts", "mxfp8_dims_reason",
           "offsets_from_counts"]


def layer_config(config, who: str) -> MXFP8Config:
    """``config`` (None: the default :class:`MXFP8Config`) for the layers ``who`` builds or wraps, with its
    ``backend`` checked against the registered backends now rather than at the first forward.  TypeError for a
    non-config, ValueError naming the registered backends for an unknown name (a custom backend must be
    registered with :func:`cute_mxfp8.ops.register_backend` before the layers that request it are made)."""
    config = resolve_config(config)
    if config.backend is not None and config.backend not in registered_backends():
        raise ValueError(f"{who}: MXFP8Config(backend={config.backend!r}) names no registered backend; use one of "
                         f"{registered_backends()} or None (chosen per device)")
    return config


WEIGHT_DTYPES = (torch.bfloat16, torch.float32)  # the MXFP8 layers' weight (and activation) dtypes


def same_numerics(a: MXFP8Config, b: MXFP8Config) -> bool:
    """Whether two configs compute the same layers: equal but for ``fsdp_mxfp8_all_gather``, which changes how FSDP
    gathers a wrapped weight, not the math (``quantize_weights_`` turns it off for a weight tied to an embedding)."""
    return dataclasses.replace(a, fsdp_mxfp8_all_gather=False) == dataclasses.replace(b, fsdp_mxfp8_all_gather=False)


def _dtypes_reason(dtypes, what: str = "weights") -> str | None:
    bad = sorted({str(d) for d in dtypes if d not in WEIGHT_DTYPES})
    return f"{what} in {', '.join(bad)}: MXFP8 layers take bfloat16 or float32 weights" if bad else None


def weight_dtype_reason(weights, what: str = "weights") -> str | None:
    """Why ``weights`` (tensors) cannot be an MXFP8 layer's (None: all bfloat16 / float32); ``what`` names them."""
    return _dtypes_reason((w.dtype for w in weights), what)


def _require_dtypes(cls_name: str, dtypes) -> None:
    why = _dtypes_reason(dtypes)
    if why is not None:
        raise ValueError(f"{cls_name}: {why} (make the layer in bfloat16 or float32, or keep it in high precision)")


def _require_weight_dtype(cls_name: str, *weights: Tensor) -> None:
    _require_dtypes(cls_name, [w.dtype for w in weights])


def _require_layer_dtype(cls_name: str, dtype) -> None:
    """A new layer's ``dtype`` argument (None: torch's default dtype) checked before any tensor is made (torch's
    own errors for integer or fp8 parameters would come first)."""
    _require_dtypes(cls_name, [torch.get_default_dtype() if dtype is None else dtype])


def linear_reason(m: nn.Linear) -> str | None:
    """Why the ``nn.Linear`` ``m`` cannot become an :class:`MXFP8Linear` sharing its parameters (None: it can): a
    subclass with its own forward, parameters besides weight and bias (adapters), which the swap would drop, a
    lazy Linear not materialized yet (no shape to convert), or hooks (:func:`hooks_reason`)."""
    return linear_structure_reason(m) or hooks_reason(m)


def _overridden_call(m: nn.Module) -> str | None:
    """``"nn.Linear.forward"`` or ``"nn.Module.__call__"`` where ``type(m)`` overrides it (the MXFP8 layers would not
    run the override), else None."""
    if type(m).forward is not nn.Linear.forward:
        return "nn.Linear.forward"
    if type(m).__call__ is not nn.Module.__call__:
        return "nn.Module.__call__"
    return None


def linear_structure_reason(m: nn.Linear) -> str | None:
    """:func:`linear_reason` without the hooks: whether ``m`` computes and holds what ``nn.Linear`` does."""
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in m.parameters(recurse=False)):
        return (f"{type(m).__name__} has not materialized its parameters yet (a lazy module): run one forward "
                "first, then convert it")
    what = _overridden_call(m)
    if what is not None:
        return (f"{type(m).__name__} overrides {what}; only Linears computing nn.Linear's forward are converted")
    extra = [n for n, _ in m.named_parameters() if n not in ("weight", "bias")]
    if extra:
        return (f"{type(m).__name__} holds parameters besides weight and bias ({', '.join(extra)}: e.g. adapters), "
                "which an MXFP8Linear would drop")
    return None


def swiglu_weights_reason(w1: Tensor, w2: Tensor, w3: Tensor) -> str | None:
    """Why (w1, w2, w3) cannot be the weights of one MXFP8 SwiGLU MLP / grouped experts (None: they can): shapes
    (..., I, D) / (..., D, I) / (..., I, D), bfloat16 / float32 weights, w1 and w3 in one dtype (W13 is cast as one
    tensor)."""
    *e, i, d = w1.shape
    if tuple(w3.shape) != tuple(w1.shape) or tuple(w2.shape) != (*e, d, i):
        return (f"w1 / w2 / w3 (gate / down / up) must be (..., I, D) / (..., D, I) / (..., I, D), got "
                f"{tuple(w1.shape)} / {tuple(w2.shape)} / {tuple(w3.shape)}")
    why = weight_dtype_reason((w1, w2, w3))
    if why is not None:
        return why
    if w1.dtype != w3.dtype:
        return f"w1 (gate) is {w1.dtype} and w3 (up) {w3.dtype}: they are cast as one tensor, so must share a dtype"
    return None


def _require_only(cls_name: str, module: nn.Module, names, what: str) -> None:
    """ValueError where ``module`` holds parameters besides those under ``names`` (``from_module`` would drop
    them: a wrong output, silently)."""
    extra = [n for n, _ in module.named_parameters() if n.split(".")[0] not in names]
    if extra:
        raise ValueError(f"{cls_name}.from_module: {type(module).__name__} has parameters besides {what}: {extra}; "
                         f"its forward is not the MXFP8 layer's (convert_to_mxfp8 converts only what matches; keep "
                         f"the rest in high precision)")
    # (its own buffers move to the new module; those of children it does not keep would vanish from the state dict)
    dropped = [n for n, _ in module.named_buffers() if "." in n and n.split(".")[0] not in names]
    if dropped:
        raise ValueError(f"{cls_name}.from_module: {type(module).__name__} has buffers in children other than "
                         f"{what}: {dropped}; the MXFP8 module would drop them (keep it in high precision)")


_OWN_ATTRIBUTES = ("config", "names", "num_experts", "validate_counts")  # what the modules' __init__ sets

_HOOK_KINDS = (("_forward_pre_hooks", "forward pre-hooks"), ("_forward_hooks", "forward hooks"),
               ("_backward_pre_hooks", "backward pre-hooks"), ("_backward_hooks", "backward hooks"),
               ("_state_dict_pre_hooks", "state-dict pre-hooks"), ("_state_dict_hooks", "state-dict hooks"),
               ("_load_state_dict_pre_hooks", "load-state-dict pre-hooks"),
               ("_load_state_dict_post_hooks", "load-state-dict post-hooks"))
# nn.Module methods a subclass overrides to keep state of its own in the state dict (an MXFP8 module would not)
_STATE_METHODS = ("get_extra_state", "set_extra_state", "_save_to_state_dict", "_load_from_state_dict")


def _own_hook(hook) -> bool:
    """This package's hooks (``quantize_weights_``'s state-dict hook, which :func:`carry_state` registers again)."""
    return getattr(hook, "__module__", None) == "cute_mxfp8.nn.weight"


@functools.cache
def _mxfp8_attribute_names() -> frozenset:
    """Every attribute name the MXFP8 modules define (a buffer carried over under one of them would collide)."""
    return frozenset(_OWN_ATTRIBUTES).union(*(dir(c) for c in (MXFP8Linear, MXFP8SwiGLUMLP, MXFP8GroupedExperts)))


def hooks_reason(module: nn.Module, kept=()) -> str | None:
    """Why ``module`` cannot be swapped for an MXFP8 module without losing behaviour (None: it can): it or a
    submodule has hooks (forward, backward, state-dict or load-state-dict: the swap would drop the module's own,
    and the fused MXFP8 MLP never calls its child Linears, so theirs would not fire), a ``forward`` replaced on
    the instance (e.g. by accelerate's device hooks), a class that keeps state of its own in the state dict
    (``get_extra_state`` and the like overridden), or a buffer named like an MXFP8 module's own attribute.
    ``kept``: the names of children the MXFP8 module takes over as they are (an FFN's Linears): their state-dict
    hooks and state methods stay with them, so only their call hooks and instance forwards count.
    Global hooks (``register_module_forward_hook``) are not looked at."""
    taken = _mxfp8_attribute_names()
    for name, sub in module.named_modules():
        where = f"its submodule {name!r}" if name else type(module).__name__
        kept_child = bool(name) and name.split(".")[0] in kept
        kinds = [label for attr, label in _HOOK_KINDS if (not kept_child or attr in _CALL_HOOKS)
                 and any(not _own_hook(h) for h in getattr(sub, attr, {}).values())]
        if kinds and kept_child:  # (the fused MLP never calls its Linears: registering them after converting is no fix)
            return (f"{where} has {' and '.join(kinds)}, which the fused MXFP8 module would not run (it never "
                    f"calls its Linears): remove them, or keep the Linears separate")
        if kinds and name:
            return (f"{where} has {' and '.join(kinds)}, which would be lost with it (the MXFP8 module keeps only "
                    f"the weights it computes with): remove them, or keep the module in high precision")
        if kinds:
            return (f"{where} has {' and '.join(kinds)}, which the MXFP8 module would not run: convert before "
                    f"registering them, or remove them")
        if "forward" in vars(sub):
            return (f"{where} has its forward replaced on the instance (e.g. by accelerate hooks), which the MXFP8 "
                    f"module would drop: convert before wrapping it")
        own = [m for m in _STATE_METHODS if getattr(type(sub), m) is not getattr(nn.Module, m)]
        if own and not kept_child:
            return (f"{where} is a {type(sub).__name__} overriding {', '.join(own)} (state of its own in the state "
                    f"dict), which the MXFP8 module would drop")
        clash = [n for n in sub._buffers if n in taken] if not name else []
        if clash:
            return (f"{where} has buffers named {clash}, which the MXFP8 module uses for its own attributes: rename "
                    f"them to convert it")
    return None


def carry_state(old: nn.Module, new: nn.Module) -> None:
    """What ``old`` holds besides the parameters ``new`` took over, kept on ``new``: its own buffers (persistent or
    not, in their order, so the state dict keys stay the same) and plain attributes ``new`` lacks (e.g. a
    framework's flags such as ``_is_hf_initialized``, or a user's tag)."""
    for n, b in old._buffers.items():
        new.register_buffer(n, b, persistent=n not in old._non_persistent_buffers_set)
    for hook in old._state_dict_hooks.values():  # quantize_weights_'s (hooks_reason refused any other)
        if _own_hook(hook):
            new._register_state_dict_hook(hook)
    own = vars(new)
    for k, v in vars(old).items():
        if k not in own and k != "forward":
            own[k] = v


def _require_names(cls: type, names, kind: str) -> None:
    """``names``: a tuple or list of three distinct str (the (gate / w1, down / w2, up / w3) names), each usable
    as a submodule / parameter name of ``cls``: an identifier that is no attribute of the module already."""
    if (not isinstance(names, (tuple, list)) or len(names) != 3 or not all(isinstance(n, str) for n in names)
            or len(set(names)) != 3):
        raise ValueError(f"{cls.__name__}: names must be three distinct {kind} names (w1, w2, w3 roles), got "
                         f"{names!r}")
    for n in names:
        if not n.isidentifier():
            raise ValueError(f"{cls.__name__}: {kind} name {n!r} is not a Python identifier (no '.', not empty)")
        if hasattr(cls, n) or n in _OWN_ATTRIBUTES or n in vars(nn.Module()):
            raise ValueError(f"{cls.__name__}: {kind} name {n!r} is taken by the module's own attribute; pick "
                             f"another")


def _require_int(cls_name: str, name: str, value) -> None:
    """TypeError naming the argument when a layer size is not an int (numpy ints are; bools are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{cls_name}: {name} must be an int, got {value!r}")


def _require_dims(cls_name: str, **dims: int) -> None:
    for name, value in dims.items():
        _require_int(cls_name, name, value)
        if value < 0:
            raise ValueError(f"{cls_name}: {name} must be >= 0, got {value}")
    reason = mxfp8_dims_reason(**dims)
    if reason is not None:
        raise ValueError(f"{cls_name}: {reason}; keep this layer in high precision")


def _require_mlp_hidden(cls_name: str, config: MXFP8Config, hidden_dim: int) -> None:
    reason = mlp_hidden_reason(config, hidden_dim)
    if reason is not None:
        raise ValueError(f"{cls_name}: {reason}")


class MXFP8Linear(nn.Linear):
    """``nn.Linear`` whose forward, dgrad and wgrad GEMMs run in MXFP8 (see :func:`cute_mxfp8.ops.mxfp8_linear`).

    Args: as ``nn.Linear``, plus ``config`` (:class:`MXFP8Config`; None: the defaults).  ``in_features`` and
    ``out_features`` must be multiples of 32.  Input (..., in_features) bf16/fp32 -> (..., out_features) same dtype.
    Raises (at construction): TypeError for a size that is not an int (``32.0``, a bool) or a ``config`` that is
    not an :class:`MXFP8Config`; ValueError for a size that is not a multiple of 32, an fp16 (or other non
    bf16 / fp32) ``dtype``, or a ``config.backend`` that names no registered backend.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 config: MXFP8Config | None = None):
        _require_dims(type(self).__name__, in_features=in_features, out_features=out_features)
        _require_layer_dtype(type(self).__name__, dtype)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = layer_config(config, type(self).__name__)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: MXFP8Config | None = None) -> "MXFP8Linear":
        """A new MXFP8Linear that shares ``linear``'s parameters (no copy, no re-initialization) and keeps its
        buffers and plain attributes (:func:`carry_state`).  TypeError for a non-Linear; ValueError for dims not
        multiples of 32, weights not bfloat16 / float32, a subclass with its own forward, parameters besides
        weight and bias, or hooks / an instance-level forward the swap would drop (:func:`linear_reason`)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear takes an nn.Linear, got {type(linear).__name__}")
        why = linear_reason(linear)
        if why is not None:
            raise ValueError(f"{cls.__name__}.from_linear: {why}; keep it in high precision")
        _require_weight_dtype(cls.__name__, linear.weight, *(() if linear.bias is None else (linear.bias,)))
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  dtype=linear.weight.dtype, config=config)  # (its dtype: the default dtype may be another)
        new.weight = linear.weight
        new.bias = linear.bias
        carry_state(linear, new)  # buffers, torchtitan's per-parameter init table, flags
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return mxfp8_linear(x, self.weight, self.bias, self.config)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config={self.config}"


_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _fusable_linear(lin) -> bool:
    """Whether the fused MLP, which reads only ``lin.weight`` and never calls ``lin``, runs what ``lin`` would: a
    bias-free ``nn.Linear`` with ``nn.Linear``'s forward, no call hooks, no forward set on the instance (a cheap
    check, run on every forward)."""
    return (isinstance(lin, nn.Linear) and lin.bias is None and _overridden_call(lin) is None
            and "forward" not in vars(lin) and not any(getattr(lin, a) for a in _CALL_HOOKS))


def _unfusable_child(cls_name: str, name: str, lin) -> Exception:
    """The error for a child :func:`_fusable_linear` refuses, naming what would be ignored and the fix."""
    if not isinstance(lin, nn.Linear):
        return TypeError(f"{cls_name}: its child {name!r} ({type(lin).__name__}) is not an nn.Linear: the fused MLP "
                         f"reads the three Linears' weights itself (wrappers such as LoRA are not run); keep the FFN "
                         f"in high precision or give it plain Linears")
    own = _overridden_call(lin)
    what = ("a bias" if lin.bias is not None else
            f"its own {own.rsplit('.', 1)[1]} ({type(lin).__name__})" if own is not None else
            "a forward set on the instance" if "forward" in vars(lin) else "forward / backward hooks")
    return ValueError(f"{cls_name}: its Linear {name!r} has {what}, which the fused MLP would ignore (it reads the "
                      f"weights and never calls the Linears): remove that, or run the FFN as three Linears "
                      f"(MXFP8Linear each; convert_to_mxfp8 does so for such FFNs)")


class MXFP8SwiGLUMLP(nn.Module):
    """SwiGLU feed-forward ``w2(silu(w1(x)) * w3(x))`` run as ONE MXFP8 autograd function
    (:func:`cute_mxfp8.ops.mxfp8_swiglu_mlp`: fused W13 GEMM, SwiGLU + dual quantization, no bf16 ``h``).

    Args:
        dim: D (model dim), hidden_dim: I; both multiples of 32 (I of 128 with ``hopper_block_k=128``, of 64 with
            ``fused_epilogues=True``; ValueError).
        device, dtype: of the three bias-free Linears' weights (bf16 or fp32), as ``nn.Linear``'s.
        config: :class:`MXFP8Config` (None: the defaults).
        names: the child names of (gate, down, up), default ``("w1", "w2", "w3")``; state dict keys follow them.
    Input (..., D) bf16/fp32 -> (..., D) same dtype.
    Raises (at construction): TypeError for a size that is not an int (``32.0``, a bool) or a ``config`` that is
    not an :class:`MXFP8Config`; ValueError for a size that is not a multiple of 32, an fp16 (or other non
    bf16 / fp32) ``dtype``, or a ``config.backend`` that names no registered backend.  ``names`` that are not three distinct
    identifiers free on the module raise ValueError.  The forward reads the three Linears' weights and never calls
    the Linears, so it raises ValueError where one was given a bias, hooks or a forward of its own after
    construction (they would be ignored), and TypeError where a child is no ``nn.Linear`` (e.g. a LoRA wrapper).
    """

    def __init__(self, dim: int, hidden_dim: int, device=None, dtype=None, config: MXFP8Config | None = None,
                 names: tuple[str, str, str] = ("w1", "w2", "w3")):
        super().__init__()
        _require_dims(type(self).__name__, dim=dim, hidden_dim=hidden_dim)
        _require_names(type(self), names, "child")
        _require_layer_dtype(type(self).__name__, dtype)
        self.names = tuple(names)
        kw = dict(bias=False, device=device, dtype=dtype)
        gate, down, up = self.names
        self.add_module(gate, nn.Linear(dim, hidden_dim, **kw))
        self.add_module(down, nn.Linear(hidden_dim, dim, **kw))
        self.add_module(up, nn.Linear(dim, hidden_dim, **kw))
        self.config = layer_config(config, type(self).__name__)
        _require_mlp_hidden(type(self).__name__, self.config, hidden_dim)

    @classmethod
    def from_module(cls, ffn: nn.Module, config: MXFP8Config | None = None,
                    names: tuple[str, str, str] = ("w1", "w2", "w3")) -> "MXFP8SwiGLUMLP":
        """Take over the (gate, down, up) Linears named ``names`` of a SwiGLU FFN (shared, not copied; the
        Linears keep their own class, e.g. a framework's ``nn.Linear`` subclass, and init hooks).  The FFN must
        compute ``down(silu(gate(x)) * up(x))`` with nothing else: TypeError where a child named in ``names`` is
        no ``nn.Linear``; ValueError for biased Linears, Linears that are not plain
        (:func:`linear_structure_reason`), weights that cannot form one MLP (:func:`swiglu_weights_reason`),
        parameters outside the three Linears, buffers in other children, or hooks (:func:`hooks_reason`; of the
        Linears only call hooks count) (each would be dropped or fail later; ``convert_to_mxfp8`` converts such
        FFNs' Linears one by one).  The FFN's own buffers and plain attributes move to the new module."""
        _require_names(cls, names, "child")
        linears = [getattr(ffn, n, None) for n in names]
        if not all(isinstance(lin, nn.Linear) for lin in linears):
            have = [n for n, c in ffn.named_children() if isinstance(c, nn.Linear)]
            hint = ""
            if {"gate_proj", "down_proj", "up_proj"} <= set(have):
                hint = '; for Hugging Face naming pass names=("gate_proj", "down_proj", "up_proj")'
            elif have:
                hint = f"; its Linear children are {have}: pass names=(gate, down, up) among them"
            raise TypeError(f"{cls.__name__}.from_module: {type(ffn).__name__} needs nn.Linear children named "
                            f"{tuple(names)}, got {[type(lin).__name__ for lin in linears]}{hint}")
        gate, down, up = linears
        if any(lin.bias is not None for lin in linears):
            raise ValueError(f"{cls.__name__}.from_module: {type(ffn).__name__}'s Linears have biases, which the "
                             "MXFP8 SwiGLU MLP does not add; convert them one by one (convert_to_mxfp8 does)")
        why = next((f"{n}: {r}" for n, r in zip(names, map(linear_structure_reason, linears)) if r is not None),
                   None) or swiglu_weights_reason(gate.weight, down.weight, up.weight)
        if why is not None:
            raise ValueError(f"{cls.__name__}.from_module: {why}")
        _require_only(cls.__name__, ffn, names, f"the Linears {tuple(names)}")
        why = hooks_reason(ffn, kept=names)  # (the Linears stay the same objects: only their call hooks matter)
        if why is not None:
            raise ValueError(f"{cls.__name__}.from_module: {why}")
        new = cls(gate.in_features, gate.out_features, device="meta", dtype=gate.weight.dtype, config=config,
                  names=names)
        new._modules.clear()  # the FFN's own child order, so the state dict lists its keys as before
        for n in ffn._modules:
            if n in names:
                new.add_module(n, getattr(ffn, n))
        carry_state(ffn, new)
        new.train(ffn.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        gate, down, up = (getattr(self, n) for n in self.names)
        for n, lin in zip(self.names, (gate, down, up)):
            if not _fusable_linear(lin):
                raise _unfusable_child(type(self).__name__, n, lin)
        return mxfp8_swiglu_mlp(x, gate.weight, down.weight, up.weight, None, self.config)

    def extra_repr(self) -> str:
        return f"config={self.config}"


class MXFP8GroupedExperts(nn.Module):
    """Mixture-of-experts SwiGLU experts in MXFP8: 2d-3d grouped GEMMs forward and dgrad, 2d-2d wgrad.

    Args:
        dim: D, hidden_dim: I (multiples of 32; I of 128 with ``hopper_block_k=128``, of 64 with
            ``fused_epilogues=True``: ValueError), num_experts: E.
        device, dtype: of the three (E, ., .) weights (bf16 or fp32); drawn from a truncated normal with std
            ``1 / sqrt(fan_in)`` unless on the meta device.
        config: :class:`MXFP8Config` (None: the defaults).
        names: the parameter names of (w1 (E, I, D), w2 (E, D, I), w3 (E, I, D)), default ``("w1", "w2", "w3")``.
        validate_counts: read CUDA counts on the host and check them (ValueError for negative counts or a sum past
            T), at the cost of one device sync per forward.  Default False: CUDA counts stay on the device (no
            sync, as ``torch._grouped_mm`` with device offsets) and are made safe there instead: a negative count
            counts as 0 and the groups end at T.  Counts given on the CPU or as ints are always checked.  Still
            read once per step with device counts: the ``wgrad_with_hp=True`` backward (its per-group fp32
            wgrads), the reference backend, and the ops of a
            ``torch.compile``-d module (inside the op: device counts still trace as one graph, ``fullgraph=True``
            included).  CPU counts and ``validate_counts=True`` are read before the ops (under
            ``torch.compile`` a graph break, so ``fullgraph=True`` needs device counts); a list of ints is a
            constant to ``torch.compile``, so every new list recompiles (pass a tensor when counts change per
            step).
    ``forward(x, num_tokens_per_expert)``: ``x`` (T, D) bf16/fp32 with tokens sorted by expert, the first
    ``num_tokens_per_expert[0]`` rows for expert 0 and so on; ``num_tokens_per_expert`` (E,) integer tensor (or E
    ints), ``sum <= T`` (rows past the sum give zeros).  Returns (T, D) in ``x.dtype``.
    Raises (at construction): TypeError for a size that is not an int, a non-bool ``validate_counts`` or a
    ``config`` that is not an :class:`MXFP8Config`; ValueError for dims that are not multiples of 32 (I of 128
    with ``hopper_block_k=128``, of 64 with ``fused_epilogues=True``), ``num_experts < 0``, a non bf16 / fp32
    ``dtype``, bad ``names`` or an unregistered ``config.backend``.  The forward raises TypeError where
    ``validate_counts`` was later set to a non-bool.
    """

    validate_counts = False  # the class default: modules pickled before the attribute existed keep working

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, device=None, dtype=None,
                 config: MXFP8Config | None = None, names: tuple[str, str, str] = ("w1", "w2", "w3"),
                 validate_counts: bool = False):
        super().__init__()
        if not isinstance(validate_counts, bool):
            raise TypeError(f"validate_counts must be a bool, got {validate_counts!r}")
        self.validate_counts = validate_counts
        _require_dims(type(self).__name__, dim=dim, hidden_dim=hidden_dim)
        _require_names(type(self), names, "parameter")
        _require_layer_dtype(type(self).__name__, dtype)
        self.names = tuple(names)
        kw = dict(device=device, dtype=dtype)
        _require_int(type(self).__name__, "num_experts", num_experts)
        if num_experts < 0:
            raise ValueError(f"{type(self).__name__}: num_experts must be >= 0, got {num_experts}")
        self.num_experts = num_experts
        shapes = ((num_experts, hidden_dim, dim), (num_experts, dim, hidden_dim), (num_experts, hidden_dim, dim))
        for n, shape in zip(self.names, shapes):
            self.register_parameter(n, nn.Parameter(torch.empty(shape, **kw)))
        self.config = layer_config(config, type(self).__name__)
        _require_mlp_hidden(type(self).__name__, self.config, hidden_dim)
        if self._weights()[0].device.type != "meta":
            self.reset_parameters()

    def _weights(self) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(getattr(self, n) for n in self.names)

    def reset_parameters(self) -> None:
        for w in self._weights():
            if w.numel():  # (a zero-width expert weight has nothing to draw, and no fan-in)
                nn.init.trunc_normal_(w, std=1.0 / math.sqrt(w.shape[-1]))

    @classmethod
    def from_module(cls, experts: nn.Module, config: MXFP8Config | None = None,
                    names: tuple[str, str, str] = ("w1", "w2", "w3"),
                    validate_counts: bool = False) -> "MXFP8GroupedExperts":
        """Take over the (w1, w2, w3) parameters named ``names`` of a grouped-experts module (shared, not
        copied; its buffers and plain attributes move too).  ValueError where they are not 3-D parameters that can
        form the experts (:func:`swiglu_weights_reason`), the module holds other parameters or children with
        buffers (they would be dropped silently), or it has hooks (:func:`hooks_reason`)."""
        _require_names(cls, names, "parameter")
        weights = [experts._parameters.get(n) for n in names]  # parameters only: those are what it takes over
        if not all(isinstance(w, Tensor) and w.dim() == 3 for w in weights):
            raise ValueError(f"{cls.__name__}.from_module: {type(experts).__name__} needs 3-D parameters named "
                             f"{tuple(names)}, got {[getattr(w, 'shape', type(w).__name__) for w in weights]}")
        why = swiglu_weights_reason(*weights)
        if why is not None:
            raise ValueError(f"{cls.__name__}.from_module: {why}")
        e, i, d = weights[0].shape
        _require_only(cls.__name__, experts, names, f"the expert weights {tuple(names)}")
        why = hooks_reason(experts)
        if why is not None:
            raise ValueError(f"{cls.__name__}.from_module: {why}")
        new = cls(d, i, e, device="meta", dtype=weights[0].dtype, config=config, names=names,
                  validate_counts=validate_counts)
        new._parameters.clear()  # the module's own parameter order (state dict key order)
        for n in experts._parameters:
            if n in names:
                new.register_parameter(n, getattr(experts, n))
        carry_state(experts, new)  # buffers, torchtitan's per-parameter init table, flags
        new.train(experts.training)
        return new

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor (tokens, dim), got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"x must be (tokens, dim) with tokens sorted by expert, got shape {tuple(x.shape)}")
        if type(self.validate_counts) is not bool:  # (set after construction: "no" must not mean True)
            raise TypeError(f"validate_counts must be a bool, got {self.validate_counts!r}: set "
                            f"module.validate_counts = True or False")
        counts = num_tokens_per_expert
        if not self.validate_counts and _counts_on_device(counts, x):
            # no host read: the step never waits for the GPU here, and torch.compile traces it as one graph
            # (fullgraph=True works; new count values do not recompile)
            offs = device_offsets_from_counts(counts, self.num_experts, x.shape[0])
            return mxfp8_swiglu_mlp(x, *self._weights(), offs, self.config)
        if torch.compiler.is_compiling():  # the counts read breaks the graph here, and the MLP stays one graph
            offs = offsets_from_counts(num_tokens_per_expert, self.num_experts, x.shape[0], x.device)
            return mxfp8_swiglu_mlp(x, *self._weights(), offs, self.config)
        # eager: the counts' copy to the host starts now and is waited for once the weights' casts are queued
        counts = _prefetch_counts(num_tokens_per_expert, self.num_experts)
        offs = lambda: offsets_from_counts(counts(), self.num_experts, x.shape[0], x.device)  # noqa: E731
        return swiglu_mlp_from_counts(x, *self._weights(), offs, self.config)

    def extra_repr(self) -> str:
        e, i, d = self._weights()[0].shape
        names = "" if self.names == ("w1", "w2", "w3") else f", names={self.names}"
        return (f"num_experts={e}, dim={d}, hidden_dim={i}, dtype={self._weights()[0].dtype}{names}, "
                f"validate_counts={self.validate_counts}, config={self.config}")


def _counts_on_device(counts, x: Tensor) -> bool:
    """Whether ``MXFP8GroupedExperts`` takes ``counts`` as device counts (made safe on the device, never read on
    the host): a plain CUDA tensor on ``x``'s device."""
    return type(counts) is Tensor and counts.is_cuda and x.is_cuda and counts.device == x.device


_PREFETCH_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _prefetch_counts(counts, num_experts: int):
    """A callable returning ``counts`` for :func:`offsets_from_counts`.  For an (E,) integer CUDA tensor it starts
    the device-to-host copy now, non-blocking into pinned memory on the current stream, and the callable waits
    for that copy alone (its event): the host then waits for the work queued on that stream before this call
    (which produced the counts: the router), not for the work queued after it (the weights' casts).  Anything
    else is returned as it is, to be read and checked by :func:`offsets_from_counts` (same errors either way: the
    host copy has the tensor's shape and dtype)."""
    if (not isinstance(counts, Tensor) or type(counts) is not Tensor or not counts.is_cuda
            or counts.shape != (num_experts,) or counts.dtype not in _PREFETCH_DTYPES):
        return lambda: counts
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(counts.device))  # the stream the copy ran on

    def wait():
        done.synchronize()
        return host

    return wait


def device_offsets_from_counts(num_tokens_per_expert: Tensor, num_experts: int, num_tokens: int) -> Tensor:
    """int32 cumulative end offsets (E,) on the counts' device, computed there without reading the counts on the
    host (no device sync) and made safe instead of checked: every count is clamped into ``[0, num_tokens]`` (uint64
    counts past int64 wrap negative first) and the offsets are capped at ``num_tokens``, so they are
    non-decreasing within ``[0, num_tokens]`` and the grouped ops take them without a host read
    (:func:`cute_mxfp8.ops.group_meta.mark_safe`).  Valid counts give :func:`offsets_from_counts`'s values.

    Raises ValueError for counts that are not an (E,) tensor of an integer dtype (shape and dtype are known on the
    host), a ``num_tokens`` or ``num_experts`` that is not an int >= 0, or ``num_tokens`` past 2**31 - 1."""
    name = "num_tokens_per_expert"
    counts = num_tokens_per_expert
    num_tokens, num_experts = _size_arg("num_tokens", num_tokens), _size_arg("num_experts", num_experts)
    if not isinstance(counts, Tensor):
        raise ValueError(f"{name} must be an integer tensor of shape ({num_experts},), got {type(counts).__name__}: "
                         f"pass a list of ints to MXFP8GroupedExperts (checked on the host) or a tensor here")
    if (counts.shape != (num_experts,) or counts.dtype == torch.bool or counts.is_floating_point()
            or counts.is_complex()):
        raise ValueError(f"{name} must be an integer tensor of shape ({num_experts},), got {counts.dtype} of "
                         f"shape {tuple(counts.shape)}")
    if num_tokens > _INT32_MAX:
        raise ValueError(f"x has {num_tokens} tokens, past the int32 token offsets ({_INT32_MAX}): split the batch")
    with _normal_tensors():
        # each count clamped into [0, T] first: the int64 running sum then cannot wrap
        offs = counts.to(torch.int64).clamp(0, num_tokens).cumsum(0).clamp_(max=num_tokens).to(torch.int32)
    mark_safe(offs, num_tokens)
    return offs


def _size_arg(name: str, v):
    """``v`` as an int >= 0 (Python and numpy ints, 0-d integer tensors; a symbolic size under tracing as it is),
    else ValueError naming ``name``."""
    got = v
    if not isinstance(v, (int, torch.SymInt)) or isinstance(v, bool):  # (type checks first: no index() on a
        try:  # dynamo-traced size, which would specialize it)
            v = operator.index(v) if not isinstance(v, bool) else None
        except TypeError:
            v = None
    if v is None or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {got!r}")
    return v


def _normal_tensors():
    """A context in which new tensors are normal ones even under ``torch.inference_mode`` (inference tensors have no
    version counter, so the offsets' cache (:mod:`cute_mxfp8.ops.group_meta`) would skip them and every grouped
    op would read them back); nothing under torch.compile, where the context would break the graph."""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    return torch.inference_mode(False)


def offsets_from_counts(num_tokens_per_expert, num_experts: int, num_tokens: int, device) -> Tensor:
    """int32 cumulative end offsets (E,) on ``device`` from per-expert token counts, checked before narrowing.

    ``num_tokens_per_expert``: an integer tensor of any integer dtype (uint64 included) or a sequence of Python
    ints, E values.  The counts are read on the host (one device sync for a device tensor; the result carries its
    host copy, so the grouped ops do not read the offsets again) and checked as exact Python integers: every count
    >= 0, their sum <= ``num_tokens`` and <= 2**31 - 1, so no offset wraps when it is stored as int32.  Raises ValueError naming
    ``num_tokens_per_expert`` otherwise.
    """
    name = "num_tokens_per_expert"
    if isinstance(num_tokens_per_expert, Tensor):
        counts = num_tokens_per_expert
        if (counts.shape != (num_experts,) or counts.dtype == torch.bool or counts.is_floating_point()
                or counts.is_complex()):
            raise ValueError(f"{name} must be an integer tensor of shape ({num_experts},), got {counts.dtype} of "
                             f"shape {tuple(counts.shape)}")
        if counts.is_meta:
            raise ValueError(f"{name} is on the meta device and has no values to read: pass the real counts")
        host = counts.cpu().tolist()  # exact Python ints in the tensor's own dtype (uint64 too)
    else:
        try:
            items = list(num_tokens_per_expert)
            host = [operator.index(c) for c in items]
        except TypeError:
            raise ValueError(f"{name} must be an integer tensor or a sequence of ints of length {num_experts}, got "
                             f"{num_tokens_per_expert!r}") from None
        if len(host) != num_experts or any(isinstance(c, bool) for c in items):
            raise ValueError(f"{name} must hold {num_experts} integer counts (one per expert; not bools), got "
                             f"{items!r}")
    if any(c < 0 for c in host):
        raise ValueError(f"{name} must be >= 0, got {host}")
    ends = list(itertools.accumulate(host))
    total = ends[-1] if ends else 0
    if total > num_tokens:
        raise ValueError(f"{name} sums to {total} but x has {num_tokens} tokens (rows); the counts must cover at "
                         f"most x.shape[0] rows, got {host}")
    if total > _INT32_MAX:
        raise ValueError(f"{name} sums to {total}, past the int32 token offsets ({_INT32_MAX}): split the batch")
    with _normal_tensors():
        host_offs = torch.tensor(ends, dtype=torch.int32)
        if torch.device(device).type == "cuda":  # pinned: the upload does not wait for the stream to drain
            offs = host_offs.pin_memory().to(device, non_blocking=True)
        else:
            offs = host_offs.to(device)
    if offs is not host_offs:  # the grouped ops validate offs on the host copy: no second device read
        known_host_copy(offs, host_offs)
    return offs
