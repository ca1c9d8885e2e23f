"""``convert_to_mxfp8``: swap a model's Linears, SwiGLU FFNs and grouped experts for MXFP8 modules in place.

What is recognized (parameters are shared, never copied, so the state dict keys, their order and values do not
change):

* ``nn.Linear`` and subclasses that keep ``nn.Linear.forward`` (torchtitan's ``Linear``) -> :class:`MXFP8Linear`
  (a torchtitan ``_param_init`` table is kept; torchtitan models on the meta device: see below).  Subclasses
  with their own forward are reported and kept.
* A SwiGLU FFN: bias-free Linears named ``w1``/``w2``/``w3`` (torchtitan) or ``gate_proj``/``down_proj``/``up_proj``
  (Hugging Face), no parameters of its own, any other children parameter-free (an activation module), whose forward
  computes ``down(silu(gate(x)) * up(x))`` -> :class:`MXFP8SwiGLUMLP` with the same child names.
* Grouped experts: a module with no children whose only parameters are ``w1`` (E, I, D), ``w2`` (E, D, I), ``w3``
  (E, I, D) (or torchtitan 0.3's ``w1_EFD``/``w2_EDF``/``w3_EFD``) and whose ``forward(x, num_tokens_per_expert)``
  computes the per-expert SwiGLU -> :class:`MXFP8GroupedExperts` with the same names.
* Hugging Face experts modules (``gate_up_proj`` (E, 2I, D) / ``down_proj`` (E, D, I), dispatched through
  transformers' experts implementations): the module stays and its forward becomes
  :func:`cute_mxfp8.integrations.transformers.mxfp8_experts_forward`.

The forward of a candidate FFN / experts module is checked before it is swapped: it runs in train mode with grad
mode on, in train mode under ``no_grad`` and in eval mode, on random probe weights (substituted with
``torch.func.functional_call``; the module's own tensors are not read, so meta-device models are checked too) and
inputs at three magnitudes, and must give the same output every time (no dropout, no train / eval or grad-mode
branch) and equal the SwiGLU math (experts: within bf16 rounding per row, as torchtitan computes them in bf16).
So a module that merely looks like one (other activation, scaling, clamping, dropout) is not swapped.  Nor is one
whose forward takes named arguments past ``x`` (experts: past ``x, num_tokens_per_expert``), which callers could
pass and the MXFP8 module would refuse.  Layers whose
dims are not multiples of 32 (e.g. a router with 16 outputs) or whose weights are not bf16/fp32 are left as they
are.  Every candidate left alone is logged and reported with the reason, including look-alikes and modules with
3-D (experts-like) parameters in a layout the converter does not know.

A replaced module's own buffers and plain attributes move to its replacement (the state dict keeps its keys).  A
candidate stays as it is, reported, where the swap would drop behaviour or state (``modules.hooks_reason``): hooks
(forward, backward, state-dict, load-state-dict) on itself or on a child the MXFP8 module drops, forward / backward
hooks on an FFN's Linears, which the fused MLP never calls (their state-dict hooks stay with them: the fused MLP
keeps the Linear objects), a forward replaced on the instance, a class keeping extra state, a buffer named like
the MXFP8 module's own attribute; checked before any probe runs it (global module hooks are not looked at).  So
does a torchtitan Linear or grouped-experts module while the model has parameters on the meta device:
torchtitan's ``init_states`` would not reach the MXFP8 module, so its weights would stay uninitialized.  Convert torchtitan models after ``init_states``
(a model built on a real device too: torchtitan's experts start from ``torch.empty`` there, which nothing detects),
or wrap the weights with ``quantize_weights_``, or, for the FFNs and experts, use
:mod:`cute_mxfp8.integrations.torchtitan`.  So does a module wrapped
by ``torch.compile`` (the wrapper's forward is bound to it).  A module held in several slots is converted once and
the replacement put in every slot that ``filter_fn`` accepts (an excluded slot keeps the high-precision module,
sharing the parameters).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MXFP8Config
from ..ops.shapes import mlp_hidden_reason
from .modules import (MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP, hooks_reason, layer_config, linear_reason,
                      linear_structure_reason, mxfp8_dims_reason, same_numerics, swiglu_weights_reason,
                      weight_dtype_reason)

__all__ = ["ConversionReport", "convert_to_mxfp8"]

logger = logging.getLogger("cute_mxfp8")

_MXFP8_TYPES = (MXFP8Linear, MXFP8SwiGLUMLP, MXFP8GroupedExperts)


def converted_config(module: nn.Module) -> MXFP8Config | None:
    """The config of a module ``convert_to_mxfp8`` made or redirected (its MXFP8 modules; a Hugging Face experts
    module keeps its class and gets ``mxfp8_config``), else None."""
    if isinstance(module, _MXFP8_TYPES):
        return module.config
    return getattr(module, "mxfp8_config", None)


@dataclass
class ConversionReport:
    """What :func:`convert_to_mxfp8` did: ``converted`` lists (fqn, label), the label a str naming what the module
    now runs (the new module's class name, e.g. ``"MXFP8SwiGLUMLP"``, or ``"MXFP8 experts forward (transformers)"``
    for a Hugging Face experts module, which keeps its class); ``skipped`` lists (fqn, reason).  ``str(report)``
    is a readable summary."""

    converted: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} module(s) to MXFP8, skipped {len(self.skipped)}"]
        lines += [f"  + {fqn or '<root>'}: {kind}" for fqn, kind in self.converted]
        lines += [f"  - {fqn or '<root>'}: {why}" for fqn, why in self.skipped]
        return "\n".join(lines)


def _probe_weight(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random fp32 CPU tensor of ``shape`` that costs O(sum(shape)) memory: a Hankel view of a random vector
    (``W[i, j] = v[i + j]``), full rank in practice, so the probe sees a generic linear map."""
    v = torch.randn(sum(shape) - len(shape) + 1, generator=gen) / shape[-1] ** 0.5
    return v.as_strided(shape, (1,) * len(shape))


