"""Which ``__torch_function__`` calls a weight tensor subclass redirects to the MXFP8 autograd functions: shared by
:class:`~cute_mxfp8.nn.weight.MXFP8TrainingWeight` and the FSDP2 all-gathered
:class:`~cute_mxfp8.nn.fsdp.MXFP8GatheredWeight`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

LINEAR = frozenset({F.linear, torch._C._nn.linear})  # the same function today; both spellings, should they part
_GROUPED_MM_ARGS = ("mat_a", "mat_b", "offs", "bias", "out_dtype")


def match_call(cls, func, args, kwargs):
    """``("linear", x, w, bias)`` for ``F.linear(x, w, bias)`` with a ``cls`` weight; ``("grouped", x, w, offs)``
    for the 2d-3d ``torch._grouped_mm(x, w_t, offs=offs)`` with a ``cls`` (E, K, N) ``w_t`` and no bias / other
    out_dtype (``w`` its (E, N, K) transpose, still a ``cls``); None for any other call."""
    if func in LINEAR:
        x, w, *rest = args
        if isinstance(w, cls) and not isinstance(x, cls):
            return "linear", x, w, rest[0] if rest else kwargs.get("bias")
    elif func is torch._grouped_mm:
        bound = dict(zip(_GROUPED_MM_ARGS, args)) | kwargs
        a, b = bound.get("mat_a"), bound.get("mat_b")
        if (isinstance(b, cls) and not isinstance(a, cls) and b.dim() == 3 and a.dim() == 2
                and bound.get("offs") is not None and bound.get("bias") is None
                and bound.get("out_dtype") in (None, a.dtype)):
            return "grouped", a, b.transpose(-2, -1), bound["offs"]
    return None
