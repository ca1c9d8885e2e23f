"""Input checks and exact output shapes of every op, shared by the fake (meta) impls and the real ones.

All outputs of all ops are contiguous, so a shape fully determines the strides.  Every check here looks at
metadata only (no device sync), so it runs at trace time under torch.compile too; value checks on ``offs`` are
done by the real impls (:func:`cute_mxfp8.formats.validate_offsets`).
"""

from __future__ import annotations

import torch

from ..formats import (BLOCK_SIZE, ELEM_DTYPES, SCALE_MODES, blocked_scales_numel, check_scale_block,
                       grouped_scale_tiles)
from ..swiglu import GATE_UP_TILE

_HP_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_quant_args(scale_mode: str, elem_dtype: torch.dtype, scale_block: int = 32) -> None:
    check_scale_block(scale_block)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if elem_dtype not in ELEM_DTYPES:
        raise ValueError(f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype}")


def check_blocks_2d(blocks_2d, scale_block: int, offs=None, token_align: int = 0) -> None:
    """``blocks_2d`` (a bool) is a weight layout of the fast mode: 128 x 128 tiles sharing a scale, so it needs
    ``scale_block=128`` and no token groups."""
    if type(blocks_2d) is not bool:
        raise TypeError(f"blocks_2d must be a bool, got {type(blocks_2d).__name__}")
    if blocks_2d and (scale_block != 128 or offs is not None or token_align):
        raise ValueError(f"blocks_2d=True (128 x 128 weight blocks) needs scale_block=128 and no offs / token_align, "
                         f"got scale_block={scale_block!r}, offs {'given' if offs is not None else 'None'}, "
                         f"token_align={token_align!r}")


def check_b_blocks_2d(b_blocks_2d, scale_block: int) -> None:
    """A GEMM's ``b_blocks_2d`` (a bool) states B's 128 x 128 blocks: only with ``scale_block=128``."""
    if type(b_blocks_2d) is not bool:
        raise TypeError(f"b_blocks_2d must be a bool, got {type(b_blocks_2d).__name__}")
    if b_blocks_2d and scale_block != 128:
        raise ValueError(f"b_blocks_2d (a bool) states that b was quantized with scale_block=128, blocks_2d=True; it "
                         f"needs scale_block=128, got b_blocks_2d={b_blocks_2d!r} with scale_block={scale_block!r}")


def check_hp(name: str, x: torch.Tensor, ranks=(2,)) -> None:
    if x.dtype not in _HP_DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float32, got {x.dtype}; cast it with .to(torch.bfloat16)")
    if x.dim() not in ranks:
        raise ValueError(f"{name} must have rank {' or '.join(map(str, ranks))}, got shape {tuple(x.shape)}")


def check_mult32(what: str, n: int) -> None:
    if n % BLOCK_SIZE != 0:
        raise ValueError(f"{what} = {n} must be a multiple of the MX block size {BLOCK_SIZE} (pad it with zeros)")


def mxfp8_dims_reason(**dims: int) -> str | None:
    """None if every named dim is a multiple of 32, else a sentence naming the offending dims and the rule."""
    bad = {k: v for k, v in dims.items() if v % BLOCK_SIZE != 0}
    if not bad:
        return None
    got = ", ".join(f"{k}={v}" for k, v in bad.items())
    return f"{got} not a multiple of the MX block size {BLOCK_SIZE} (every GEMM dim of an MXFP8 layer must be)"


def fast_mode_hidden_reason(hopper_block_k: int, hidden_dim: int) -> str | None:
    """None unless the Hopper fast mode (``MXFP8Config(hopper_block_k=128)``) cannot run a SwiGLU MLP / experts
    block of hidden size ``hidden_dim`` (W13's 128-blocks along 2I must hold one projection's features)."""
    if hopper_block_k == 128 and hidden_dim % 128:
        return (f"hidden_dim I = {hidden_dim} is not a multiple of 128, which hopper_block_k=128 needs for a SwiGLU "
                f"MLP (W13's 128-element blocks along 2I must not mix gate and up features)")
    return None