def _probe_experts_weight(shape: tuple[int, int, int], gen: torch.Generator) -> torch.Tensor:
    """A random bf16 (E, R, C) tensor costing O((E + R) C) memory: expert e's rows start one row further into a
    random (E + R, C) matrix (``W[e, r] = V[e + r]``), so experts differ, rows have unit stride (as
    ``torch._grouped_mm`` needs) and a forward that casts weights to bf16 keeps the view instead of copying it."""
    e, r, c = shape
    v = (torch.randn((e + r) * c, generator=gen) / c ** 0.5).to(torch.bfloat16)
    return v.as_strided(shape, (c, c, 1))


def _probe_input(rows: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Rows at three magnitudes (1e-2, 1, 30), so clamps and saturating variants of the math are caught."""
    scale = torch.tensor([1e-2, 1.0, 30.0]).repeat(-(-rows // 3))[:rows, None]
    return torch.randn(rows, d, generator=gen) * scale


def _probe_outputs(m: nn.Module, params: dict, args: tuple) -> list[torch.Tensor] | None:
    """Run ``m`` in train mode with grad mode on, in train mode under ``no_grad``, then in eval mode (``no_grad``),
    on probe parameters (the module's own tensors are not touched); None if the forward fails or does not return a
    tensor.  Restores every submodule's training flag.  (The MXFP8 module computes the same in every mode: so must
    the module it replaces; the runs also catch a forward that draws random numbers.)"""
    modes = [(mod, mod.training) for mod in m.modules()]
    try:
        with torch.random.fork_rng(devices=[]):  # a forward that draws random numbers leaves the global RNG as is
            m.train()
            with torch.enable_grad():  # (probe tensors need no grad: no graph is built)
                outs = [torch.func.functional_call(m, params, args)]
            with torch.no_grad():
                outs.append(torch.func.functional_call(m, params, args))
                m.eval()
                outs.append(torch.func.functional_call(m, params, args))
    except Exception:  # a forward with another signature or other state: not the module we look for
        return None
    finally:
        for mod, mode in modes:
            mod.training = mode
    return outs if all(isinstance(o, torch.Tensor) for o in outs) else None


def _matches(outs: list[torch.Tensor] | None, ref: torch.Tensor, loose: bool = False) -> bool:
    """Deterministic and mode-free (the three runs of :func:`_probe_outputs` agree exactly: no dropout, no
    ``self.training`` or grad-mode branch) and equal to the SwiGLU math; ``loose``:
    within 2 % of each row's largest value (a module computing in bf16, as torchtitan's grouped experts do, is off
    by ~0.5 %; GELU instead of SiLU by ~18 %), so an output scaled by less than ~1.02 would pass unnoticed."""
    if outs is None or outs[0].shape != ref.shape or not all(torch.equal(outs[0], o) for o in outs[1:]) \
            or not outs[0].is_floating_point():
        return False
    if loose:  # per row, against the row's largest value (the probe rows differ 3000x in magnitude)
        err = (outs[0].float() - ref).abs().amax(dim=-1)
        return bool((err <= 2e-2 * ref.abs().amax(dim=-1)).all())
    return torch.allclose(outs[0], ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))


# child names of (gate, down, up): torchtitan FeedForward, Hugging Face LlamaMLP and friends
_FFN_NAMES = (("w1", "w2", "w3"), ("gate_proj", "down_proj", "up_proj"))
# parameter names of (w1 (E, I, D), w2 (E, D, I), w3 (E, I, D)): torchtitan 0.2, torchtitan 0.3
_EXPERTS_NAMES = (("w1", "w2", "w3"), ("w1_EFD", "w2_EDF", "w3_EFD"))


def check_model_and_filter(fn: str, what: str, model, filter_fn, signature: str) -> None:
    """TypeError naming the fix for a ``model`` that is not an ``nn.Module`` or a ``filter_fn`` that is not
    callable (``convert_to_mxfp8`` and ``quantize_weights_`` take both; ``signature`` is their filter's)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn} takes the model (an nn.Module) {what}, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"{fn}: filter_fn must be None or a callable {signature} -> bool, got "
                        f"{type(filter_fn).__name__}")
    if filter_fn is not None:
        try:
            params = inspect.signature(filter_fn)
        except (TypeError, ValueError):  # builtins without a signature: called as they are
            return
        try:
            params.bind(*([None] * (signature.count(",") + 1)))
        except TypeError:
            raise TypeError(f"{fn}: filter_fn is called as filter_fn{signature}; this one takes "
                            f"{params}") from None


