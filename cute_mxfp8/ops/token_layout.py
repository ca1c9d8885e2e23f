"""The group-aligned token layout of the 2d-2d (wgrad) GEMM operands, shared by the SM90 and SM100 ops.

A token-major 2d-2d operand (R, T) holds each row's tokens contiguously, token groups back to back (``offs``).
TMA takes only 16-byte aligned inner coordinates, so the wgrad kernels read a copy (R, T') in which every group
starts on a column that is a multiple of ``align`` and the columns after a group's last token, up to the next
start, are zero (the gather kernel :mod:`cute_mxfp8.kernels.token_align`).  SM90 uses ``align`` 16 (its kernel
masks the bytes past a group's end in registers); SM100 uses 32, so every MX block of a group holds only its
tokens and zeros (its MMAs read shared memory directly).  All tensors here are computed with torch on ``offs``'s
device (no host sync; or from a host copy of the offsets that an earlier op read, uploaded without a sync) and,
per offsets tensor, once (:func:`.group_meta.derived_tensors`).
"""

from __future__ import annotations

import torch

from .. import formats as F
from ..jit import compile_fast_schedules, compile_token_align
from .gemm_common import MAX_ELEMENTS, device_offsets_host, offs_limits, operand_limits, safe_offsets
from .shapes import padded_tokens
from .group_meta import derived, derived_tensors, host_list, known_host_copy, recorded, safe_bound


def group_columns(offs: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sizes int64, starts int32, ends int32) of the groups in the ``align``-aligned layout, on the device."""
    o = offs.to(torch.int64)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    padded = (sizes + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    return sizes, (ends - padded).to(torch.int32), ends.to(torch.int32)


def group_columns_host(offs: list[int], align: int) -> tuple[list[int], list[int]]:
    """(starts, ends) of :func:`group_columns` for sanitized offsets given as Python ints (no torch op)."""
    ends = [align * n for n in F.group_units_host(offs, align)]
    return ([0] + ends)[:-1], ends


def aligned_width(t: int, g: int, align: int) -> int:
    """Columns of the ``align``-aligned layout of T tokens in G groups: ceil(T / align) * align + align * G (a
    bound on the padded sizes, so it is known without reading ``offs``)."""
    return (t + align - 1) // align * align + align * g


def aligned_token_layout(offs: torch.Tensor, t: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch statement of the map the gather kernel applies (its tests' reference).  Returns (``src`` int64
    (T',): the source token of each of the T' = :func:`aligned_width` columns (clamped into [0, T); the columns
    between groups are written as zeros by the kernel and never read as tokens), ``starts`` int32 (G,): each
    group's first column).  Needs T > 0 and G > 0 (the ops return zeros before calling it otherwise)."""
    g = offs.numel()
    sizes, starts, ends = group_columns(offs, align)
    p = torch.arange(aligned_width(t, g, align), device=offs.device)
    grp = torch.searchsorted(ends.to(torch.int64), p, right=True).clamp_(max=g - 1)
    src = (offs.to(torch.int64)[grp] - sizes[grp] + p - starts[grp]).clamp_(0, max(t - 1, 0))
    return src, starts


def schedule_k(offs: torch.Tensor, t: int, align: int):
    """(safe offs, aligned group ends, (2, G) int32 schedule) of a 2d-2d launch over T = ``t`` tokens, once per
    offsets tensor: row 0 the groups' first columns in the aligned layout, row 1 their first grouped-K scale
    tiles (``formats.group_tile_starts``); from the host copy of ``offs`` where one is known
    (:func:`.group_meta.derived_tensors`)."""
    def on_device(o):
        safe = safe_offsets(offs, t)
        _, starts, ends = group_columns(safe, align)
        return ends, torch.stack([starts, F.group_tile_starts(safe)])

    def on_host(o):
        safe = device_offsets_host(o, t)
        starts, ends = group_columns_host(safe, align)
        return ends, [starts, F.group_tile_starts_host(safe)]

    return (safe_offsets(offs, t), *derived_tensors(offs, "schedule_k", on_device, on_host, t, align))


