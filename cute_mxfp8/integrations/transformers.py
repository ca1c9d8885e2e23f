"""Hugging Face ``transformers`` (5.x) MoE experts on the MXFP8 grouped SwiGLU MLP.

transformers dispatches the forward of its experts modules (Mixtral, Qwen3-MoE and every model whose experts class
is decorated with ``use_experts_implementation``) through a registry of *experts implementations*.
:func:`register` adds ``"cute_mxfp8"`` to it; then::

    from cute_mxfp8.integrations import transformers as mx_hf
    mx_hf.register()
    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="cute_mxfp8")
    # or, on a built model: model.set_experts_implementation("cute_mxfp8")

``convert_to_mxfp8(model)`` does the same per experts module (it points the module's forward at
:func:`mxfp8_experts_forward`) and, for the dense SwiGLU MLPs (``gate_proj`` / ``up_proj`` / ``down_proj`` +
SiLU), swaps in :class:`~cute_mxfp8.nn.MXFP8SwiGLUMLP` with the same child names.  Parameters are untouched, so
``save_pretrained`` checkpoints load into an unconverted model.

The experts layout this takes (checked per call, ValueError otherwise): ``gate_up_proj`` (E, 2I, D) with the gate
rows first (``is_concatenated``, not transposed), ``down_proj`` (E, D, I), no biases, no post-expert norm, SiLU;
D and I multiples of 32.  Expert-parallel sentinel ids (>= E) get zero output, as transformers' own grouped path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.autograd import mxfp8_swiglu_mlp_packed
from ..ops.group_meta import mark_safe
from ..ops.shapes import mxfp8_dims_reason

NAME = "cute_mxfp8"

__all__ = ["NAME", "experts_layout_reason", "mxfp8_experts_forward", "register"]


def experts_layout_reason(experts: nn.Module) -> str | None:
    """None if ``experts`` (a transformers experts module) has the layout :func:`mxfp8_experts_forward` takes,
    else the reason.  The activation is SiLU when it is transformers' ``SiLUActivation`` (what ``ACT2FN["silu"]``
    makes), an ``nn.SiLU`` or ``F.silu``; another callable is probed on 25 points against ``F.silu``, which needs
    eager mode: under ``torch.compile`` such an activation is not probed (it was when the module was converted, or
    at the first eager call)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return "no 3-D gate_up_proj (E, 2I, D) and down_proj (E, D, I) parameters"
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False}
    for flag, want in flags.items():
        if bool(getattr(experts, flag, want)) != want:
            return f"{flag}={not want} is not supported (gated, bias-free, [gate; up] rows, (out, in) weights)"
    e, i2, d = gate_up.shape
    if i2 % 2 or tuple(down.shape) != (e, d, i2 // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not (E, 2I, D), (E, D, I)"
    why = mxfp8_dims_reason(D=d, I=i2 // 2)
    if why is not None:
        return why
    act = getattr(experts, "act_fn", None)
    silu = type(act) is nn.SiLU or act is F.silu or (type(act).__name__ == "SiLUActivation"
                                                     and type(act).__module__ == "transformers.activations")
    if not silu and act is not None and torch.compiler.is_compiling():
        return None  # (a data-dependent probe would break the graph: checked in eager calls)
    if not silu:
        probe = torch.linspace(-6.0, 6.0, 25)
        try:
            silu = act is not None and torch.allclose(act(probe), F.silu(probe), rtol=1e-5, atol=1e-6)
        except Exception:  # noqa: BLE001 -- any activation we cannot evaluate is not SiLU
            silu = False
    if not silu:
        return f"activation {type(act).__name__} is not SiLU (the MXFP8 experts compute SwiGLU)"
    return None


def mxfp8_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                          top_k_weights: Tensor) -> Tensor:
    """The transformers experts-forward signature on the MXFP8 grouped SwiGLU MLP
    (:func:`cute_mxfp8.ops.mxfp8_swiglu_mlp_packed` with token-group offsets: 2d-3d GEMMs forward and dgrad, 2d-2d
    wgrad), on ``gate_up_proj`` (E, 2I, D) = [gate; up] itself (its halves are not copied; the fused-epilogue
    recipe re-packs W13 for its casts; its gradient in its own layout) and ``down_proj`` (E, D, I).

    Args:
        hidden_states: (T, D) bf16/fp32.  top_k_index: (T, k) expert ids.  top_k_weights: (T, k) routing weights.
    Returns: (T, D), ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(x[t])`` in ``hidden_states.dtype``.
    Uses ``self.mxfp8_config`` (an :class:`~cute_mxfp8.MXFP8Config`) when the module has one.  No host sync with
    the GPU backends: the group offsets are computed on the device, valid by construction (non-decreasing, within
    ``[0, T k]``), and marked so (:func:`cute_mxfp8.ops.group_meta.mark_safe`), so the grouped casts do not read
    them back to check them (the ``reference`` backend and ``wgrad_with_hp``'s per-group fp32 wgrads still read
    them).  Raises ValueError for a layout it does not take (:func:`experts_layout_reason`)."""
    why = experts_layout_reason(self)
    if why is not None:
        raise ValueError(f"cute_mxfp8 experts implementation: {type(self).__name__}: {why}; use "
                         "experts_implementation='grouped_mm' for this model")
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() != 2:
        raise ValueError(f"cute_mxfp8 experts forward: hidden_states must be (tokens, hidden) as transformers' "
                         f"experts take them, got {getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    t, d = hidden_states.shape
    k = top_k_index.shape[-1]
    e = self.gate_up_proj.shape[0]
    # stable: each expert's rows keep the tokens' order on every device and sort algorithm, so the token blocks of
    # the colwise casts (the wgrad's operands) hold the same tokens everywhere
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    x = hidden_states[perm // k]  # (T k, D), grouped by expert; sentinel ids (>= E) sort to the tail
    ends = torch.searchsorted(ids, torch.arange(1, e + 1, device=ids.device, dtype=ids.dtype))
    offs = ends.to(torch.int32)  # rows past offs[-1] (sentinels) come back as zeros
    mark_safe(offs, x.shape[0])  # (searchsorted of sorted ids: non-decreasing within [0, T k], no check needed)
    # gate_up_proj is W13 = [gate; up] as it is: its halves are not copied, its gradient comes in its layout
    y = mxfp8_swiglu_mlp_packed(x, self.gate_up_proj, self.down_proj, offs, getattr(self, "mxfp8_config", None))
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    out = torch.empty_like(y).index_copy_(0, perm, y)  # back to (token, slot) order
    return out.view(t, k, d).sum(dim=1).to(hidden_states.dtype)


def register() -> str:
    """Add :func:`mxfp8_experts_forward` to transformers' experts implementations as ``"cute_mxfp8"``
    (idempotent) and return the name.  Raises ImportError if transformers (>= 5, with
    ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``) is not installed."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as exc:
        raise ImportError("cute_mxfp8.integrations.transformers needs transformers >= 5 (experts implementations "
                          "registry): pip install 'transformers>=5'") from exc
    ALL_EXPERTS_FUNCTIONS.register(NAME, mxfp8_experts_forward)
    return NAME