def _swiglu_ffn_dims(m: nn.Module) -> tuple[int, int, tuple[str, str, str]] | str | None:
    """(D, I, names) if ``m`` has the shape of a SwiGLU FFN: three bias-free Linears named as in
    :data:`_FFN_NAMES`, no parameters of its own, any other children parameter-free (an activation); ``"biases"``
    if the Linears are there with biases."""
    if list(m.named_parameters(recurse=False)):
        return None
    children = dict(m.named_children())
    for names in _FFN_NAMES:
        if not set(names) <= set(children):
            continue
        gate, down, up = (children[n] for n in names)
        # (Linears with hooks still make an FFN: _candidate reports it unfused, naming the hooks)
        if not all(isinstance(c, nn.Linear) and linear_structure_reason(c) is None for c in (gate, down, up)):
            return None
        if any(c.bias is not None for c in (gate, down, up)):
            return "biases"
        if any(list(c.parameters()) or list(c.buffers()) for n, c in children.items() if n not in names):
            return None
        i, d = gate.weight.shape
        if up.weight.shape != (i, d) or down.weight.shape != (d, i):
            return None
        return d, i, names
    return None


@torch.inference_mode(False)  # (convert_to_mxfp8 called under inference_mode: the probe's grad-mode run needs
@torch.no_grad()                # normal tensors)
def _is_swiglu_ffn(m: nn.Module, d: int, i: int, names: tuple[str, str, str], gen: torch.Generator) -> bool:
    w1, w2, w3 = _probe_weight((i, d), gen), _probe_weight((d, i), gen), _probe_weight((i, d), gen)
    params = {f"{names[0]}.weight": w1, f"{names[1]}.weight": w2, f"{names[2]}.weight": w3}
    x = _probe_input(6, d, gen)
    ref = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    return _matches(_probe_outputs(m, params, (x,)), ref)


def _grouped_experts_dims(m: nn.Module) -> tuple[int, int, int, tuple[str, str, str]] | None:
    params = dict(m.named_parameters(recurse=False))
    if list(m.children()):
        return None
    for names in _EXPERTS_NAMES:
        if set(params) != set(names):
            continue
        w1, w2, w3 = (params[n] for n in names)
        if w1.dim() != 3:
            return None
        e, i, d = w1.shape
        if w3.shape != (e, i, d) or w2.shape != (e, d, i):
            return None
        return e, d, i, names
    return None