def aligned_operands(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, ends: torch.Tensor, t: int, align: int,
                     arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a2, b2): the two token-major operands in the aligned group layout (the gather kernel built for ``arch``);
    ``offs`` and ``ends`` as :func:`schedule_k` returns them."""
    fn = compile_token_align(arch)
    out = []
    for x in (a, b):
        x2 = torch.empty(x.shape[0], aligned_width(t, offs.numel(), align), dtype=torch.uint8, device=x.device)
        fn(x.view(torch.uint8), x2, offs, ends)
        out.append(x2.view(x.dtype))
    return out[0], out[1]


def padded_offsets(offs: torch.Tensor, align: int = 128) -> torch.Tensor:
    """:func:`cute_mxfp8.formats.padded_group_offsets` of ``offs`` (the offsets of operands cast with
    ``token_align``), once per offsets tensor.  Where the host values of ``offs`` are known (the grouped casts
    read them), the result is computed from them, uploaded without a sync and its host copy recorded, so the
    wgrad sees that its groups are already aligned and skips the gather (:func:`run_wgrad`)."""
    def compute():
        host = host_list(offs) if offs.device.type == "cuda" else None
        if host is None:
            out = F.padded_group_offsets(offs, align)
            if safe_bound(offs) is not None:  # valid offsets: the padded groups are aligned by construction
                derived(out, "aligned to", lambda: align)
            return out
        ends = torch.tensor(group_columns_host(host, align)[1], dtype=torch.int32)
        out = ends.pin_memory().to(offs.device, non_blocking=True)
        known_host_copy(out, ends)
        return out

    return derived(offs, "padded offsets", compute, align)


def _groups_aligned(offs: torch.Tensor, t: int, align: int) -> bool:
    """Whether operands of ``t`` tokens with groups ``offs`` already are in the ``align``-aligned layout (every
    group size and ``t`` multiples of ``align``), decided from the host copy of ``offs`` (False when none is
    known: no device read)."""
    if t % align:
        return False
    made = recorded(offs, "aligned to")  # padded_offsets of offsets vouched for on the device (no host values)
    if made is not None and made % align == 0:
        return True
    host = host_list(offs)  # (not cached as "unknown": a later host read may still decide it)
    if host is None:
        return False

    def compute():
        safe = device_offsets_host(host, t)
        return all((e - s) % align == 0 for s, e in zip([0] + safe[:-1], safe))

    return bool(derived(offs, "groups aligned", compute, t, align))


def run_wgrad(build, a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
              offs: torch.Tensor, out_dtype: torch.dtype, align: int, arch: str) -> torch.Tensor:
    """A 2d-2d (wgrad) launch, both archs: ``out[g] = a[:, tokens of g] · b[:, tokens of g]ᵀ`` (G, N, K) from
    token-major ``a`` (N, T), ``b`` (K, T); zeros without a launch for T = 0 or G = 0; else both operands gathered
    into the ``align``-aligned layout (no copy where the groups already are aligned: :func:`_groups_aligned`) and
    ``build()(a2, b2, a_scales, b_scales, out (G N, K), offs, schedule)``
    (``build`` returns the compiled kernel: nothing is compiled for an empty call) with the sanitized offsets and
    :func:`schedule_k`'s schedule."""
    (n, t), k = a.shape, b.shape[0]
    g = offs.shape[0]
    if t == 0 or g == 0:
        return torch.zeros(g, n, k, dtype=out_dtype, device=a.device)
    d = torch.empty(g, n, k, dtype=out_dtype, device=a.device)
    if d.numel():
        aligned = _groups_aligned(offs, t, align)
        offs, ends, sched = schedule_k(offs, t, align)
        a2, b2 = (a, b) if aligned else aligned_operands(a, b, offs, ends, t, align, arch)
        build()(a2, b2, a_scales.view(torch.uint8), b_scales.view(torch.uint8), d.view(g * n, k), offs, sched)
    return d


