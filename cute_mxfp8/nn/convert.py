"""``convert_to_mxfp8``: swap a model's Linears, SwiGLU FFNs and grouped experts for MXFP8 modules in place.

What is recognized (parameters are shared, never copied, so the state dict keys and values do not change):

* ``nn.Linear`` (exactly that type) -> :class:`MXFP8Linear`.
* A SwiGLU FFN: a module whose only children are bias-free ``nn.Linear`` named ``w1`` (D->I), ``w2`` (I->D),
  ``w3`` (D->I), with no parameters of its own, whose forward computes ``w2(silu(w1(x)) * w3(x))``
  -> :class:`MXFP8SwiGLUMLP` (one fused MXFP8 function for the whole FFN).
* Grouped experts: a module with no children whose only parameters are ``w1`` (E, I, D), ``w2`` (E, D, I),
  ``w3`` (E, I, D) and whose ``forward(x, num_tokens_per_expert)`` computes the per-expert SwiGLU
  -> :class:`MXFP8GroupedExperts`.

The forward of a candidate FFN / experts module is checked before it is swapped: it runs twice in train mode on
random probe weights (substituted with ``torch.func.functional_call``; the module's own tensors are not read, so
meta-device models are checked too) and inputs at three magnitudes, and must be deterministic (no dropout) and
equal to the SwiGLU math.  So a module that merely looks like one (other activation, scaling, clamping, dropout)
is not swapped.  Layers whose dims are not multiples of 32 (e.g. a router with 16 outputs) or whose weights are
not bf16/fp32 are left as they are; every skip is logged and reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MXFP8Config, resolve_config
from .modules import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP, mxfp8_dims_reason

__all__ = ["ConversionReport", "convert_to_mxfp8"]

logger = logging.getLogger("cute_mxfp8")

_MXFP8_TYPES = (MXFP8Linear, MXFP8SwiGLUMLP, MXFP8GroupedExperts)


@dataclass
class ConversionReport:
    """What :func:`convert_to_mxfp8` did: ``converted`` lists (fqn, new module type), ``skipped`` lists
    (fqn, reason).  ``str(report)`` is a readable summary."""

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


def _probe_input(rows: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Rows at three magnitudes (1e-2, 1, 30), so clamps and saturating variants of the math are caught."""
    scale = torch.tensor([1e-2, 1.0, 30.0]).repeat(-(-rows // 3))[:rows, None]
    return torch.randn(rows, d, generator=gen) * scale


def _train_mode_outputs(m: nn.Module, params: dict, args: tuple) -> list[torch.Tensor] | None:
    """Run ``m`` twice in train mode on probe parameters (the module's own tensors are not touched); None if the
    forward fails or does not return a tensor.  Restores every submodule's training flag."""
    modes = [(mod, mod.training) for mod in m.modules()]
    m.train()
    try:
        with torch.random.fork_rng(devices=[]):  # a forward that draws random numbers leaves the global RNG as is
            outs = [torch.func.functional_call(m, params, args) for _ in range(2)]
    except Exception:  # a forward with another signature or other state: not the module we look for
        return None
    finally:
        for mod, mode in modes:
            mod.training = mode
    return outs if all(isinstance(o, torch.Tensor) for o in outs) else None


def _matches(outs: list[torch.Tensor] | None, ref: torch.Tensor) -> bool:
    """Deterministic (the two train-mode runs agree exactly, so no dropout) and equal to the SwiGLU math."""
    if outs is None or outs[0].shape != ref.shape or not torch.equal(outs[0], outs[1]):
        return False
    return torch.allclose(outs[0], ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))


def _swiglu_ffn_dims(m: nn.Module) -> tuple[int, int] | None:
    children = dict(m.named_children())
    if set(children) != {"w1", "w2", "w3"} or any(type(c) is not nn.Linear for c in children.values()):
        return None
    if any(c.bias is not None for c in children.values()) or list(m.named_parameters(recurse=False)):
        return None
    w1, w2, w3 = (children[k].weight for k in ("w1", "w2", "w3"))
    i, d = w1.shape
    if w3.shape != (i, d) or w2.shape != (d, i):
        return None
    return d, i


@torch.no_grad()
def _is_swiglu_ffn(m: nn.Module, d: int, i: int, gen: torch.Generator) -> bool:
    w = {"w1.weight": _probe_weight((i, d), gen), "w2.weight": _probe_weight((d, i), gen),
         "w3.weight": _probe_weight((i, d), gen)}
    x = _probe_input(6, d, gen)
    ref = F.linear(F.silu(F.linear(x, w["w1.weight"])) * F.linear(x, w["w3.weight"]), w["w2.weight"])
    return _matches(_train_mode_outputs(m, w, (x,)), ref)


def _grouped_experts_dims(m: nn.Module) -> tuple[int, int, int] | None:
    params = dict(m.named_parameters(recurse=False))
    if set(params) != {"w1", "w2", "w3"} or list(m.children()):
        return None
    w1, w2, w3 = params["w1"], params["w2"], params["w3"]
    if w1.dim() != 3:
        return None
    e, i, d = w1.shape
    if w3.shape != (e, i, d) or w2.shape != (e, d, i):
        return None
    return e, d, i


@torch.no_grad()
def _is_grouped_experts(m: nn.Module, e: int, d: int, i: int, gen: torch.Generator) -> bool:
    w = {"w1": _probe_weight((e, i, d), gen), "w2": _probe_weight((e, d, i), gen), "w3": _probe_weight((e, i, d), gen)}
    counts = torch.full((e,), 3, dtype=torch.int64)
    x = _probe_input(3 * e, d, gen)
    ref = torch.cat([F.linear(F.silu(F.linear(xe, w["w1"][g])) * F.linear(xe, w["w3"][g]), w["w2"][g])
                     for g, xe in enumerate(x.split(3))])
    return _matches(_train_mode_outputs(m, w, (x, counts)), ref)


def _skip(report: ConversionReport, fqn: str, why: str) -> None:
    report.skipped.append((fqn, why))
    logger.info("cute_mxfp8: left %s in high precision: %s", fqn or "<root>", why)


_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


def _candidate(m: nn.Module, gen: torch.Generator) -> tuple[str, dict[str, int]] | None:
    """``(kind, dims)`` if ``m`` is something this converter can replace, else None."""
    if type(m) is nn.Linear:
        return "MXFP8Linear", {"in_features": m.in_features, "out_features": m.out_features}
    dims = _swiglu_ffn_dims(m)
    if dims is not None and _is_swiglu_ffn(m, *dims, gen):
        return "MXFP8SwiGLUMLP", {"dim": dims[0], "hidden_dim": dims[1]}
    gdims = _grouped_experts_dims(m)
    if gdims is not None and _is_grouped_experts(m, *gdims, gen):
        return "MXFP8GroupedExperts", {"dim": gdims[1], "hidden_dim": gdims[2]}
    return None


def _why_not(m: nn.Module, dims: dict[str, int]) -> str | None:
    why = mxfp8_dims_reason(**dims)
    if why is not None:
        return why
    bad = sorted({str(p.dtype) for p in m.parameters() if p.dtype not in _WEIGHT_DTYPES})
    if bad:
        return f"parameters in {', '.join(bad)}: MXFP8 layers take bfloat16 or float32 weights"
    return None


def _replacement(m: nn.Module, kind: str, cfg: MXFP8Config) -> nn.Module:
    if kind == "MXFP8Linear":
        return MXFP8Linear.from_linear(m, cfg)
    if kind == "MXFP8SwiGLUMLP":
        return MXFP8SwiGLUMLP.from_module(m, cfg)
    return MXFP8GroupedExperts.from_module(m, cfg)


def convert_to_mxfp8(model: nn.Module, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
                     config: MXFP8Config | None = None) -> ConversionReport:
    """Swap, in place, every supported submodule of ``model`` for its MXFP8 counterpart.

    Args:
        model: any ``nn.Module``; its descendants are replaced (the root itself cannot be replaced in place and
            is reported as skipped if it is a candidate).  Already-converted modules are left alone.
        filter_fn: ``filter_fn(module, fqn) -> bool``, asked about each candidate (a Linear, SwiGLU FFN or
            grouped-experts module) before it is converted; False keeps that candidate, and for an FFN / experts
            module everything inside it, in high precision (default: convert all).
        config: :class:`MXFP8Config` for every converted module (default ``MXFP8Config()``).
    Returns:
        A :class:`ConversionReport`.  Parameters are shared, so ``model.state_dict()`` is unchanged.  Candidates
        left in high precision (dims not multiples of 32, weights not bf16/fp32, filtered out) and ``nn.Linear``
        subclasses (not converted: their forward may differ) are listed in ``report.skipped`` and logged.
    Raises:
        TypeError: ``config`` is not an :class:`MXFP8Config`.
    """
    cfg = resolve_config(config)
    report = ConversionReport()
    if isinstance(model, _MXFP8_TYPES):
        return report
    gen = torch.Generator().manual_seed(0)  # probes never touch the global RNG
    if _candidate(model, gen) is not None:
        _skip(report, "", "the root module cannot be replaced in place; convert a module that contains it")
        return report
    _convert_children(model, "", cfg, filter_fn, report, gen)
    return report


def _convert_children(parent: nn.Module, prefix: str, cfg: MXFP8Config, filter_fn, report, gen) -> None:
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _MXFP8_TYPES):
            continue
        found = _candidate(child, gen)
        if found is None:
            if isinstance(child, nn.Linear):
                _skip(report, fqn, f"{type(child).__name__} subclasses nn.Linear; only plain nn.Linear is converted")
            else:
                _convert_children(child, fqn, cfg, filter_fn, report, gen)
            continue
        kind, dims = found
        if filter_fn is not None and not filter_fn(child, fqn):
            _skip(report, fqn, "excluded by filter_fn")
            continue
        why = _why_not(child, dims)
        if why is not None:
            _skip(report, fqn, why)
            continue
        setattr(parent, name, _replacement(child, kind, cfg))
        report.converted.append((fqn, kind))