def fused_hidden_reason(fused_epilogues, hidden_dim: int) -> str | None:
    """None unless ``MXFP8Config(fused_epilogues=...)`` cannot run a SwiGLU MLP / experts block of hidden size
    ``hidden_dim``: ``True`` needs I % 64 == 0 (W13 and h13 in the interleaved gate/up runs of ``GATE_UP_TILE``)."""
    if fused_epilogues and hidden_dim % GATE_UP_TILE:
        return (f"hidden_dim I = {hidden_dim} is not a multiple of {GATE_UP_TILE}, which fused_epilogues=True needs "
                f"(I % {GATE_UP_TILE} == 0: the interleaved gate/up layout)")
    return None


def mlp_hidden_reason(config, hidden_dim: int) -> str | None:
    """None unless ``config`` (an :class:`~cute_mxfp8.MXFP8Config`) cannot run a SwiGLU MLP / experts block of
    hidden size ``hidden_dim`` on any backend (:func:`fast_mode_hidden_reason`, :func:`fused_hidden_reason`); the
    reason ends with the fix."""
    reason = fast_mode_hidden_reason(config.hopper_block_k, hidden_dim)
    if reason is not None:
        return f"{reason}; pad the hidden dim to a multiple of 128 or use hopper_block_k=32"
    reason = fused_hidden_reason(config.fused_epilogues, hidden_dim)
    if reason is not None:
        return (f"{reason}; pad the hidden dim to a multiple of {GATE_UP_TILE} or pass fused_epilogues=None (fused "
                f"where the hidden dim allows)")
    return None


def check_offs(offs: torch.Tensor | None, device: torch.device, num_groups: int | None = None) -> None:
    if offs is None:
        return
    if offs.dtype != torch.int32 or offs.dim() != 1:
        fix = ("; convert with offs.to(torch.int32)" if offs.dim() == 1 and not offs.dtype.is_floating_point
               and not offs.dtype.is_complex and offs.dtype != torch.bool else "")
        raise ValueError(f"offs must be a 1-D torch.int32 tensor of cumulative group END offsets, "
                         f"got {offs.dtype} of shape {tuple(offs.shape)}{fix}")
    if offs.device != device:
        raise ValueError(f"offs is on {offs.device} but the data is on {device}; move offs to the same device")
    if num_groups is not None and offs.shape[0] != num_groups:
        raise ValueError(f"offs has {offs.shape[0]} group{'s' * (offs.shape[0] != 1)} but the weights have "
                         f"{num_groups} expert{'s' * (num_groups != 1)}: one END offset per expert")


def check_fp8(name: str, t: torch.Tensor, shape: tuple) -> None:
    if t.dtype not in ELEM_DTYPES:
        raise ValueError(f"{name} must be float8_e4m3fn or float8_e5m2 MXFP8 data, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_scales(name: str, s: torch.Tensor, shape: tuple, source: str | None = None) -> None:
    if s.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"{name} must be torch.float8_e8m0fnu E8M0 scales, got {s.dtype}")
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(s.shape)}, expected {tuple(shape)} "
                         f"(blocked scales as returned by the quantize ops with blocked=True"
                         f"{'; for ' + source if source else ''})")


def check_same_device(*ts: torch.Tensor) -> None:
    devs = {t.device for t in ts if t is not None}
    if len(devs) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}; "
                         "move them with .to(device)")


def check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


# ---- quantize -------------------------------------------------------------------------------------------

def grouped_m_scales_numel(m: int, g: int, kb: int) -> int:
    """Bytes of a grouped-M blocked scale buffer: grouped_scale_tiles(m, g) tiles of 128 rows x ceil4(kb)."""
    return grouped_scale_tiles(m, g) * 128 * ceil_div(kb, 4) * 4


def rowwise_shapes(x_shape, blocked: bool, g: int | None):
    """(data shape, scales shape) of rowwise quantization (blocks along the last dim)."""
    *lead, k = x_shape
    kb = k // BLOCK_SIZE
    if len(x_shape) == 3:
        e, n, _ = x_shape
        return (e, n, k), ((e, blocked_scales_numel(n, kb)) if blocked else (e, n, kb))
    m = lead[0]
    if not blocked:
        return (m, k), (m, kb)
    if g is None:
        return (m, k), (blocked_scales_numel(m, kb),)
    return (m, k), (grouped_m_scales_numel(m, g, kb),)


TOKEN_ALIGNS = (0, 128)


