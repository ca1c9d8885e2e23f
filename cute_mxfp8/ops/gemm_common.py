"""What the kernel backends' ops share: the operand limits of TMA-fed kernels, the token-group offset rules (limits,
device-side sanitizing) and the bias rule (one rounding after an fp32 bias add) for kernels whose epilogue has no
bias input."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .shapes import colwise_shapes, rowwise_shapes


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The SMs of ``device``'s GPU: the CTAs of the persistent kernels' grids (one per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count

MAX_ELEMENTS = 2**31 - 1  # the kernels' coordinates and scale offsets are 32-bit
MAX_GROUPS = 65536  # the device-side binary searches over offs take at most 17 steps


def offs_limits(offs) -> str | None:
    """Why a kernel cannot take these token-group offsets (None: it can).  Values are not read (no host sync)."""
    if offs is None:
        return None
    if not offs.is_contiguous():
        return "offs must be contiguous for the kernels (call .contiguous())"
    if offs.numel() > MAX_GROUPS:
        return f"{offs.numel()} token groups exceed the kernels' limit ({MAX_GROUPS})"
    return None


def device_offsets(offs: torch.Tensor, total: int) -> torch.Tensor:
    """``offs`` made safe for a kernel without reading it on the host: clamped into [0, total] and made
    non-decreasing on the device.  Offsets that keep the contract (``formats.validate_offsets``) come back
    unchanged; others give a meaningless but in-bounds result instead of out-of-bounds accesses."""
    return offs.clamp(0, total).cummax(0).values


def device_offsets_host(ends: list[int], total: int) -> list[int]:
    """:func:`device_offsets` of offsets given as Python ints (no torch op)."""
    out, hi = [], 0
    for e in ends:
        hi = max(hi, min(max(e, 0), total))
        out.append(hi)
    return out


def group_schedule(offs: torch.Tensor, tile_m: int) -> torch.Tensor:
    """(2, G) int32 on ``offs``'s device, computed there (no sync): row 0 the cumulative count of each group's
    ``tile_m``-row M tiles (the 2d-3d kernels' tile -> group lookup; a group starts on a fresh tile), row 1 the
    groups' first 128-row scale tiles (:func:`cute_mxfp8.formats.group_tile_starts`, where the grouped scale
    layouts start each group)."""
    from .. import formats as F

    o = offs.to(torch.int64)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    ends = torch.cumsum((sizes + tile_m - 1) // tile_m, 0)
    return torch.stack([ends.to(torch.int32), F.group_tile_starts(offs)])


def group_schedule_host(safe: list[int], tile_m: int) -> list[list[int]]:
    """:func:`group_schedule` of sanitized offsets given as Python ints (:func:`device_offsets_host`)."""
    from .. import formats as F

    return [F.group_units_host(safe, tile_m), F.group_tile_starts_host(safe)]


def safe_offsets(offs: torch.Tensor, t: int) -> torch.Tensor:
    """:func:`device_offsets` of ``offs`` over ``t`` rows, once per offsets tensor (from its host copy where one
    is known: :func:`.group_meta.derived_tensors`)."""
    from .group_meta import derived_tensors

    return derived_tensors(offs, "device_offsets", lambda o: device_offsets(o, t),
                           lambda o: device_offsets_host(o, t), t)


def schedule_m(offs: torch.Tensor, t: int, tile_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(safe offs, :func:`group_schedule`) of a 2d-3d launch over ``t`` rows in ``tile_m``-row tiles, computed
    once per offsets tensor (:func:`.group_meta.derived_tensors`)."""
    from .group_meta import derived_tensors

    safe = safe_offsets(offs, t)
    return safe, derived_tensors(offs, "schedule_m", lambda o: group_schedule(safe, tile_m),
                                 lambda o: group_schedule_host(device_offsets_host(o, t), tile_m), t, tile_m)


def run_grouped_mm(kernel: Callable, a, a_scales, b, b_scales, offs, out_dtype, tile_m: int) -> torch.Tensor:
    """2d-3d ``grouped_mm``'s output from ``kernel`` (``kernel(a, b, sfa, sfb, d, offs, sched)``: an SM90 or SM100
    grouped build; b (E, N, K) is passed as (E * N, K), its scales flat, the offsets and :func:`group_schedule`
    in ``tile_m``-row tiles made on the device).  Rows at or past ``offs[-1]`` are zero; without groups (E = 0)
    all rows are, and nothing is launched (there is no weight to build a TMA descriptor over)."""
    e, n, k = b.shape
    if e == 0:
        return torch.zeros(a.shape[0], n, dtype=out_dtype, device=a.device)
    d = torch.empty(a.shape[0], n, dtype=out_dtype, device=a.device)
    if d.numel():
        kernel(a, b.view(e * n, k), a_scales.view(torch.uint8), b_scales.view(torch.uint8).reshape(-1), d,
               *schedule_m(offs, a.shape[0], tile_m))
    return d


