"""The ``sm90`` and ``sm100`` backends: the quantize ops implemented by CuTe DSL kernels (compiled through
:mod:`cute_mxfp8.jit`).

Both backends run the same arch-generic kernels, compiled for ``sm_90a`` or ``sm_100f`` (the Blackwell
datacenter family: compute capability 10.0 and 10.3).  Implemented:
``quantize_rowwise``, ``quantize_colwise`` and ``quantize_dual`` (one read of the input; ``quantize_gate_up`` is
one dual cast of W13: read from w1 and w3 with 128-blocks, else of a packed copy) for contiguous 2-D
activations and 3-D (E, N, K) expert weights with K % 32 == 0, plain or blocked scales, and token groups
(``offs``) on 2-D inputs: grouped-M blocked rowwise scales, grouped-K colwise blocks (2d-2d wgrad operands);
``swiglu_quant`` / ``dswiglu_quant`` (fused SwiGLU or its derivative + dual quantization, dense or grouped).
The ``sm100`` backend adds the dense GEMM ops on the tcgen05 kernel (:mod:`.gemm_sm100`: ``mm``,
``mm_swiglu_quant``, ``mm_dswiglu_quant``), which the SwiGLU MLP then uses fused; the ``sm90`` backend the WGMMA
kernels (:mod:`.gemm_sm90`): ``mm``, ``grouped_mm`` (2d-3d), ``grouped_mm_wgrad`` (2d-2d) and the fused
``mm_swiglu_quant`` / ``mm_dswiglu_quant``, dense and 2d-3d grouped, which the SwiGLU MLP and the grouped experts
use fused.
Other ops are not implemented by these backends yet: automatic selection passes over them (the reference runs),
and an explicit ``backend="sm90"`` for them raises with the reason (:class:`BackendUnavailableError`).
"""

from __future__ import annotations

import functools
import math

import torch

from .. import formats as F
from ..env import env_flag
from ..jit import SM100_TARGET, compile_quant, compile_swiglu_quant
from ..swiglu import pack_gate_up
from . import gemm_sm90, gemm_sm100
from .gemm_common import sm_count as _sm_count
from .backends import Backend, register_backend, same_op_plans
from .gate_up import GATE_UP_DIRECTIONS, pack_gate_up_casts
from .gemm_common import offs_limits
from .group_meta import check_offsets, derived_tensors, host_copy, validated_end
from .shapes import colwise_shapes, padded_tokens, rowwise_shapes

_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_IN = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# backend name -> (compute capabilities, compile target, the hardware it needs).  Arch-specific ("a") code loads
# only on its exact capability (sm_100a on 10.0, not on a B300's 10.3); family ("f") code on every member.
_ARCHS = {"sm90": (((9, 0),), "sm_90a", "an SM90 (H100/H200)"),
          "sm100": (((10, 0), (10, 3)), SM100_TARGET, "an SM100-family (B200/GB200, B300/GB300)")}
_MAX_ELEMENTS = 2**31 - 1  # shapes, block counts and scale offsets are 32-bit in the kernels (strides are 64-bit)
_MAX_K = 65535 * 128  # grid.y of the tile kernel counts 128-column tiles
_MAX_EXPERTS = 65535  # grid.z of the tile kernel


def _unavailable(name: str):
    caps, arch, hardware = _ARCHS[name]
    wanted = " or ".join(f"{major}.{minor}" for major, minor in caps)

    @functools.lru_cache(maxsize=None)
    def cached(device: torch.device) -> str | None:
        got = torch.cuda.get_device_capability(device)
        if tuple(got) not in caps:
            return f"needs {hardware} GPU (compute capability {wanted}, the {arch} build), found {got[0]}.{got[1]}"
        try:
            import cutlass  # noqa: F401
        except ImportError as e:  # the DSL is a dependency; say so if it is missing
            return f"nvidia-cutlass-dsl is not importable ({e}); pip install nvidia-cutlass-dsl"
        return None

    def reason(device: torch.device) -> str | None:
        """Checked on every op call, so the per-GPU answer is cached (capability and DSL do not change)."""
        if device.type != "cuda":
            return (f"needs {hardware} CUDA device (compute capability {wanted}, the {arch} build), got a "
                    f"{device.type} tensor")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cached(device)

    return reason


def _limits(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, token_align=0, blocks_2d=False):
    if not x.is_contiguous() or x.data_ptr() % 16:
        return "x must be contiguous with a 16-byte aligned data pointer (call .contiguous())"
    if x.shape[-1] % 32:
        return "the kernels need K % 32 == 0"
    if x.numel() > _MAX_ELEMENTS:
        return f"x has {x.numel()} elements; the kernels index with int32 (at most {_MAX_ELEMENTS}): split it"
    if x.shape[-1] > _MAX_K:
        return f"K = {x.shape[-1]} exceeds the kernels' grid limit ({_MAX_K})"
    if x.dim() == 3 and x.shape[0] > _MAX_EXPERTS:
        return f"E = {x.shape[0]} experts exceeds the kernels' grid limit ({_MAX_EXPERTS})"
    if x.dim() == 2 and _padded_rows(x.shape[0]) * x.shape[1] > _MAX_ELEMENTS:
        return "the colwise output (K, ceil(M / 32) * 32) would pass int32 indexing: split it"
    why = offs_limits(offs) or _token_align_limits(x.shape, offs, token_align)
    if why is not None:
        return why
    return _scale_limits(tuple(x.shape), blocked, None if offs is None else offs.numel(), token_align)