@torch.inference_mode(False)
@torch.no_grad()
def _is_grouped_experts(m: nn.Module, e: int, d: int, i: int, names: tuple[str, str, str],
                        gen: torch.Generator) -> bool:
    w1, w2, w3 = (_probe_experts_weight(shape, gen) for shape in ((e, i, d), (e, d, i), (e, i, d)))
    params = dict(zip(names, (w1, w2, w3)))
    w1, w2, w3 = w1.float(), w2.float(), w3.float()  # the reference in fp32
    counts = torch.full((e,), 3, dtype=torch.int64)
    x = _probe_input(3 * e, d, gen).to(torch.bfloat16)  # the weights' dtype (modules that do not cast mix none)
    ref = torch.cat([F.linear(F.silu(F.linear(xe, w1[g])) * F.linear(xe, w3[g]), w2[g])
                     for g, xe in enumerate(x.float().split(3))])
    return _matches(_probe_outputs(m, params, (x, counts)), ref, loose=True)


def _forward_reason(m: nn.Module, inputs: tuple[str, ...]) -> str | None:
    """Why ``m``'s forward is wider than the MXFP8 module's ``forward(*inputs)``: named parameters past the inputs
    (``forward(x, scale=None)``), which callers may pass and the MXFP8 module would refuse (None: it is not;
    ``*args`` / ``**kwargs`` are allowed, as a forward that takes them need not read them)."""
    try:
        params = list(inspect.signature(m.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the probe decides
        return None
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = named[len(inputs):]
    if not extra:
        return None
    return (f"its forward takes {', '.join(extra)} besides {', '.join(inputs)}, which the MXFP8 module's forward"
            f"({', '.join(inputs)}) does not: a call passing them would fail")


def _hf_experts(m: nn.Module) -> bool:
    """A Hugging Face experts module whose forward transformers dispatches (``use_experts_implementation``)."""
    return hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "_apply_gate") \
        and hasattr(getattr(m, "config", None), "_experts_implementation")


def _skip(report: ConversionReport, fqn: str, why: str) -> None:
    report.skipped.append((fqn, why))
    logger.info("cute_mxfp8: left %s in high precision: %s", fqn or "<root>", why)


HF_EXPERTS = "MXFP8 experts forward (transformers)"
# modules whose 3-D parameters are no expert weights (a convolution's (out, in, k) kernel, a Bilinear's (out, in1,
# in2); Linear / Embedding)
NOT_EXPERTS = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd, nn.Bilinear)


