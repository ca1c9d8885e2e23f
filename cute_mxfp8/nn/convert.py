"""``convert_to_mxfp8``: swap a model's Linears, SwiGLU FFNs and grouped experts for MXFP8 modules in place.

What is recognized (parameters are shared, never copied, so the state dict keys and values do not change):

* ``nn.Linear`` (exactly that type) -> :class:`MXFP8Linear`.
* A SwiGLU FFN: a module whose only children are bias-free ``nn.Linear`` named ``w1`` (D->I), ``w2`` (I->D),
  ``w3`` (D->I), with no parameters of its own, whose forward computes ``w2(silu(w1(x)) * w3(x))``
  -> :class:`MXFP8SwiGLUMLP` (one fused MXFP8 function for the whole FFN).
* Grouped experts: a module with no children whose only parameters are ``w1`` (E, I, D), ``w2`` (E, D, I),
  ``w3`` (E, I, D) and whose ``forward(x, num_tokens_per_expert)`` computes the per-expert SwiGLU
  -> :class:`MXFP8GroupedExperts`.

The forward of a candidate FFN / experts module is checked on a small random probe (skipped for meta tensors,
where the structure alone decides), so a module that merely looks like one is never swapped.  Layers whose dims
are not multiples of 32 (e.g. a router with 16 outputs) are left as they are; every skip is logged and reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MXFP8Config
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


def _is_meta(*ts: torch.Tensor) -> bool:
    return any(t.is_meta for t in ts)


def _probe_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.float64, torch.bfloat16) else torch.float32


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
def _forward_matches(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.shape == expected.shape and torch.allclose(actual.float(), expected.float(), rtol=2e-2, atol=1e-4)


@torch.no_grad()
def _is_swiglu_ffn(m: nn.Module, d: int) -> bool:
    w = m.w1.weight
    if _is_meta(w):
        return True
    x = torch.randn(4, d, device=w.device, dtype=_probe_dtype(w))
    try:
        out = m(x)
    except Exception:  # a forward with another signature is not a SwiGLU FFN
        return False
    ref = m.w2(F.silu(m.w1(x)) * m.w3(x))
    return isinstance(out, torch.Tensor) and _forward_matches(out, ref)


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
def _is_grouped_experts(m: nn.Module, e: int, d: int) -> bool:
    w1, w2, w3 = m.w1, m.w2, m.w3
    if _is_meta(w1):
        return True
    counts = torch.arange(1, e + 1, device=w1.device)
    x = torch.randn(int(counts.sum()), d, device=w1.device, dtype=_probe_dtype(w1))
    try:
        out = m(x, counts)
    except Exception:  # another signature: not grouped experts
        return False
    refs, start = [], 0
    for g, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        refs.append(F.linear(F.silu(F.linear(xe, w1[g])) * F.linear(xe, w3[g]), w2[g]))
        start += n
    return isinstance(out, torch.Tensor) and _forward_matches(out, torch.cat(refs))


def _skip(report: ConversionReport, fqn: str, why: str) -> None:
    report.skipped.append((fqn, why))
    logger.info("cute_mxfp8: left %s in high precision: %s", fqn or "<root>", why)


def _convert_one(m: nn.Module, cfg: MXFP8Config, report: ConversionReport, fqn: str) -> nn.Module | None:
    """The MXFP8 replacement for ``m``, or None (after reporting why, when it is a candidate)."""
    if type(m) is nn.Linear:
        why = mxfp8_dims_reason(in_features=m.in_features, out_features=m.out_features)
        if why is not None:
            _skip(report, fqn, why)
            return None
        return MXFP8Linear.from_linear(m, cfg)
    dims = _swiglu_ffn_dims(m)
    if dims is not None and _is_swiglu_ffn(m, dims[0]):
        why = mxfp8_dims_reason(dim=dims[0], hidden_dim=dims[1])
        if why is not None:
            _skip(report, fqn, why)
            return None
        return MXFP8SwiGLUMLP.from_module(m, cfg)
    gdims = _grouped_experts_dims(m)
    if gdims is not None and _is_grouped_experts(m, gdims[0], gdims[1]):
        why = mxfp8_dims_reason(dim=gdims[1], hidden_dim=gdims[2])
        if why is not None:
            _skip(report, fqn, why)
            return None
        return MXFP8GroupedExperts.from_module(m, cfg)
    return None


def convert_to_mxfp8(model: nn.Module, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
                     config: MXFP8Config | None = None) -> ConversionReport:
    """Swap, in place, every supported submodule of ``model`` for its MXFP8 counterpart.

    Args:
        model: any ``nn.Module``; its children are replaced (the root itself cannot be replaced in place and is
            reported as skipped if it is a candidate).
        filter_fn: ``filter_fn(module, fqn) -> bool``; only modules for which it returns True are converted
            (default: all).  A module filtered out is not descended into when it is a whole FFN / experts module.
        config: :class:`MXFP8Config` for every converted module (default ``MXFP8Config()``).
    Returns:
        A :class:`ConversionReport`.  Parameters are shared, so ``model.state_dict()`` is unchanged.
    """
    cfg = config or MXFP8Config()
    report = ConversionReport()
    if not isinstance(model, _MXFP8_TYPES) and _convert_one(model, cfg, ConversionReport(), "") is not None:
        _skip(report, "", "the root module cannot be replaced in place; convert a module that contains it")
        return report
    _convert_children(model, "", cfg, filter_fn, report)
    return report


def _convert_children(parent: nn.Module, prefix: str, cfg: MXFP8Config, filter_fn, report) -> None:
    for name, child in list(parent.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _MXFP8_TYPES):
            continue
        if filter_fn is None or filter_fn(child, fqn):
            new = _convert_one(child, cfg, report, fqn)
            if new is not None:
                setattr(parent, name, new)
                report.converted.append((fqn, type(new).__name__))
                continue
        _convert_children(child, fqn, cfg, filter_fn, report)