def _token_align_limits(shape, offs, token_align: int) -> str | None:
    """The padded colwise output of ``token_align`` (``shape`` the cast's (M, width)) must fit int32 indexing."""
    if token_align and offs is not None and padded_tokens(shape[0], offs.numel(), token_align) * shape[1] > \
            _MAX_ELEMENTS:
        return "the padded colwise output (width, 128 * (M // 128 + G)) would pass int32 indexing: split it"
    return None


def _padded_rows(m: int) -> int:
    return -(-m // 32) * 32


def _scale_limits(shape: tuple, blocked: bool, groups: int | None, token_align: int = 0) -> str | None:
    """Scale offsets are 32-bit in the kernels: the scale buffers (grouped layouts reserve M // 128 + G tiles, far
    more than x when groups are tiny) must stay below 2**31 bytes."""
    for shapes in (rowwise_shapes, _colwise_shapes(token_align)):
        numel = math.prod(shapes(shape, blocked, groups)[1])
        if numel > _MAX_ELEMENTS:
            return (f"the scale buffer would have {numel} bytes; the kernels address scales with int32 (at most "
                    f"{_MAX_ELEMENTS}): split the call or use fewer, larger token groups")
    return None


def _output_spec(shapes, shape: tuple, blocked, groups=None):
    """(data shape, scale shape, scale allocator) of a cast of a tensor of ``shape``.  The kernels write only real
    scales, so padding must read as zero: grouped layouts always have some; a blocked buffer has none when its rows
    fill whole 128-row tiles and its columns whole groups of 4."""
    dshape, sshape = shapes(shape, blocked, groups)
    rows, cols = dshape[-2], dshape[-1] // 32  # the scale matrix of data (..., R, C) is (R, C/32), either cast
    padded = groups is not None or (blocked and (rows % 128 or cols % 4))
    return dshape, sshape, (torch.zeros if padded else torch.empty)


def _outputs(shapes, x, elem_dtype, blocked, groups=None, shape=None):
    """New (data, scales) for a cast of ``x`` (or of a tensor of ``shape`` on ``x``'s device)."""
    dshape, sshape, alloc = _output_spec(shapes, tuple(x.shape) if shape is None else shape, blocked, groups)
    return torch.empty(dshape, dtype=elem_dtype, device=x.device), alloc(sshape, dtype=torch.uint8, device=x.device)


def _dual_specs(shape: tuple, blocked: bool, groups, token_align: int = 0) -> tuple:
    """The :func:`_output_spec` pair (rowwise, colwise) of a dual cast of a tensor of ``shape`` (rowwise scales
    grouped only when ``blocked``: plain rowwise scales do not depend on the groups)."""
    return (_output_spec(rowwise_shapes, shape, blocked, groups if blocked else None),
            _output_spec(_colwise_shapes(token_align), shape, blocked, groups))


def _alloc_outputs(specs: tuple, elem_dtype, device) -> tuple:
    """New (data, scales, ...) from :func:`_output_spec` triples (e.g. :func:`_dual_specs`' (q, s, qt, st)), as
    :func:`_outputs` calls make them, except that the scale buffers which must read zero in their padding are
    zeroed by one ``torch._foreach_zero_`` launch instead of one fill each (a grouped step makes four dual casts;
    each fill is a launch and a gap between kernels)."""
    outs, zero = [], []
    for dshape, sshape, alloc in specs:
        scales = torch.empty(sshape, dtype=torch.uint8, device=device)
        outs += [torch.empty(dshape, dtype=elem_dtype, device=device), scales]
        if alloc is torch.zeros and scales.numel():
            zero.append(scales)
    if zero:
        torch._foreach_zero_(zero)
    return tuple(outs)


def _dual_outputs(x, elem_dtype, blocked, groups, token_align: int = 0, shape=None) -> tuple:
    """New (q, s, qt, st) of a dual cast of ``x`` (or of a tensor of ``shape`` on ``x``'s device)."""
    shape = tuple(x.shape) if shape is None else shape
    return _alloc_outputs(_dual_specs(shape, blocked, groups, token_align), elem_dtype, x.device)


def _colwise_shapes(token_align: int):
    return functools.partial(colwise_shapes, token_align=token_align) if token_align else colwise_shapes


def _fill_unlaunched(offs, launch: bool, *outs) -> None:
    """Zero the outputs of a grouped cast that launches no kernel (no rows, no columns, or no groups: every row is
    past them); when a kernel runs it writes every byte itself, the tail past ``offs[-1]`` included."""
    if offs is not None and not launch:
        for t in outs:
            t.zero_()


def _batch(t: torch.Tensor, three_d: bool) -> torch.Tensor:
    """The tile kernel's 3-D view of a 2-D operand (E = 1): data (1, R, C), blocked scales (1, numel)."""
    return t if three_d else t.unsqueeze(0)


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tiny tensor for a kernel argument the build does not use (no groups, or the other cast's outputs); its
    shape meets the build's divisibility rules (fp8 data dims of 32)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def _unused_outputs(device: torch.device, elem_dtype: torch.dtype, blocked: bool) -> tuple:
    """(data, scales) placeholders for the tile kernel's output slots a build does not write (the other cast's)."""
    return (_placeholder(device, elem_dtype, (1, 32, 32)),
            _placeholder(device, torch.uint8, (1, 1) if blocked else (1, 1, 1)))


# the (data, scales) outputs of each cast direction, in the tile kernel's slot order (rowwise, then colwise)
_DIRECTION_SHAPES = {"dual": (rowwise_shapes, colwise_shapes), "rowwise": (rowwise_shapes,),
                     "colwise": (colwise_shapes,)}


def _tile_slots(direction: str, outs, three_d: bool, unused: tuple) -> tuple:
    """The tile kernel's four output slots (q, s, qt, st) for a planned ``direction`` cast: its outputs (batched
    views of 2-D ones, E = 1) and :func:`_unused_outputs` placeholders for the other direction's pair."""
    slots = tuple(_batch(t, three_d) for t in outs)
    return {"dual": slots, "rowwise": (*slots, *unused), "colwise": (*unused, *slots)}[direction]


def _group_args(device: torch.device, offs) -> tuple:
    """The tile kernels' (offs, tile_starts) arguments: the groups, or one placeholder for both without groups."""
    if offs is None:
        none = _placeholder(device, torch.int32, (1,))
        return none, none
    return offs, _tile_starts(offs)


def _tile_starts(offs):
    """:func:`~cute_mxfp8.formats.group_tile_starts` of ``offs``, once per offsets tensor."""
    return derived_tensors(offs, "tile_starts", F.group_tile_starts, F.group_tile_starts_host)


@functools.lru_cache(maxsize=None)
def _no_amax(device: torch.device) -> tuple:
    """The tile kernels' (amax_rows, amax_cols) arguments of a ``scale_block=32`` build (read by no thread)."""
    none = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    return none, none


def _amax_buffers(device: torch.device, shape: tuple, offs) -> tuple:
    """Zeroed int32 (amax_rows, amax_cols) of a two-launch ``scale_block=128`` tile cast (the SwiGLU kernels')
    whose output is (E,) M x K (``shape``; for the SwiGLU kernels the cast's (M, width)): (E, M, ceil(K/128)) and
    (E, ceil(row blocks / 4), K), row blocks the kernel's (virtual, with token groups) 32-row blocks."""
    *lead, m, k = shape
    e = lead[0] if lead else 1
    blocks = 4 * (m // 128 + offs.numel()) if offs is not None else -(-m // 32)
    rows, cols = (e, m, -(-k // 128)), (e, -(-blocks // 4), k)
    n_rows = math.prod(rows)
    split = -(-n_rows // 4) * 4  # the second buffer starts 16-byte aligned, as a fresh allocation would
    flat = torch.zeros(split + math.prod(cols), dtype=torch.int32, device=device)  # one fill launch for both
    return flat[:n_rows].view(rows), flat[split:].view(cols)


# the one-launch 128-block casts keep the CTA's run in registers between their two walks instead of reloading it
# from L2 (TileQuantKernel keep_run), keyed by (input dtype, token groups): for bf16 on the H200 (cast kernel time,
# tools/fast_mode_casts.py, 2026-12-03) 17-34 % less time for activations and 128 x 128 weight blocks without groups,
# 13 % with them (T=32768 D=2048 in 8 groups, token_align 128: 0.1026 vs 0.1184 ms); fp32 inputs were not measured
# and reload
TILE_KEEP_RUN = {(torch.bfloat16, False): True, (torch.bfloat16, True): True,
                 (torch.float32, False): False, (torch.float32, True): False}


# the tile and SwiGLU casts' fp8 stores as packed words, full 32-row blocks without per-row checks
# (TileQuantKernel packed_stores): 7-22 % fewer instructions on the sm_90a fall-through path (CPU, 2026-12-05); on
# the H200 (2026-12-06) every cast of tests/test_packed_stores.py wrote the default stores' bytes and the grouped
# SwiGLU casts (T=32768 I=1536 E=8, token_align 128, one launch) took 0.168 vs 0.177 ms forward, 0.253 vs 0.263 ms
# backward (tools/fast_mode_swiglu.py --only padded): on by default, CUTE_MXFP8_PACKED_STORES=0 turns them off
PACKED_STORES = env_flag("CUTE_MXFP8_PACKED_STORES", True)


def _keep_run(dtype: torch.dtype, scale_block: int, phase: str, grouped: bool) -> bool:
    return scale_block == 128 and phase == "cast" and TILE_KEEP_RUN[dtype, grouped]


# the SwiGLU kernels' 128-block casts of bf16 inputs in one launch (each CTA's 16 warps hold its 128-row run in
# registers and meet once over the 128-block amaxes), else in two (an amax pass through global buffers, then the
# casts; fp32 inputs: the resident build compiles without spills but was not measured, so they keep two)
SWIGLU_ONE_PASS = {torch.bfloat16: True, torch.float32: False}
# that one launch as a persistent loop on SM90 (one CTA per SM, each lane prefetching its next run's input into
# shared memory while the current run is cast), by (direction, token groups).  H200, 2026-12-03, kernel time over
# four runs: the dense forward takes 7-21 % less (M=16384 I=14336: 0.592-0.658 -> 0.550-0.572 ms; M=8192 I=8192:
# 0.175-0.194 -> 0.154-0.166); the dense backward takes 1.16x the time even without local memory (1.077 -> 1.248,
# 0.314 -> 0.365: it is compute-bound), and the grouped builds spill (1.04-1.30x), so those stay one CTA per run
# (tools/fast_mode_swiglu.py)
SWIGLU_PERSISTENT = {("fwd", False): True, ("fwd", True): False, ("bwd", False): False, ("bwd", True): False}


def _launch_swiglu(build, args: tuple, device: torch.device, shape: tuple, offs, scale_block: int,
                   dtype: torch.dtype, one_pass_ok: bool = True) -> None:
    """Run a SwiGLU tile kernel: ``build(scale_block, phase)`` -> the compiled kernel.  32-blocks, and 128-blocks
    of ``dtype`` inputs that :data:`SWIGLU_ONE_PASS` marks when ``one_pass_ok``: one ``"cast"`` launch; else the
    ``"amax"`` launch, then the ``"apply"`` launch, sharing zeroed buffers (:func:`_amax_buffers` of the cast's
    output ``shape``).  (The backward's one-pass CTA holds dg's and du's 128 columns: a 128-block along 2I that
    holds both, I % 128 != 0, needs the two-launch form.)"""
    if scale_block == 32 or (SWIGLU_ONE_PASS[dtype] and one_pass_ok):
        build(scale_block, "cast")(*args, *_no_amax(device))
        return
    amax = _amax_buffers(device, shape, offs)
    for phase in ("amax", "apply"):
        build(128, phase)(*args, *amax)


def _one_pass_shape(direction: str, width: int) -> bool:
    """Whether the one-launch 128-block SwiGLU cast takes a cast of ``width`` columns: the forward's (I) always;
    the backward's (2I) when I % 128 == 0, so that no 128-block along 2I holds both dg and du columns."""
    return direction == "fwd" or width % 256 == 0


def _one_pass_dtype(inputs) -> torch.dtype:
    """The dtype that picks the SwiGLU kernels' 128-block form (:data:`SWIGLU_ONE_PASS`): fp32 if any input is,
    else bf16."""
    return torch.float32 if any(t.dtype == torch.float32 for t in inputs) else inputs[0].dtype


def _e8m0(*ts):
    return tuple(t.view(torch.float8_e8m0fnu) if t.dtype == torch.uint8 else t for t in ts)


def _ops(arch: str) -> dict:
    def kernel(direction, x, scale_mode, elem_dtype, blocked, grouped=False, batched=False, scale_block=32,
               phase="cast", pad_groups=False, blocks_2d=False):
        return compile_quant(direction, _IN[x.dtype], _ELEM[elem_dtype], scale_mode, blocked, arch, False,
                             grouped, batched, scale_block, phase, pad_groups, blocks_2d,
                             _keep_run(x.dtype, scale_block, phase, grouped), packed_stores=PACKED_STORES)

    def tile(direction, x, scale_mode, elem_dtype, blocked, q, s, qt, st, offs=None, scale_block=32,
             token_align=0, blocks_2d=False):
        """Launch the tile kernel (colwise / dual / 3-D rowwise; every cast with ``scale_block=128``, in one
        launch); unused output slots take placeholders.  ``token_align`` 128: qt in the padded group layout,
        every column written by the kernel; ``blocks_2d``: 128 x 128 weight blocks (no groups)."""
        three_d = x.dim() == 3
        unused = _unused_outputs(x.device, elem_dtype, blocked)
        q, s, qt, st = (_batch(t, three_d) if t is not None else unused[i % 2] for i, t in enumerate((q, s, qt, st)))
        flags = (offs is not None, three_d and direction == "rowwise")
        kernel(direction, x, scale_mode, elem_dtype, blocked, *flags, scale_block, "cast", bool(token_align),
               blocks_2d)(
            _batch(x, three_d), q, s, qt, st, *_group_args(x.device, offs), *_no_amax(x.device))

    def rows_past_groups(x, scale_mode, elem_dtype, q, s, end, blocked, scale_block=32):
        """Rows at or past offs[-1] belong to no group: their rowwise data (and plain scales) still exist."""
        if end < x.shape[0]:
            tail_s = s[end:] if not blocked else torch.empty(x.shape[0] - end, x.shape[1] // 32,
                                                              dtype=torch.uint8, device=x.device)
            if scale_block == 32:
                kernel("rowwise", x, scale_mode, elem_dtype, False)(x[end:], q[end:], tail_s)
            else:
                tile("rowwise", x[end:], scale_mode, elem_dtype, False, q[end:], tail_s, None, None, None, 128)

    def quantize_rowwise(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, blocks_2d=False):
        grouped = offs is not None and blocked  # plain rowwise scales do not depend on the groups
        if offs is not None:  # validated either way, before anything compiles (a launcher checks again, cached)
            check_offsets(offs, x.shape[0])
        if grouped and scale_block == 128 and x.numel() and offs.numel():  # one launch: its tail CTAs cast the
            # rows past offs[-1]
            return _grouped_launcher(arch, "rowwise", x, scale_mode, elem_dtype, True, offs.shape[0], 128)(x, offs)
        q, s = _outputs(rowwise_shapes, x, elem_dtype, blocked, offs.shape[0] if grouped else None)
        if x.numel() == 0:
            return _e8m0(q, s)
        if x.dim() == 3 or (scale_block == 128 and not grouped):
            tile("rowwise", x, scale_mode, elem_dtype, blocked, q, s, None, None, None, scale_block, 0, blocks_2d)
        elif grouped and offs.numel() == 0:  # no groups: every row is past them
            rows_past_groups(x, scale_mode, elem_dtype, q, s, 0, True, scale_block)
        elif grouped and host_copy(offs) is None:  # offsets made on the device (no host copy): reading offs[-1]
            # would wait for the GPU; the dual tile kernel's tail CTAs cast the rows past the groups themselves (the
            # same rowwise bytes), its colwise output is dropped: 1 more byte written per element, no sync
            qt, st = _outputs(colwise_shapes, x, elem_dtype, True, offs.shape[0])
            tile("dual", x, scale_mode, elem_dtype, True, q, s, qt, st, offs, 32)
        elif grouped:  # this kernel leaves the rows past offs[-1] to a second launch: it needs offs[-1] on the host
            end = validated_end(offs, x.shape[0])
            if end > 0:
                kernel("rowwise", x, scale_mode, elem_dtype, True, True)(x, q, s, offs, _tile_starts(offs))
            rows_past_groups(x, scale_mode, elem_dtype, q, s, end, True, scale_block)
        else:
            kernel("rowwise", x, scale_mode, elem_dtype, blocked)(x, q, s)
        return _e8m0(q, s)

    def quantize_colwise(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, token_align=0,
                         blocks_2d=False):
        if offs is not None:
            check_offsets(offs, x.shape[0])
        if offs is not None and x.numel() and offs.numel():
            return _grouped_launcher(arch, "colwise", x, scale_mode, elem_dtype, blocked, offs.shape[0], scale_block,
                                     token_align)(x, offs)
        qt, st = _outputs(_colwise_shapes(token_align), x, elem_dtype, blocked,
                          None if offs is None else offs.shape[0])
        launch = x.numel() > 0 and (offs is None or offs.numel() > 0)
        _fill_unlaunched(offs, launch, qt)
        if launch:
            tile("colwise", x, scale_mode, elem_dtype, blocked, None, None, qt, st, offs, scale_block, token_align,
                 blocks_2d)
        return _e8m0(qt, st)

    def quantize_dual(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, token_align=0,
                      blocks_2d=False):
        g = None if offs is None else offs.shape[0]
        if offs is not None:
            check_offsets(offs, x.shape[0])
        if offs is not None and x.numel() and g:  # one launch: the kernel's tail CTAs cast the rows past offs[-1]
            return _grouped_launcher(arch, "dual", x, scale_mode, elem_dtype, blocked, g, scale_block,
                                     token_align)(x, offs)
        q, s, qt, st = _dual_outputs(x, elem_dtype, blocked, g, token_align)
        if offs is None:
            if x.numel():
                tile("dual", x, scale_mode, elem_dtype, blocked, q, s, qt, st, None, scale_block, 0, blocks_2d)
            return _e8m0(q, s, qt, st)
        _fill_unlaunched(offs, False, qt)
        if x.numel():  # no groups: every row is past them
            rows_past_groups(x, scale_mode, elem_dtype, q, s, 0, blocked, scale_block)
        return _e8m0(q, s, qt, st)

    def quantize_gate_up(w1, w3, scale_mode, elem_dtype, blocked, gate_up_tile=0, scale_block=32, blocks_2d=False,
                         direction="dual"):
        """With 128-blocks and no interleaving (I % 128 == 0 by the op's checks), one cast (``direction``) that
        reads w1 and w3 themselves (``compile_quant(..., gate_up=True)``: no packed copy); otherwise W13 packed in
        the input dtype (a temporary copy of both weights), then one cast of it (blocked scales written by the
        kernel).  The same bytes as casting w1 and w3 on their own and packing the casts (the reference): the op's
        checks make every colwise block along 2I hold features of one projection (I and the tile are multiples of
        the scale block), and rowwise blocks run along D.  The packed path's one copy and one cast replaced two
        casts and the packing of their four outputs, ~3x the launches and ~3.5x the host time (H200).  A W13 past
        the kernels' 32-bit indexing takes that older path (each projection fits and is cast in the asked
        direction only)."""
        run = _gate_up_launcher(arch, w1, scale_mode, elem_dtype, blocked, gate_up_tile, scale_block, blocks_2d,
                                direction)
        if run is not None:  # no packed copy: the kernel reads w1 and w3
            return run(w1, w3)
        tile = gate_up_tile or None
        if _packed_limits(w1, blocked) is not None:  # each projection cast in the asked direction only
            def cast(w):
                if direction == "rowwise":
                    return (*quantize_rowwise(w, scale_mode, elem_dtype, False, None, scale_block, blocks_2d), None,
                            None)
                if direction == "colwise":
                    return (None, None,
                            *quantize_colwise(w, scale_mode, elem_dtype, False, None, scale_block, 0, blocks_2d))
                return quantize_dual(w, scale_mode, elem_dtype, False, None, scale_block, 0, blocks_2d)
            return pack_gate_up_casts(cast(w1), cast(w3), blocked, tile)[GATE_UP_DIRECTIONS[direction]]
        packed = pack_gate_up(w1, w3, dim=-2, tile=tile)
        if direction == "rowwise":
            return quantize_rowwise(packed, scale_mode, elem_dtype, blocked, None, scale_block, blocks_2d)
        cast = quantize_colwise if direction == "colwise" else quantize_dual
        return cast(packed, scale_mode, elem_dtype, blocked, None, scale_block, 0, blocks_2d)

    return {"quantize_rowwise": quantize_rowwise, "quantize_colwise": quantize_colwise,
            "quantize_dual": quantize_dual, "quantize_gate_up": quantize_gate_up}


def _alloc(specs, elem_dtype: torch.dtype, device) -> list:
    """New [data, scales, ...] of a plan's outputs, from :func:`_output_spec` triples."""
    outs = []
    for dshape, sshape, alloc in specs:
        outs += [torch.empty(dshape, dtype=elem_dtype, device=device), alloc(sshape, dtype=torch.uint8, device=device)]
    return outs


def _gate_up_launcher(arch: str, w1, scale_mode, elem_dtype, blocked, gate_up_tile=0, scale_block=32,
                      blocks_2d=False, direction="dual"):
    """``run(w1, w3)``: the ``direction`` cast of W13 = [w1; w3] as one kernel that reads both (``compile_quant(...,
    gate_up=True)``: no packed copy), for weights shaped like ``w1`` with 128-blocks, no interleaving, I % 128 == 0
    and a W13 within the kernels' 32-bit indexing; None where ``quantize_gate_up`` casts another way.  The op's
    one-kernel case and its launch plan (:func:`_plans`) both run it."""
    if (gate_up_tile or scale_block != 128 or w1.dim() not in (2, 3) or w1.shape[-2] % 128 or w1.numel() == 0
            or _packed_limits(w1, blocked) is not None):
        return None
    three_d = w1.dim() == 3
    packed = (*w1.shape[:-2], 2 * w1.shape[-2], w1.shape[-1])
    fn = compile_quant(direction, _IN[w1.dtype], _ELEM[elem_dtype], scale_mode, blocked, arch, False, False, False,
                       128, "cast", False, blocks_2d, _keep_run(w1.dtype, 128, "cast", False), True,
                       packed_stores=PACKED_STORES)
    dev = w1.device
    specs = [_output_spec(sh, packed, blocked) for sh in _DIRECTION_SHAPES[direction]]
    fixed = (*_group_args(dev, None), *_no_amax(dev))
    unused = _unused_outputs(dev, elem_dtype, blocked)

    def run(w1, w3):
        outs = _alloc(specs, elem_dtype, dev)
        fn(_batch(w1, three_d), _batch(w3, three_d), *_tile_slots(direction, outs, three_d, unused), *fixed)
        return _e8m0(*outs)
    return run


def _grouped_launcher(arch: str, direction: str, x, scale_mode, elem_dtype, blocked, groups: int, scale_block,
                      token_align: int = 0):
    """``run(x, offs)``: the tile kernel's one-launch ``direction`` cast of a 2-D ``x`` (of this one's shape and
    dtype, on its device) in ``groups`` > 0 token groups, ``x`` not empty: ``offs`` checked
    (:func:`check_offsets`), the outputs allocated (padding that must read zero zeroed in one launch), the kernel
    run (its tail CTAs cast the rows past ``offs[-1]``).  ``direction``: ``"dual"``, ``"colwise"``, or
    ``"rowwise"`` with blocked 128-block scales (the grouped-M layout).  The ops' grouped one-launch casts and
    their launch plans (:func:`_plans`) both run it, so a plan gives the op's bytes."""
    m, shape, dev = x.shape[0], tuple(x.shape), x.device
    fn = compile_quant(direction, _IN[x.dtype], _ELEM[elem_dtype], scale_mode, blocked, arch, False, True, False,
                       scale_block, "cast", bool(token_align), False, _keep_run(x.dtype, scale_block, "cast", True),
                       packed_stores=PACKED_STORES)
    if direction == "dual":
        specs = _dual_specs(shape, blocked, groups, token_align)
    elif direction == "colwise":
        specs = (_output_spec(_colwise_shapes(token_align), shape, blocked, groups),)
    else:
        specs = (_output_spec(rowwise_shapes, shape, blocked, groups),)
    unused = _unused_outputs(dev, elem_dtype, blocked)
    amax = _no_amax(dev)

    def run(x, offs):
        check_offsets(offs, m)  # bad offsets raise ValueError (one host read, unless known to be safe)
        outs = _alloc_outputs(specs, elem_dtype, dev)
        fn(x.unsqueeze(0), *_tile_slots(direction, outs, False, unused), offs, _tile_starts(offs), *amax)
        return _e8m0(*outs)
    return run


def _plans(arch: str) -> dict:
    """Launch plans for the eager casts (:attr:`Backend.plans`): 2-D activations and 3-D weights, either scale block;
    token groups where the op casts them in one launch (dual and colwise casts; rowwise with blocked 128-block
    scales): the compiled kernel(s) and the output allocation, fixed once per (shape, dtypes, flags, the offsets'
    shape); the op's checks already passed for that key.  A grouped plan still checks each call's offsets
    (:func:`_grouped_launcher`).  The SwiGLU casts' plans: :func:`_swiglu_plans`."""
    e8m0 = torch.float8_e8m0fnu

    def rowwise(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, blocks_2d=False):
        if offs is not None or x.dim() == 3 or scale_block == 128:  # these run on the tile kernel (or no plan)
            return tiled_rowwise(x, scale_mode, elem_dtype, blocked, offs, scale_block, blocks_2d)
        if x.dim() != 2 or x.numel() == 0:
            return None
        fn = compile_quant("rowwise", _IN[x.dtype], _ELEM[elem_dtype], scale_mode, blocked, arch, False, False,
                           False)
        dshape, sshape, alloc = _output_spec(rowwise_shapes, tuple(x.shape), blocked)
        dev = x.device

        def run(x):
            q, s = torch.empty(dshape, dtype=elem_dtype, device=dev), alloc(sshape, dtype=torch.uint8, device=dev)
            fn(x, q, s)
            return q, s.view(e8m0)
        return run

    def tiled(direction):
        """The tile kernel's plan: 2-D (as E = 1) or 3-D input, one launch (either scale block)."""
        def plan(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, *tail):
            # tail: the op's remaining arguments as the library passes them (blocks_2d only when set): () or
            # (True,) rowwise, (token_align,) or (token_align, True) colwise / dual
            if direction == "rowwise":
                token_align, blocks_2d = 0, bool(tail and tail[0])
            else:
                token_align, blocks_2d = (tail[0] if tail else 0), len(tail) > 1 and bool(tail[1])
            if offs is not None:  # token groups: the one-launch grouped casts
                if (x.dim() != 2 or x.numel() == 0 or offs.numel() == 0 or blocks_2d
                        or (direction == "rowwise" and not (blocked and scale_block == 128))):
                    return None
                return _grouped_launcher(arch, direction, x, scale_mode, elem_dtype, blocked, offs.shape[0],
                                         scale_block, token_align)
            if x.dim() not in (2, 3) or x.numel() == 0 or token_align:
                return None
            three_d = x.dim() == 3
            fn = compile_quant(direction, _IN[x.dtype], _ELEM[elem_dtype], scale_mode, blocked, arch, False, False,
                               three_d and direction == "rowwise", scale_block, "cast", False, blocks_2d,
                               _keep_run(x.dtype, scale_block, "cast", False), packed_stores=PACKED_STORES)
            dev = x.device
            specs = [_output_spec(sh, tuple(x.shape), blocked) for sh in _DIRECTION_SHAPES[direction]]
            unused = _unused_outputs(dev, elem_dtype, blocked)
            fixed = (*_group_args(dev, None), *_no_amax(dev))

            def run(x):
                outs = _alloc(specs, elem_dtype, dev)
                fn(_batch(x, three_d), *_tile_slots(direction, outs, three_d, unused), *fixed)
                return _e8m0(*outs)
            return run
        return plan

    def gate_up(w1, w3, *args):
        return _gate_up_launcher(arch, w1, *args)

    tiled_rowwise = tiled("rowwise")
    return {"quantize_rowwise": rowwise, "quantize_colwise": tiled("colwise"), "quantize_dual": tiled("dual"),
            "quantize_gate_up": gate_up}


def _swiglu_limits(first, *rest):
    """Limits of the fused SwiGLU kernels: ``(h13, scale_mode, elem_dtype, blocked, emit_hp, offs, scale_block,
    token_align)`` forward, ``(dh, h13, ...)`` backward (the trailing arguments may be left at their defaults)."""
    backward = bool(rest) and isinstance(rest[0], torch.Tensor)
    tensors = [first, rest[0]] if backward else [first]
    tail = rest[1:] if backward else rest  # (scale_mode, elem_dtype, blocked, emit_hp, offs, scale_block, align)
    offs = tail[4] if len(tail) > 4 else None
    token_align = tail[6] if len(tail) > 6 else 0
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() % 16:
            return "inputs must be contiguous with 16-byte aligned data pointers (call .contiguous())"
        if t.numel() > _MAX_ELEMENTS:
            return f"{t.numel()} elements; the kernels index with int32 (at most {_MAX_ELEMENTS}): split it"
    why = offs_limits(offs)
    if why is not None:
        return why
    if first.shape[-1] > _MAX_K:
        return f"width {first.shape[-1]} exceeds the kernels' grid limit ({_MAX_K})"
    width = 2 * first.shape[-1] if backward else first.shape[-1] // 2  # the cast's K: 2I backward, I forward
    if _padded_rows(first.shape[0]) * width > _MAX_ELEMENTS:
        return "the colwise output (width, ceil(M / 32) * 32) would pass int32 indexing: split it"
    why = _token_align_limits((first.shape[0], width), offs, token_align)
    if why is not None:
        return why
    return _scale_limits((first.shape[0], width), True, None if offs is None else offs.numel(), token_align)


def _swiglu_launcher(arch: str, direction: str, inputs: tuple, scale_mode, elem_dtype, blocked, emit_hp, groups,
                     scale_block, token_align):
    """``run(*inputs, offs)``: ``swiglu_quant`` (``direction="fwd"``, inputs ``(h13,)``) or ``dswiglu_quant``
    (``"bwd"``, ``(dh, h13)``) on the fused kernel (:class:`SwiGLUQuantKernel`) for inputs of these shapes and
    dtypes on their device, ``groups`` token groups (None: no ``offs``): ``offs`` checked, the outputs allocated,
    the kernel(s) run.  The ops and their launch plans (:func:`_swiglu_plans`) both run it (inputs already checked
    by the op)."""
    m, dev = inputs[0].shape[0], inputs[0].device
    in_dtype, h13_dtype = inputs[0].dtype, inputs[-1].dtype  # (the launcher keeps no input tensor alive)
    width = inputs[-1].shape[1] // 2 if direction == "fwd" else inputs[-1].shape[1]  # the cast's K: I fwd, 2I bwd
    specs = _dual_specs((m, width), blocked, groups, token_align)
    hp_shape = (m, width) if emit_hp else (0,)
    # I == 0: nothing to compute (and no grid to launch); no groups: every row is past them, all zeros; else the
    # kernel's tail CTAs zero the rows past offs[-1] (activation, data, plain scales)
    launch = m > 0 and width > 0 and groups != 0
    grouped = groups is not None

    def build(sb, phase):  # the compiled kernel of a (scale block, phase), looked up per launch (so the module's
        # switches, SWIGLU_ONE_PASS and SWIGLU_PERSISTENT, hold for plans made before a change too)
        return compile_swiglu_quant(
            direction, _IN[in_dtype], _ELEM[elem_dtype], scale_mode, blocked, arch, False, grouped, emit_hp, sb,
            phase, _IN[h13_dtype], bool(token_align),
            _sm_count(dev) if sb == 128 and phase == "cast" and arch == "sm_90a"
            and SWIGLU_PERSISTENT[direction, grouped] else 0, packed_stores=PACKED_STORES)

    one_pass = (_one_pass_dtype(inputs), _one_pass_shape(direction, width))

    def run(*args):
        *ins, offs = args
        if offs is not None:
            check_offsets(offs, m)  # bad offsets raise ValueError (one host read, unless known to be safe)
        q, s, qt, st = _alloc_outputs(specs, elem_dtype, dev)
        hp = torch.empty(hp_shape, dtype=in_dtype, device=dev)
        _fill_unlaunched(offs, launch, q, qt, hp, *(() if blocked else (s,)))
        if launch:
            hp_arg = hp.unsqueeze(0) if emit_hp else _placeholder(dev, in_dtype, (1, 32, 32))
            kargs = (*(t.unsqueeze(0) for t in ins), q.unsqueeze(0), _batch(s, False), qt.unsqueeze(0),
                     _batch(st, False), hp_arg, *_group_args(dev, offs))
            _launch_swiglu(build, kargs, dev, (m, width), offs, scale_block, *one_pass)
        return (*_e8m0(q, s, qt, st), hp)
    return run


def _swiglu_plans(arch: str) -> dict:
    """Launch plans of ``swiglu_quant`` / ``dswiglu_quant`` (:attr:`Backend.plans`): :func:`_swiglu_launcher` made
    once per key (the op's arguments but the tensors' values), called as ``run(h13, offs)`` /
    ``run(dh, h13, offs)``."""

    def swiglu_quant(h13, scale_mode, elem_dtype, blocked, emit_hp, offs=None, scale_block=32, token_align=0):
        return _swiglu_launcher(arch, "fwd", (h13,), scale_mode, elem_dtype, blocked, emit_hp,
                                None if offs is None else offs.shape[0], scale_block, token_align)

    def dswiglu_quant(dh, h13, scale_mode, elem_dtype, blocked, emit_hp, offs=None, scale_block=32, token_align=0):
        return _swiglu_launcher(arch, "bwd", (dh, h13), scale_mode, elem_dtype, blocked, emit_hp,
                                None if offs is None else offs.shape[0], scale_block, token_align)

    return {"swiglu_quant": swiglu_quant, "dswiglu_quant": dswiglu_quant}


def _swiglu_ops(arch: str) -> dict:
    """``swiglu_quant`` / ``dswiglu_quant`` on the fused kernel, same signature and outputs as the reference
    implementations (inputs already checked by the op): the plan's launcher (:func:`_swiglu_plans`), made and run
    once."""
    plans = _swiglu_plans(arch)

    def swiglu_quant(h13, scale_mode, elem_dtype, blocked, emit_hp, offs=None, scale_block=32, token_align=0):
        return plans["swiglu_quant"](h13, scale_mode, elem_dtype, blocked, emit_hp, offs, scale_block,
                                     token_align)(h13, offs)

    def dswiglu_quant(dh, h13, scale_mode, elem_dtype, blocked, emit_hp, offs=None, scale_block=32, token_align=0):
        return plans["dswiglu_quant"](dh, h13, scale_mode, elem_dtype, blocked, emit_hp, offs, scale_block,
                                      token_align)(dh, h13, offs)

    return {"swiglu_quant": swiglu_quant, "dswiglu_quant": dswiglu_quant}


def _rowwise_limits(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, blocks_2d=False):
    return _limits(x, scale_mode, elem_dtype, blocked, offs, scale_block)


def _gate_up_limits(w1, w3, scale_mode, elem_dtype, blocked, gate_up_tile=0, scale_block=32, blocks_2d=False,
                    direction="dual"):
    return _limits(w1, scale_mode, elem_dtype, False) or _limits(w3, scale_mode, elem_dtype, False)


def _packed_limits(w1, blocked: bool) -> str | None:
    """Why the packed W13 of ``w1``'s shape cannot be cast in one launch (32-bit indexing), or None."""
    packed = (*w1.shape[:-2], 2 * w1.shape[-2], w1.shape[-1])
    if math.prod(packed) > _MAX_ELEMENTS:
        return f"W13 {packed} has more than {_MAX_ELEMENTS} elements"
    return _scale_limits(packed, blocked, None)


_QUANT_LIMITS = {"quantize_rowwise": _rowwise_limits, "quantize_colwise": _limits, "quantize_dual": _limits,
                 "quantize_gate_up": _gate_up_limits}
_SWIGLU_LIMITS = {"swiglu_quant": _swiglu_limits, "dswiglu_quant": _swiglu_limits}

# the dense GEMM per arch: tcgen05 (with the fused SwiGLU epilogues) on SM100, WGMMA (plain mm) on SM90
_GEMMS = {"sm90": gemm_sm90, "sm100": gemm_sm100}

for _name, (_, _arch, _) in _ARCHS.items():
    _gemm = _GEMMS[_name]
    register_backend(Backend(
        name=_name,
        priority=10,
        unavailable_reason=_unavailable(_name),
        ops={**_ops(_arch), **_swiglu_ops(_arch), **_gemm.OPS},
        plans={**_plans(_arch), **_swiglu_plans(_arch),
               **same_op_plans(_gemm.OPS, ("mm", "grouped_mm", "grouped_mm_wgrad"))},
        limits={**_QUANT_LIMITS, **_SWIGLU_LIMITS, **_gemm.LIMITS},
        fuses_mlp="mm_swiglu_quant" in _gemm.OPS,
        fuses_grouped_mlp="mm_swiglu_quant" in _gemm.OPS and getattr(_gemm, "FUSED_GROUPED", False),
    ))