def _candidate(m: nn.Module, gen: torch.Generator) -> tuple[str, dict[str, int], object] | str | None:
    """``(kind, dims, names)`` if ``m`` is something this converter can replace, a reason string if it looks like
    an FFN or experts block but is not taken, else None."""
    if isinstance(m, nn.Linear):
        why = linear_reason(m)
        return why if why is not None else ("MXFP8Linear", {"in_features": m.in_features,
                                                            "out_features": m.out_features}, None)
    if _hf_experts(m):
        from ..integrations.transformers import experts_layout_reason

        why = experts_layout_reason(m)
        if why is not None:
            return f"transformers experts module with a layout the MXFP8 experts do not take: {why}"
        if "forward" in vars(m):  # (its hooks stay: the module keeps its place, only its forward changes)
            return ("transformers experts module whose forward is replaced on the instance (e.g. by accelerate "
                    "hooks), which the MXFP8 experts forward would drop: convert before wrapping it")
        e, i2, d = m.gate_up_proj.shape
        return HF_EXPERTS, {"dim": d, "hidden_dim": i2 // 2}, None
    dims = _swiglu_ffn_dims(m)
    if dims == "biases":
        return ("SwiGLU FFN with biased Linears: the fused MXFP8 MLP has no biases, so its Linears are converted "
                "one by one")
    if dims is not None:
        # (before the probe, which would run hooks on probe data; the Linears are kept, so their state-dict hooks too)
        why = hooks_reason(m, kept=dims[2]) or _forward_reason(m, ("x",))
        if why is not None:
            return f"SwiGLU FFN not fused: {why}; its Linears are converted one by one where they can be"
        if _is_swiglu_ffn(m, *dims, gen):
            return "MXFP8SwiGLUMLP", {"dim": dims[0], "hidden_dim": dims[1]}, dims[2]
        return (f"has SwiGLU FFN children {'/'.join(dims[2])} but its forward is not w2(silu(w1(x)) * w3(x)) "
                "(other activation, scaling, gating, dropout, or a train / eval or grad-mode difference)")
    gdims = _grouped_experts_dims(m)
    if gdims is not None:
        why = hooks_reason(m) or _forward_reason(m, ("x", "num_tokens_per_expert"))
        if why is not None:
            return f"grouped experts kept in high precision: {why}"
        if _is_grouped_experts(m, *gdims, gen):
            return "MXFP8GroupedExperts", {"dim": gdims[1], "hidden_dim": gdims[2]}, gdims[3]
        return (f"has grouped-experts parameters {'/'.join(gdims[3])} but forward(x, num_tokens_per_expert) is not "
                "the per-expert SwiGLU (other activation, scaling, routing, dropout, or a train / eval or grad-mode "
                "difference)")
    three_d = [n for n, p in m.named_parameters(recurse=False) if p.dim() == 3]
    if three_d and not isinstance(m, NOT_EXPERTS):
        return (f"3-D parameters {', '.join(three_d)} (experts-like) in a layout the converter does not know: "
                "w1/w2/w3 or w1_EFD/w2_EDF/w3_EFD (E, I, D) / (E, D, I) with forward(x, num_tokens_per_expert), or a "
                "transformers experts module")
    return None


def _why_not(m: nn.Module, dims: dict[str, int]) -> str | None:
    why = mxfp8_dims_reason(**dims)
    if why is not None:
        return why
    return weight_dtype_reason(m.parameters(), "parameters")


def _wrapped_reason(m: nn.Module, cfg: MXFP8Config) -> str | None:
    """Why ``m`` is not converted with ``cfg``: a weight ``quantize_weights_`` wrapped with other numerics already
    runs in MXFP8 with its own config, which the conversion would silently replace (None: no such weight)."""
    from .weight import MXFP8TrainingWeight  # (weight.py imports this package's modules)

    for n, p in m.named_parameters():
        if isinstance(p, MXFP8TrainingWeight) and not same_numerics(p.config, cfg):
            return (f"its parameter {n!r} was wrapped by quantize_weights_ with another config ({p.config}) and "
                    f"already runs in MXFP8 with it: convert with that config, or unwrap it first")
    return None


def _init_reason(m: nn.Module, kind: str, model_on_meta: bool) -> str | None:
    """Why ``m`` is not converted while the model is (partly) on the meta device: torchtitan initializes such a
    model with ``to_empty`` + ``init_states``, which runs on its own ``Module`` classes and only looks inside other
    modules for them, so an MXFP8Linear or MXFP8GroupedExperts in place of its Linear or experts would keep
    ``to_empty``'s garbage (the SwiGLU MLP keeps the FFN's Linears, which do initialize).  ``model_on_meta``: some
    parameter of the converted model is on meta (``to_empty`` on the model also empties materialized parts).
    None: not such a module, or nothing on meta."""
    if kind not in ("MXFP8Linear", "MXFP8GroupedExperts") or not callable(getattr(type(m), "init_states", None)):
        return None
    if not model_on_meta:
        return None
    fixes = "convert after init_states, or wrap the weights with quantize_weights_ (the modules stay)"
    if kind == "MXFP8GroupedExperts":
        fixes += (", or convert the config with cute_mxfp8.integrations.torchtitan (MXFP8Converter or its "
                  "overrides)")
    return ("the model is on the meta device and this module's class initializes its weights with init_states "
            f"(torchtitan), which the MXFP8 module would not run, so they would stay uninitialized: {fixes}")


def _gather_high_precision(m: nn.Module, fqn: str) -> None:
    """The converted module casts its weights itself, so weights ``quantize_weights_`` wrapped for the MXFP8
    all-gather (the same numerics) switch to the high-precision all-gather, as ``quantize_weights_`` does when it
    wraps the weights of converted modules (an MXFP8-gathered weight has no high-precision values to cast)."""
    from .weight import MXFP8TrainingWeight  # (weight.py imports this package's modules)

    for n, p in m.named_parameters():
        if isinstance(p, MXFP8TrainingWeight) and p.config.fsdp_mxfp8_all_gather:
            p.config = dataclasses.replace(p.config, fsdp_mxfp8_all_gather=False)
            logger.info("cute_mxfp8: %s all-gathers in high precision: the converted %s casts it itself",
                        f"{fqn}.{n}" if fqn else n, fqn or "model")


def _config_difference(own: MXFP8Config, cfg: MXFP8Config) -> str:
    """The fields in which ``own`` differs from ``cfg``, as ``name=own (asked: cfg's)``."""
    return ", ".join(f"{f.name}={getattr(own, f.name)!r} (asked: {getattr(cfg, f.name)!r})"
                     for f in dataclasses.fields(own) if getattr(own, f.name) != getattr(cfg, f.name))


def _replacement(m: nn.Module, kind: str, names, cfg: MXFP8Config) -> nn.Module:
    if kind == "MXFP8Linear":
        return MXFP8Linear.from_linear(m, cfg)
    if kind == "MXFP8SwiGLUMLP":
        return MXFP8SwiGLUMLP.from_module(m, cfg, names)
    if kind == HF_EXPERTS:  # the module stays; its forward goes to the MXFP8 experts (parameters untouched)
        from ..integrations.transformers import mxfp8_experts_forward

        m.mxfp8_config = cfg
        m.forward = functools.partial(mxfp8_experts_forward, m)  # a partial pickles (torch.save) by name
        return m
    return MXFP8GroupedExperts.from_module(m, cfg, names)


def convert_to_mxfp8(model: nn.Module, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
                     config: MXFP8Config | None = None) -> ConversionReport:
    """Swap, in place, every supported submodule of ``model`` for its MXFP8 counterpart.

    Args:
        model: any ``nn.Module``; its descendants are replaced (the root itself cannot be replaced in place and
            is reported as skipped if it is a candidate).  Already-converted modules are left alone (reported as
            skipped when their config differs from ``config``), and so are candidates whose weights
            ``quantize_weights_`` wrapped with a config other than ``config`` (they already run in MXFP8 with
            theirs; reported as skipped).
        filter_fn: ``filter_fn(module, fqn) -> bool``, asked about each candidate (a Linear, SwiGLU FFN,
            grouped-experts module or Hugging Face experts module) before it is converted; False keeps that
            candidate, and for an FFN / experts module everything inside it, in high precision (default: convert
            all).
        config: :class:`MXFP8Config` for every converted module (default ``MXFP8Config()``).
    Returns:
        A :class:`ConversionReport`.  Parameters are shared, so ``model.state_dict()`` is unchanged.  Candidates
        left in high precision (dims not multiples of 32, weights not bf16/fp32, filtered out, look-alikes whose
        forward is not the SwiGLU math, unknown experts layouts) and ``nn.Linear`` subclasses with their own
        forward are listed in ``report.skipped`` and logged, as are modules with hooks or a forward replaced on
        the instance and torchtitan Linears / experts of a model on the meta device (see the module docstring).
    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``filter_fn`` not callable (or not taking the two
        arguments above), or ``config`` not an :class:`MXFP8Config`.
        ValueError: ``config.backend`` names no registered backend.
    """
    check_model_and_filter("convert_to_mxfp8", "to convert in place", model, filter_fn, "(module, fully qualified "
                           "name)")
    cfg = layer_config(config, "convert_to_mxfp8")
    report = ConversionReport()
    if isinstance(model, _MXFP8_TYPES):
        return report
    gen = torch.Generator().manual_seed(0)  # probes never touch the global RNG
    found = _candidate(model, gen)
    if isinstance(found, tuple):
        _skip(report, "", "the root module cannot be replaced in place; convert a module that contains it")
        return report
    if isinstance(found, str):
        _skip(report, "", found)
    model_on_meta = any(p.is_meta for p in model.parameters())
    _convert_children(model, "", cfg, filter_fn, report, gen, {id(model): ("done", None)}, model_on_meta)
    return report


def _compiled_wrapper(m: nn.Module) -> bool:
    """A ``torch.compile`` module wrapper (``OptimizedModule``): its forward is bound to the module it wraps."""
    if type(m).__name__ != "OptimizedModule":  # (no torch._dynamo import for every other module)
        return False
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return False
    return isinstance(m, OptimizedModule)


def _convert_children(parent: nn.Module, prefix: str, cfg: MXFP8Config, filter_fn, report, gen, seen,
                      model_on_meta: bool) -> None:
    """Convert ``parent``'s children, each slot of it (``named_children`` would list a module held twice once, and
    the second slot would stay in high precision).  ``seen``: id -> ("converted", (replacement, label)) for a
    module converted in an earlier slot (it takes the same replacement unless ``filter_fn`` excludes this slot,
    which then keeps the high-precision module: both share the parameters), ("skipped", reason) for a candidate
    left alone (reported again for each slot), ("done", None) for a module whose children were visited."""
    for name, child in list(parent._modules.items()):
        if child is None:
            continue
        fqn = f"{prefix}.{name}" if prefix else name
        state, what = seen.get(id(child), (None, None))
        if state == "converted":
            if filter_fn is not None and not filter_fn(child, fqn):
                _skip(report, fqn, "excluded by filter_fn (another slot holding the same module converted it: "
                                   "this slot keeps the high-precision module, sharing its parameters)")
            else:
                setattr(parent, name, what[0])
                report.converted.append((fqn, what[1]))
            continue
        if state == "skipped":
            _skip(report, fqn, what)
            continue
        if state == "done":
            continue
        if _compiled_wrapper(parent) and name == "_orig_mod" and isinstance(_candidate(child, gen), tuple):
            seen[id(child)] = ("skipped", why := "compiled by torch.compile (the wrapper's forward calls this "
                                               "module itself, so a replacement would never run): convert before "
                                               "compiling")
            _skip(report, fqn, why)
            continue
        own = converted_config(child)
        seen[id(child)] = ("done", None)  # (until it is skipped or converted below; a filtered-out slot unmarks it)
        if own is not None:
            if not same_numerics(own, cfg):  # (the same numerics: nothing to say, as a second call is a no-op)
                _skip(report, fqn, f"already MXFP8 with another config ({_config_difference(own, cfg)}), left as "
                                   "it is: set its config (.config / .mxfp8_config) or convert the high-precision "
                                   "model")
            continue
        found = _candidate(child, gen)
        if isinstance(parent, nn.MultiheadAttention) and isinstance(child, nn.Linear):
            found = "nn.MultiheadAttention reads out_proj's weight itself (its forward never calls the Linear)"
        if not isinstance(found, tuple):
            if isinstance(found, str):
                _skip(report, fqn, found)
                if not child._modules:  # a leaf left alone: said again for each slot holding it
                    seen[id(child)] = ("skipped", found)
            _convert_children(child, fqn, cfg, filter_fn, report, gen, seen, model_on_meta)
            continue
        kind, dims, names = found
        if filter_fn is not None and not filter_fn(child, fqn):
            _skip(report, fqn, "excluded by filter_fn")
            del seen[id(child)]  # (another slot holding it may be converted)
            continue
        why = _why_not(child, dims) or _init_reason(child, kind, model_on_meta)
        if why is None and (why := _wrapped_reason(child, cfg)) is not None and kind == "MXFP8SwiGLUMLP":
            _skip(report, fqn, f"{why}; its Linears are converted one by one")  # (the wrapped one is skipped)
            _convert_children(child, fqn, cfg, filter_fn, report, gen, seen, model_on_meta)
            continue
        if why is not None:
            _skip(report, fqn, why)
            seen[id(child)] = ("skipped", why)
            continue
        if kind in ("MXFP8SwiGLUMLP", "MXFP8GroupedExperts"):
            weights = [getattr(child, n) for n in names]
            why = swiglu_weights_reason(*(w.weight if isinstance(w, nn.Linear) else w for w in weights))
            if why is not None:  # e.g. w1 and w3 in two dtypes: an FFN's Linears still convert one by one
                _skip(report, fqn, why)
                _convert_children(child, fqn, cfg, filter_fn, report, gen, seen, model_on_meta)
                continue
        if kind != "MXFP8Linear":
            why = mlp_hidden_reason(cfg, dims["hidden_dim"])
            if why is not None:  # the fast mode and the fused epilogues run Linears of any multiple-of-32 shape
                _skip(report, fqn, f"{why}; its Linears are converted one by one" if kind == "MXFP8SwiGLUMLP"
                      else f"{why}; left in high precision")  # (experts hold 3-D weights, no Linears)
                _convert_children(child, fqn, cfg, filter_fn, report, gen, seen, model_on_meta)
                continue
        _gather_high_precision(child, fqn)
        new = _replacement(child, kind, names, cfg)
        setattr(parent, name, new)
        seen[id(child)] = ("converted", (new, kind))
        report.converted.append((fqn, kind))