def check_token_align(token_align, offs) -> None:
    """``token_align``: 0 (token groups back to back) or 128 (each group's colwise data padded with zeros to a
    multiple of 128 tokens, :func:`cute_mxfp8.formats.pad_token_groups`); 128 needs token groups."""
    if type(token_align) is not int or token_align not in TOKEN_ALIGNS:
        raise ValueError(f"token_align must be 0 or 128, got {token_align!r}")
    if token_align and offs is None:
        raise ValueError("token_align=128 pads the token groups of a 2d-2d operand: pass offs, or token_align=0")


def padded_tokens(m: int, g: int, token_align: int) -> int:
    """Columns of a colwise 2d-2d operand of M tokens in G groups with ``token_align`` (M itself for 0): the
    padded groups' bound ``align * (M // align + G)`` (:func:`cute_mxfp8.formats.pad_token_groups`)."""
    return token_align * (m // token_align + g) if token_align else m


def colwise_shapes(x_shape, blocked: bool, g: int | None, token_align: int = 0):
    """(data shape, scales shape) of colwise quantization (blocks along dim -2, data stored transposed); with
    ``token_align`` those of the padded groups' tensor (:func:`padded_tokens` rows, G groups)."""
    if token_align:
        x_shape = (padded_tokens(x_shape[0], g, token_align), x_shape[1])
    if len(x_shape) == 3:
        e, n, k = x_shape
        nb = n // BLOCK_SIZE
        return (e, k, n), ((e, blocked_scales_numel(k, nb)) if blocked else (e, k, nb))
    m, k = x_shape
    if g is None:
        mp = ceil_div(m, BLOCK_SIZE) * BLOCK_SIZE
        cols = mp // BLOCK_SIZE
        data = (k, mp)
    else:
        cols = 4 * grouped_scale_tiles(m, g)
        data = (k, m)
    return data, ((blocked_scales_numel(k, cols),) if blocked else (k, cols))


def check_quantize_input(x: torch.Tensor, offs: torch.Tensor | None, colwise: bool, rowwise: bool) -> None:
    check_hp("x", x, ranks=(2, 3))
    if x.dim() == 3 and offs is not None:
        raise ValueError("offs applies to 2-D (tokens, features) activations; 3-D (E, N, K) weights take none")
    if rowwise:
        check_mult32("x.shape[-1] (the rowwise-scaled dim)", x.shape[-1])
    if colwise and x.dim() == 3:
        check_mult32("x.shape[1] (the colwise-scaled dim of (E, N, K) weights)", x.shape[1])
    check_offs(offs, x.device)


# ---- GEMMs ----------------------------------------------------------------------------------------------

def check_mm(a, a_scales, b, b_scales, out_dtype, bias=None):
    check_out_dtype(out_dtype)
    check_same_device(a, a_scales, b, b_scales, bias)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"mm takes a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    check_mult32("K", k)
    check_fp8("a", a, (m, k))
    check_fp8("b", b, (n, k))
    check_scales("a_scales", a_scales, (blocked_scales_numel(m, k // BLOCK_SIZE),))
    check_scales("b_scales", b_scales, (blocked_scales_numel(n, k // BLOCK_SIZE),))
    if bias is not None:
        check_hp("bias", bias, ranks=(1,))
        if bias.shape[0] != n:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n},) (one value per row of b)")
    return (m, n)


def check_grouped_mm(a, a_scales, b, b_scales, offs, out_dtype):
    check_out_dtype(out_dtype)
    check_same_device(a, a_scales, b, b_scales, offs)
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"grouped_mm (2d-3d) takes a (M, K) and b (E, N, K), got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    m, k = a.shape
    e, n, _ = b.shape
    check_mult32("K", k)
    check_offs(offs, a.device, num_groups=e)
    check_fp8("a", a, (m, k))
    check_fp8("b", b, (e, n, k))
    check_scales("a_scales", a_scales, (grouped_m_scales_numel(m, e, k // BLOCK_SIZE),),
                 f"{e} token groups: quantize_rowwise(x, offs=offs) with these same offs")
    check_scales("b_scales", b_scales, (e, blocked_scales_numel(n, k // BLOCK_SIZE)))
    return (m, n)


def check_grouped_mm_wgrad(a, a_scales, b, b_scales, offs, out_dtype, split_halves=False):
    check_out_dtype(out_dtype)
    if type(split_halves) is not bool:
        raise TypeError(f"split_halves must be a bool, got {type(split_halves).__name__}")
    check_same_device(a, a_scales, b, b_scales, offs)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"grouped_mm_wgrad (2d-2d) takes a (N, M) and b (K, M) token-major operands, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    n, m = a.shape
    k = b.shape[0]
    check_offs(offs, a.device)
    g = offs.shape[0]
    cols = 4 * grouped_scale_tiles(m, g)
    check_fp8("a", a, (n, m))
    check_fp8("b", b, (k, m))
    hint = f"{g} token groups over {m} tokens: quantize_colwise(..., offs=offs) with these same offs"
    check_scales("a_scales", a_scales, (blocked_scales_numel(n, cols),), hint)
    check_scales("b_scales", b_scales, (blocked_scales_numel(k, cols),), hint)
    if split_halves:
        if n % 256:
            raise ValueError(f"split_halves needs N = a.shape[0] = {n} to be a multiple of 256 (the kernels' 128-row "
                             f"tiles each in one half): pad the packed rows, or pass split_halves=False")
        return (2, g, n // 2, k)
    return (g, n, k)


# ---- SwiGLU ---------------------------------------------------------------------------------------------

def check_swiglu(h13: torch.Tensor, offs, dh: torch.Tensor | None = None) -> int:
    check_hp("h13", h13)
    m, two_i = h13.shape
    if two_i % 2:
        raise ValueError(f"h13 must be (M, 2I) with gate and up halves, got last dim {two_i}")
    i = two_i // 2
    if i % BLOCK_SIZE:
        raise ValueError(f"I (half of h13's last dim) = {i} must be a multiple of the MX block size {BLOCK_SIZE}: "
                         f"pad gate and up EACH with zero columns to a multiple of {BLOCK_SIZE}, then pack them "
                         f"(padding h13 itself would misalign the two halves)")
    if dh is not None:
        check_hp("dh", dh)
        if tuple(dh.shape) != (m, i):
            raise ValueError(f"dh must be (M, I) = {(m, i)} to match h13 {tuple(h13.shape)}, got {tuple(dh.shape)}")
        check_same_device(dh, h13)
    check_offs(offs, h13.device)
    return i


# ---- GEMM + fused SwiGLU epilogues ------------------------------------------------------------------------

def check_mm_swiglu(a, a_scales, b13, b13_scales, out_dtype, offs=None) -> int:
    """GEMM1 with the SwiGLU epilogue: a (M, K), b13 (2I, K) interleaved gate/up (grouped: (E, 2I, K) with token
    groups ``offs``, as for :func:`check_grouped_mm`); returns I."""
    if offs is None:
        m, two_i = check_mm(a, a_scales, b13, b13_scales, out_dtype)
    else:
        m, two_i = check_grouped_mm(a, a_scales, b13, b13_scales, offs, out_dtype)
    if two_i % (2 * GATE_UP_TILE):
        raise ValueError(f"b13 must be (2I, K) with I a multiple of the gate/up tile {GATE_UP_TILE} (the fused "
                         f"epilogue's interleaved layout), got 2I = {two_i}: pad w1 and w3 EACH to a multiple of "
                         f"{GATE_UP_TILE} rows, or use the unfused path")
    return two_i // 2


def check_mm_dswiglu(a, a_scales, b, b_scales, h13, offs=None) -> int:
    """GEMM3 with the dSwiGLU epilogue: a (M, K), b (I, K) (grouped: (E, I, K) with ``offs``), h13 (M, 2I)
    interleaved; returns I."""
    if offs is None:
        m, i = check_mm(a, a_scales, b, b_scales, torch.float32)
    else:
        m, i = check_grouped_mm(a, a_scales, b, b_scales, offs, torch.float32)
    check_hp("h13", h13)
    check_same_device(a, h13)
    if tuple(h13.shape) != (m, 2 * i):
        raise ValueError(f"h13 must be (M, 2I) = {(m, 2 * i)} to match a {tuple(a.shape)} and b {tuple(b.shape)}, "
                         f"got {tuple(h13.shape)}")
    if i % GATE_UP_TILE:
        raise ValueError(f"I = {i} must be a multiple of the gate/up tile {GATE_UP_TILE} (the interleaved layout "
                         f"of h13): pad w1 and w3 EACH to a multiple of {GATE_UP_TILE} rows, or use the unfused path")
    return i