def split_halves(d: torch.Tensor) -> torch.Tensor:
    """A 2d-2d output (G, N, K) as ``grouped_mm_wgrad(..., split_halves=True)`` returns it: (2, G, N / 2, K), every
    group's first N / 2 rows, then the others, one copy (for the kernels that do not write that layout)."""
    g, n, k = d.shape
    return d.view(g, 2, n // 2, k).transpose(0, 1).contiguous()


def wgrad_limits(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                 offs: torch.Tensor, align: int) -> str | None:
    """What both archs' 2d-2d kernels need (None: they take the call): kernel-readable offsets; for a launching
    call (T > 0 and G > 0) aligned contiguous operands; 32-bit indexing of the ``align``-aligned operands and of
    the (G, N, K) output."""
    (n, t), k, g = a.shape, b.shape[0], offs.shape[0]
    why = offs_limits(offs)
    if why is None and t and g:  # T = 0 or G = 0: the op returns zeros without a launch
        why = operand_limits(a, a_scales, b, b_scales)
    if why is None and max(n, k) * aligned_width(t, g, align) > MAX_ELEMENTS:
        return f"the group-aligned operands would exceed {MAX_ELEMENTS} elements; the kernel indexes with int32"
    if why is None and g * n * k > MAX_ELEMENTS:
        return f"the output would have {g * n * k} elements; the kernel indexes with int32: split the groups"
    return why


def prime_fast_schedules(offs: torch.Tensor, t: int, arch: str | None = None) -> None:
    """Compute every per-offsets tensor a grouped MLP step in the Hopper fast mode takes from offsets ``offs`` over
    ``t`` tokens that :func:`~.group_meta.mark_safe` vouched for, and record them under the keys their users look
    up (:func:`~.group_meta.derived`): the casts' group tile starts, the 2d-3d schedule in 128-row tiles
    (:func:`~.gemm_common.schedule_m`), the padded offsets of the ``token_align=128`` operands
    (:func:`padded_offsets`) and, on those, the 2d-2d schedule (:func:`schedule_k`) and the mark that they are
    aligned.  Computed one by one on the device they were ~60 small torch launches per step (the host copy that
    made them cheap is what the sync-free module does not have); here about fifteen, or with ``arch`` (contiguous
    int32 CUDA offsets, what the grouped module makes; the sm90 backend passes ``"sm_90a"``) one launch of
    :class:`~cute_mxfp8.kernels.group_schedule.FastScheduleKernel` built for it.  The values are those the lazy
    functions compute, either way (``tests/test_group_meta.py``, on the GPU for the kernel); anything else stays
    lazy.  No-op for offsets without the mark for ``t`` rows, or no groups.  The fast mode's grouped SwiGLU MLP
    calls it on its offsets, so every caller of :func:`~.autograd.mxfp8_swiglu_mlp` with such offsets (the grouped
    module, the torchtitan experts) gets it."""
    g = offs.numel()
    bound = safe_bound(offs)
    if g == 0 or bound is None or bound != t:
        return
    if arch is not None and offs.is_cuda and offs.dtype == torch.int32 and offs.is_contiguous():
        views = _schedule_views(torch.empty(_schedule_len(g), dtype=torch.int32, device=offs.device), g)
        compile_fast_schedules(arch)(offs, *views)
        _record_fast_schedules(offs, t, views)
        return
    o = offs.to(torch.int64)
    units = torch.diff(o, prepend=o.new_zeros(1)).add_(127).div_(128, rounding_mode="floor")  # ceil(size / 128)
    incl = units.cumsum(0)  # 128-row tiles (or padded 128-token units) up to each group's end
    starts = incl - units  # formats.group_tile_starts: each group's first tile
    padded = incl * 128  # formats.padded_group_offsets(offs, 128)
    entries = [(starts,), (incl, starts), (padded,), (padded - units * 128, starts)]
    # one int32 buffer; each entry contiguous and from a 16-byte aligned element, as group_meta's uploads
    zeros = o.new_zeros(3)
    flat = torch.cat([p for rows in entries for p in (*rows, zeros[:(-len(rows) * g) % 4])]).to(torch.int32)
    _record_fast_schedules(offs, t, _schedule_views(flat, g))


_SCHEDULE_ROWS = (1, 2, 1, 2)  # rows of prime_fast_schedules' entries: tile starts, schedule_m, ends, schedule_k


def _schedule_len(g: int) -> int:
    """Elements of :func:`prime_fast_schedules`' buffer for ``g`` groups (each entry padded to 4 elements)."""
    return sum(r * g + -(r * g) % 4 for r in _SCHEDULE_ROWS)


def _schedule_views(flat: torch.Tensor, g: int) -> list:
    """The four entries of :func:`prime_fast_schedules`' buffer, each from a 16-byte aligned element: tile
    starts (G,), the 2d-3d schedule (2, G), the padded offsets (G,), the 2d-2d schedule (2, G)."""
    views, at = [], 0
    for rows in _SCHEDULE_ROWS:
        n = rows * g
        views.append(flat[at:at + n].view(rows, g) if rows > 1 else flat[at:at + n])
        at += n + -n % 4
    return views


def _record_fast_schedules(offs: torch.Tensor, t: int, views: list) -> None:
    """Record :func:`prime_fast_schedules`' four entries (tile starts, 2d-3d schedule, padded offsets, 2d-2d
    schedule: views of one buffer) under their users' keys."""
    ts, sched_m, ends, sched_k = views
    tp = padded_tokens(t, offs.numel(), 128)  # the token_align operands' width
    # an entry never holds the tensor it is keyed on (that would keep it alive in the global cache): detach()
    # shares its storage without being a view of it
    derived(offs, "device_offsets", lambda: offs.detach(), t)  # safe already: device_offsets' values
    derived(offs, "tile_starts", lambda: ts)
    derived(offs, "schedule_m", lambda: sched_m, t, 128)
    derived(offs, "padded offsets", lambda: ends, 128)
    derived(ends, "aligned to", lambda: 128)
    derived(ends, "device_offsets", lambda: ends.detach(), tp)
    derived(ends, "schedule_k", lambda: (ends.detach(), sched_k), tp, 128)