def operand_limits(a, a_scales, b, b_scales) -> str | None:
    """Why a TMA-fed GEMM kernel cannot take these operands (None: it can)."""
    for name, t in (("a", a), ("b", b), ("a_scales", a_scales), ("b_scales", b_scales)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} must be contiguous with a 16-byte aligned data pointer for TMA (call .contiguous())"
        if t.numel() > MAX_ELEMENTS:
            return f"{name} has {t.numel()} elements; the kernel indexes with int32 (at most {MAX_ELEMENTS})"
    if a.shape[1] == 0:
        return "K = 0: nothing to multiply (the reference backend returns zeros, plus the bias if given)"
    return None


def mm_with_bias(run: Callable[[torch.Tensor], None], a, b, out_dtype, bias) -> torch.Tensor:
    """D (M, N) in ``out_dtype`` written by ``run(d)``; with a bias the kernel writes fp32 and the bias is added
    before the one rounding to ``out_dtype`` (as the reference and cuBLAS's bias epilogue)."""
    d = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype if bias is None else torch.float32, device=a.device)
    if d.numel():
        run(d)
    if bias is not None:
        d = d.add_(bias.float()).to(out_dtype)
    return d


# ---- outputs of the GEMM-fused SwiGLU / dSwiGLU + dual-quant epilogues (SM90 and SM100 kernels alike) ----

def dual_outputs(like: torch.Tensor, m: int, n: int, elem_dtype, emit_hp: bool, groups: int | None = None):
    """Outputs of a dual cast of an (m, n) tensor (the shapes of :mod:`.shapes`, blocked; grouped layouts with
    ``groups``): data, zero-filled scales (the epilogue writes only the real ones) and the fp32 copy of the values
    (or an empty one).  With groups the data and the fp32 copy are zero-filled too: the kernels leave the rows past
    ``offs[-1]`` alone, where the reference has the casts of zeros."""
    dev = like.device
    (qd, qsd), (qtd, qtsd) = rowwise_shapes((m, n), True, groups), colwise_shapes((m, n), True, groups)
    new = torch.empty if groups is None else torch.zeros
    q, qt = (new(d, dtype=elem_dtype, device=dev) for d in (qd, qtd))
    qs, qts = (torch.empty(d, dtype=torch.uint8, device=dev) for d in (qsd, qtsd))
    torch._foreach_zero_([qs, qts])  # one launch for both
    hp = new((m, n) if emit_hp else (0,), dtype=torch.float32, device=dev)
    return q, qs, qt, qts, hp


def hp_arg(hp: torch.Tensor) -> torch.Tensor:
    """The ``hp`` kernel argument: ``hp`` itself, or a placeholder of the compiled rank when it is empty."""
    return hp if hp.numel() else torch.zeros(1, 32, dtype=hp.dtype, device=hp.device)  # unused by the build


def e8m0_outputs(q, qs, qt, qts, hp):
    """The dual-cast outputs as the ops return them: the scale buffers viewed as ``float8_e8m0fnu``."""
    return q, qs.view(torch.float8_e8m0fnu), qt, qts.view(torch.float8_e8m0fnu), hp


def run_mm_swiglu_quant(kernel: Callable, a, a_scales, b13, b13_scales, elem_dtype, emit_hp: bool, out_dtype,
                        extra: tuple = (), groups: int | None = None):
    """``mm_swiglu_quant``'s outputs from ``kernel`` (``kernel(a, b13, sfa, sfb, h13, q, qs, qt, qts, hp,
    *extra)``: an SM90 or SM100 GEMM build with the SwiGLU epilogue): h13 (M, 2I) ``out_dtype``, then h's dual
    cast (grouped layouts with ``groups``; b13 (E, 2I, K) is passed as (E * 2I, K), its scales flat)."""
    m, i = a.shape[0], b13.shape[-2] // 2
    # no groups (E = 0): every row is past offs[-1], all outputs zero, no launch (no weight for a TMA descriptor)
    h13 = (torch.zeros if groups == 0 else torch.empty)(m, 2 * i, dtype=out_dtype, device=a.device)
    out = dual_outputs(a, m, i, elem_dtype, emit_hp, groups)
    if h13.numel() and groups != 0:
        q, qs, qt, qts, hp = out
        kernel(a, b13.reshape(-1, b13.shape[-1]), a_scales.view(torch.uint8),
               b13_scales.view(torch.uint8).reshape(-1), h13, q, qs, qt, qts, hp_arg(hp), *extra)
    return (h13, *e8m0_outputs(*out))


def run_mm_dswiglu_quant(kernel: Callable, a, a_scales, b, b_scales, h13, elem_dtype, emit_hp: bool,
                         extra: tuple = (), groups: int | None = None):
    """``mm_dswiglu_quant``'s outputs from ``kernel`` (the dSwiGLU epilogue build, same arguments as above with the
    saved h13 read): dh13's dual cast."""
    m, i = a.shape[0], b.shape[-2]
    out = dual_outputs(a, m, 2 * i, elem_dtype, emit_hp, groups)
    if m and i and groups != 0:  # E = 0: zero outputs (dual_outputs zero-fills grouped outputs), no launch
        q, qs, qt, qts, hp = out
        kernel(a, b.reshape(-1, b.shape[-1]), a_scales.view(torch.uint8), b_scales.view(torch.uint8).reshape(-1),
               h13, q, qs, qt, qts, hp_arg(hp), *extra)
    return e8m0_outputs(*out)
