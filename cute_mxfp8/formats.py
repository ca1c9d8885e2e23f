"""MXFP8 numerics: the reference every kernel in this package is tested against.

Everything here is plain torch, runs on any device, and is the package's numerics contract:

* Block size 32 along the *scaled* dim; elements ``float8_e4m3fn`` (max 448) or ``float8_e5m2`` (max 57344);
  one ``float8_e8m0fnu`` scale per block, byte ``b`` meaning ``2**(b - 127)``, byte 255 NaN, byte 0 ``2**-127``.
  Source: OCP Microscaling Formats (MX) Specification v1.0.
* ``scale_mode="floor"`` (OCP MX v1.0): ``scale = 2**(floor(log2(amax)) - emax_elem)`` with ``emax_elem`` 8 (e4m3)
  or 15 (e5m2); elements that still exceed the element max saturate.
* ``scale_mode="rceil"`` (cuBLAS "block scaling factors for FP8 with UE8M0 scales"): ``scale`` is the smallest
  power of two ``>= amax / max_elem``, computed exactly from the fp32 amax.
* ``amax`` is ``max |x|`` over the block in fp32.  A block holding NaN or Inf gets scale byte 255 and all-NaN
  elements; an all-zero block gets scale byte 0 and zero elements with their sign kept.
* Elements: ``x / scale`` (exact, the scale is a power of two), round to nearest even, saturate to ``+-max``.

Scale layouts: "plain" scales have the data's shape with the scaled dim divided by 32.
The "blocked" (swizzled) layout is what tcgen05 block-scaled MMA and cuBLAS read: the (R, C) scale matrix padded
with zeros to (ceil(R/128)*128, ceil(C/4)*4) and stored as 512-byte tiles of 128 rows x 4 columns, tile
``(r // 128) * ceil(C/4) + c // 4``, byte ``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4`` inside the tile
(the (32, 4, 4) atom of ``cutlass.utils.blockscaled_layout``).

Grouped layouts use int32 cumulative *end* offsets ``offs`` of shape (G,): group g holds rows
``[offs[g-1], offs[g])`` (start 0 for g = 0), ``offs[-1] <= M``, empty groups are legal.

* Groups along M (2d-3d GEMM operand, blocks along K): each group's blocked scales start on a fresh 128-row tile.
* Groups along K (2d-2d wgrad operand, blocks along the token dim): blocks never cross a group end (a group's last
  partial block is quantized as if zero-padded) and each group's scale columns start on a multiple of 4.

Both grouped layouts reserve ``grouped_scale_tiles(M, G) = M // 128 + G`` tiles along the grouped dim, an upper
bound on ``sum_g ceil(size_g / 128)`` that depends only on shapes, so buffers have static sizes.
"""

from __future__ import annotations

import operator

import torch

__all__ = [
    "BLOCK_SIZE",
    "SCALE_MODES",
    "ELEM_DTYPES",
    "elem_max",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "e8m0_to_float",
    "amax_to_e8m0",
    "to_blocked_scales",
    "from_blocked_scales",
    "blocked_scales_numel",
    "grouped_scale_tiles",
    "validate_offsets",
    "group_bounds",
    "group_tile_starts",
    "padded_group_offsets",
    "pad_token_groups",
    "to_blocked_scales_grouped_m",
    "from_blocked_scales_grouped_m",
    "quantize_mxfp8_grouped_k",
    "dequantize_mxfp8_grouped_k",
    "to_blocked_scales_grouped_k",
    "grouped_k_scale_offset",
    "from_blocked_scales_grouped_k",
]

BLOCK_SIZE = 32
SCALE_MODES = ("floor", "rceil")
# element dtype -> (largest finite value, exponent of the largest power of two below it, i.e. emax_elem)
ELEM_DTYPES = {
    torch.float8_e4m3fn: (448.0, 8),
    torch.float8_e5m2: (57344.0, 15),
}
_E8M0_NAN = 255
_TILE_ROWS = 128  # rows of one blocked scale tile
_TILE_COLS = 4  # scale columns of one blocked scale tile (= 128 elements along the scaled dim)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_elem_dtype(elem_dtype: torch.dtype) -> None:
    if elem_dtype not in ELEM_DTYPES:
        raise ValueError(
            f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype}"
        )


def _as_int(v, name: str, kind: str = "an int") -> int:
    """``v`` as a Python int (numpy / torch integers too); TypeError ("``name`` must be ``kind``") for bools,
    floats and the rest."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be {kind}, got bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be {kind}, got {type(v).__name__}") from None


def _normalize_dim(dim: int, rank: int) -> int:
    dim = _as_int(dim, "dim")
    if not -rank <= dim < rank:
        raise IndexError(f"dim {dim} is out of range for a tensor of rank {rank}")
    return dim % rank


def _check_scales_dtype(scales: torch.Tensor) -> None:
    if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"scales must be torch.float8_e8m0fnu (or their uint8 bytes), got {scales.dtype}")


def _check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


def elem_max(elem_dtype: torch.dtype) -> float:
    """Largest finite value of an MXFP8 element dtype (448 for e4m3, 57344 for e5m2)."""
    _check_elem_dtype(elem_dtype)
    return ELEM_DTYPES[elem_dtype][0]


def amax_to_e8m0(amax: torch.Tensor, scale_mode: str = "rceil", elem_dtype=torch.float8_e4m3fn,
                 *, max_elem: float | None = None) -> torch.Tensor:
    """E8M0 scale byte (as uint8) for fp32 block maxima ``amax`` (>= 0, NaN/Inf allowed).

    ``floor``: ``clamp(floor(log2 amax) - emax_elem + 127, 0, 254)``.  ``rceil``: the smallest ``b`` in [0, 254]
    with ``2**(b-127) >= amax / max_elem`` (``max_elem`` defaults to the element dtype's max; pass 1.0 to get the
    bare round-up-to-a-power-of-two step).  ``amax == 0`` gives 0; NaN or Inf gives 255.
    """
    _check_scale_mode(scale_mode)
    _check_elem_dtype(elem_dtype)
    amax = amax.float()
    fmax, emax = ELEM_DTYPES[elem_dtype]
    if max_elem is not None:
        fmax = float(max_elem)
    if scale_mode == "floor":
        # frexp: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1 (exact, subnormals too).
        _, e = torch.frexp(amax)
        byte = (e.to(torch.int32) - 1) - emax + 127
    else:
        # amax / fmax in float64 is exact enough: an fp32 amax has 24 significant bits, so the quotient is a
        # power of two exactly when the rounded float64 quotient is one.
        m, e = torch.frexp(amax.double() / fmax)
        s = torch.where(m == 0.5, e - 1, e).to(torch.int32)  # ceil(log2(amax / fmax))
        byte = s + 127
    byte = byte.clamp(0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    byte = torch.where(torch.isfinite(amax), byte, torch.full_like(byte, _E8M0_NAN))
    return byte.to(torch.uint8)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scales (``float8_e8m0fnu`` or uint8 bytes) to fp32: ``2**(b-127)``, byte 0 is ``2**-127``
    (fp32 bits 0x00400000, never 0.0), byte 255 is NaN."""
    b = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    out = bits.view(torch.float32)
    return torch.where(b == _E8M0_NAN, torch.full_like(out, float("nan")), out)


def _quantize_blocks(xb: torch.Tensor, scale_mode: str, elem_dtype: torch.dtype, share: int = 1,
                     amax: torch.Tensor | None = None):
    """Quantize ``xb`` of shape (..., nb, 32) in fp32 along its last dim; returns (elements, scale bytes
    (..., nb)).  ``share`` > 1: each run of ``share`` consecutive blocks (the last run may be shorter) takes the
    scale of their common amax, the largest of their own scales.  ``amax`` (..., nb): the blocks' amaxes, given
    (the 128 x 128 tiles' of :func:`quantize_mxfp8`'s ``blocks_2d``) instead of computed."""
    fmax = ELEM_DTYPES[elem_dtype][0]
    if amax is None:
        amax = xb.abs().amax(dim=-1)  # NaN if the block holds a NaN (amax propagates it), Inf if it holds an Inf
        if share > 1:  # (given amaxes are already shared)
            nb = amax.shape[-1]
            pad = -nb % share
            runs = torch.nn.functional.pad(amax, (0, pad)).unflatten(-1, (-1, share)).amax(dim=-1)
            amax = runs.repeat_interleave(share, dim=-1)[..., :nb]
    byte = amax_to_e8m0(amax, scale_mode, elem_dtype)  # 255 for a non-finite amax
    scale = e8m0_to_float(byte)
    # Division by a power of two is exact.  Every element of a poisoned block becomes the positive NaN (0x7F):
    # the NaN scale alone would keep the sign of a negative NaN input.
    q = (xb / scale.unsqueeze(-1)).clamp(-fmax, fmax)
    q = torch.where((byte == _E8M0_NAN).unsqueeze(-1), torch.full_like(q, float("nan")), q)
    return q.to(elem_dtype), byte


SCALE_BLOCKS = (32, 128)


def check_scale_block(scale_block) -> None:
    """ValueError unless ``scale_block`` is one of :data:`SCALE_BLOCKS` (an int: True / 128.0 are refused)."""
    if type(scale_block) is not int or scale_block not in SCALE_BLOCKS:
        raise ValueError(f"scale_block must be 32 (MXFP8) or 128 (the Hopper fast mode's shared scales, "
                         f"quantize_mxfp8(..., scale_block=128)), got {scale_block!r}")


def _tile_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """amax of each 128 x 128 tile of the last two dims of ``x`` (zero-padded), repeated for each 32-element
    block along ``dim`` (-1 or -2) and each index of the other dim: the block amaxes of ``blocks_2d``, moved so
    ``dim`` is last."""
    rows, cols = x.shape[-2], x.shape[-1]
    t = torch.nn.functional.pad(x.float().abs(), (0, -cols % 128, 0, -rows % 128))  # NaN stays NaN (amax too)
    tiles = t.unflatten(-1, (-1, 128)).unflatten(-3, (-1, 128)).amax(dim=(-3, -1))  # (..., R/128, C/128)
    if dim == -1:  # per (row, 32-column block)
        return tiles.repeat_interleave(128, dim=-2)[..., :rows, :].repeat_interleave(4, dim=-1)[..., :cols // 32]
    full = tiles.repeat_interleave(4, dim=-2)[..., :rows // 32, :].repeat_interleave(128, dim=-1)[..., :cols]
    return full.transpose(-1, -2)


def quantize_mxfp8(x: torch.Tensor, *, dim: int = -1, scale_mode: str = "rceil",
                   elem_dtype: torch.dtype = torch.float8_e4m3fn,
                   scale_block: int = 32, blocks_2d: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8 with blocks of 32 consecutive elements along ``dim``.

    Args:
        x: bf16 or fp32 tensor of any rank >= 1, any strides; ``x.shape[dim] % 32 == 0``.
        dim: the scaled dim.  ``dim=-1`` is "rowwise" (dim0-major data, 1x32 blocks) for a 2-D tensor,
            ``dim=0`` is "colwise" (32x1 blocks).
        scale_mode: ``"rceil"`` (default; cuBLAS / TransformerEngine) or ``"floor"`` (OCP MX v1.0).
        elem_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        scale_block: 32 (default, OCP MX v1.0) or 128, the Hopper fast mode (issue 16): the 4 MX blocks of each
            128 consecutive elements (counted from index 0; a last shorter run when ``x.shape[dim] % 128``) share
            one scale, the largest of their 4 MX scales (= the scale of their common amax; a NaN/Inf anywhere
            poisons all 128).  The result is still MXFP8 in the same layout (one scale per 32, repeated), so every
            MXFP8 consumer reads it; an element differs from MXFP8's, shifted by the scale ratio, only where that
            shift takes it into the element dtype's subnormal range (lost mantissa bits) and, in ``floor`` mode,
            where MXFP8 saturated it and the larger shared scale no longer does.
        blocks_2d: with ``scale_block=128``, for weights (the fast mode's ``hopper_weight_blocks="128x128"``): every
            128 x 128 tile of the last two dims (counted from index 0, the edge tiles shorter) shares one scale,
            the largest of its 128-element blocks' (DeepSeek-V3's weight blocks; cuBLAS's 1x128 x 128x128
            blockwise fp8).  ``x`` needs rank >= 2 and ``dim`` one of its last two dims; the data and scales are
            then the same bytes, transposed, whichever of the two is scaled, and still MXFP8 (the scales repeated).

    Returns:
        ``(data, scales)``: ``data`` has ``x``'s shape in ``elem_dtype`` (contiguous); ``scales`` is
        ``torch.float8_e8m0fnu`` (contiguous) with ``x``'s shape except ``x.shape[dim] // 32`` along ``dim``
        (the plain layout; see :func:`to_blocked_scales`).

    Raises:
        ValueError: unsupported dtype, scale mode, element dtype or scale block, ``x.shape[dim]`` not a multiple
        of 32, or ``blocks_2d`` without ``scale_block=128``, on a 1-D tensor or along a leading dim.
        TypeError: ``x`` not a tensor, or ``blocks_2d`` not a bool.
        IndexError: ``dim`` out of range for ``x``'s rank (as torch's own dim arguments).
    """
    check_scale_block(scale_block)
    if type(blocks_2d) is not bool:
        raise TypeError(f"blocks_2d must be a bool, got {type(blocks_2d).__name__}")
    if blocks_2d and scale_block != 128:
        raise ValueError(f"blocks_2d (a bool) shares scales over 128 x 128 tiles of the fast mode's scale_block=128, "
                         f"got blocks_2d={blocks_2d!r} with scale_block={scale_block!r}")
    _check_scale_mode(scale_mode)
    _check_elem_dtype(elem_dtype)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_mxfp8 takes a torch.Tensor, got {type(x).__name__}: wrap it with torch.tensor")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_mxfp8 takes bfloat16 or float32 input, got {x.dtype}; cast it first")
    if x.dim() == 0:
        raise ValueError("quantize_mxfp8 needs a tensor of rank >= 1")
    dim = _normalize_dim(dim, x.dim())
    n = x.shape[dim]
    if n % BLOCK_SIZE != 0:
        raise ValueError(
            f"the scaled dim (dim={dim}, size {n}) must be a multiple of the MX block size {BLOCK_SIZE}; "
            "pad it with zeros to a multiple of 32"
        )
    amax = None
    if blocks_2d:
        if x.dim() < 2 or dim < x.dim() - 2:
            raise ValueError(f"blocks_2d tiles the last two dims: it needs a tensor of rank >= 2 scaled along one of "
                             f"them, got shape {tuple(x.shape)} and dim={dim}")
        amax = _tile_amax(x, dim - x.dim())
    xt = x.float().movedim(dim, -1)
    lead = xt.shape[:-1]
    q, byte = _quantize_blocks(xt.reshape(*lead, n // BLOCK_SIZE, BLOCK_SIZE), scale_mode, elem_dtype,
                               scale_block // BLOCK_SIZE, amax)
    data = q.reshape(*lead, n).movedim(-1, dim).contiguous()
    scales = byte.movedim(-1, dim).contiguous().view(torch.float8_e8m0fnu)
    return data, scales


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, *, dim: int = -1,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp8`: ``data.float() * 2**(b - 127)`` per block (b = 255 gives NaN).

    ``data`` is e4m3/e5m2 of rank >= 1 and any strides, ``scales`` (e8m0 or their uint8 bytes) in the *plain*
    layout: ``data``'s shape with ``data.shape[dim] // 32`` along ``dim`` (blocked scales: convert them with
    :func:`from_blocked_scales` first).  Returns ``out_dtype`` (a floating ``torch.dtype``, fp32 default) of
    ``data``'s shape (fp8 outputs are refused: they would saturate).  A ``scale_block=128`` cast dequantizes the
    same way (its scales are repeated per 32).

    Raises:
        TypeError: ``data`` or ``scales`` not a tensor, or ``out_dtype`` not a ``torch.dtype``.
        ValueError: other element / scale dtypes, rank-0 data, ``data.shape[dim] % 32 != 0``, scales whose shape
            is not the plain layout's (blocked scales included), an ``out_dtype`` that is not a 16-bit or
            wider floating dtype.
        IndexError: ``dim`` out of range.
    """
    for name, t in (("data", data), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"dequantize_mxfp8: {name} must be a torch.Tensor, got {type(t).__name__}")
    if data.dtype not in ELEM_DTYPES:
        raise ValueError(f"data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    if data.dim() == 0:
        raise ValueError("dequantize_mxfp8 needs data of rank >= 1")
    _check_scales_dtype(scales)
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"dequantize_mxfp8: out_dtype must be a torch.dtype (e.g. torch.bfloat16), got {out_dtype!r}")
    if not out_dtype.is_floating_point or out_dtype.itemsize < 2:
        raise ValueError(f"out_dtype must be a floating-point dtype of 16 bits or more (bf16, fp16, fp32, fp64), "
                         f"got {out_dtype}")
    dim = _normalize_dim(dim, data.dim())
    n = data.shape[dim]
    expect = list(data.shape)
    expect[dim] = n // BLOCK_SIZE
    if n % BLOCK_SIZE != 0:
        raise ValueError(f"data {tuple(data.shape)} has {n} elements along dim {dim}, not a multiple of the block "
                         f"size {BLOCK_SIZE}: pass the dim the data was quantized along (dim=...)")
    if list(scales.shape) != expect:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not match data {tuple(data.shape)} "
                         f"blocked by 32 along dim {dim} (expected {tuple(expect)})")
    if scales.device != data.device:
        raise ValueError(f"data is on {data.device} and scales on {scales.device}: move them to one device")
    d = data.float().movedim(dim, -1)
    s = e8m0_to_float(scales).movedim(dim, -1).unsqueeze(-1)
    out = (d.reshape(*d.shape[:-1], n // BLOCK_SIZE, BLOCK_SIZE) * s).reshape(d.shape)
    return out.movedim(-1, dim).to(out_dtype)


# ---------------------------------------------------------------------------------------------------------
# Blocked (swizzled) scale layout
# ---------------------------------------------------------------------------------------------------------

def blocked_scales_numel(rows: int, cols: int) -> int:
    """Bytes of the blocked layout of a (rows, cols) scale matrix: ceil(rows/128)*128 * ceil(cols/4)*4.
    TypeError / ValueError for sizes that are not ints >= 0."""
    rows, cols = _check_rows_cols(rows, cols)
    return _ceil_div(rows, _TILE_ROWS) * _TILE_ROWS * _ceil_div(cols, _TILE_COLS) * _TILE_COLS


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Plain (R, C) scales -> the blocked tcgen05/cuBLAS layout as a contiguous 1-D ``float8_e8m0fnu`` buffer of
    :func:`blocked_scales_numel` (R, C) bytes, zero padded.  A 3-D (E, R, C) input (per-expert weights) gives
    (E, blocked_scales_numel(R, C)), each expert blocked on its own (all experts in one copy)."""
    if scales.dim() not in (2, 3):
        raise ValueError(f"to_blocked_scales takes (R, C) or (E, R, C) scales, got shape {tuple(scales.shape)}")
    _check_scales_dtype(scales)
    *lead, r, c = scales.shape
    rt, ct = _ceil_div(r, _TILE_ROWS), _ceil_div(c, _TILE_COLS)
    # bytewise: copies of E8M0 tensors meet autocast's type promotion, which rejects fp8
    padded = scales.view(torch.uint8).new_zeros(*lead, rt * _TILE_ROWS, ct * _TILE_COLS)
    padded[..., :r, :c] = scales.view(torch.uint8)
    # row = rt*128 + r1*32 + r0 -> offset inside the tile r0*16 + r1*4 + c%4
    n = len(lead)
    blocked = padded.view(*lead, rt, 4, 32, ct, _TILE_COLS).permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return blocked.reshape(*lead, blocked_scales_numel(r, c)).view(torch.float8_e8m0fnu)


def _check_rows_cols(rows, cols) -> tuple[int, int]:
    """(rows, cols) as ints >= 0: TypeError / ValueError naming the one that is not."""
    out = []
    for name, v in (("rows", rows), ("cols", cols)):
        v = _as_int(v, name)
        if v < 0:
            raise ValueError(f"{name} must be >= 0 (the plain scales' shape), got {v}")
        out.append(v)
    return out[0], out[1]


def _check_offs_tensor(offs) -> None:
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"offs must be a 1-D torch.int32 tensor of cumulative group END offsets, got "
                        f"{type(offs).__name__}: torch.tensor(offs, dtype=torch.int32)")


def from_blocked_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_scales`: a blocked buffer (1-D, or (E, n) per expert) -> plain (rows, cols)
    (or (E, rows, cols)) ``float8_e8m0fnu`` scales."""
    if blocked.dim() == 2:
        if blocked.shape[0] == 0:
            return blocked.new_zeros(0, rows, cols)
        plain = [from_blocked_scales(b, rows, cols).view(torch.uint8) for b in blocked]
        return torch.stack(plain).view(torch.float8_e8m0fnu)  # bytewise, as in to_blocked_scales
    _check_scales_dtype(blocked)
    rows, cols = _check_rows_cols(rows, cols)
    need = blocked_scales_numel(rows, cols)
    if blocked.dim() != 1 or blocked.numel() != need:
        raise ValueError(f"blocked scales for ({rows}, {cols}) need a 1-D buffer of {need} bytes, "
                         f"got shape {tuple(blocked.shape)}")
    rt, ct = _ceil_div(rows, _TILE_ROWS), _ceil_div(cols, _TILE_COLS)
    plain = blocked.view(torch.uint8).view(rt, ct, 32, 4, _TILE_COLS).permute(0, 3, 2, 1, 4)
    plain = plain.reshape(rt * _TILE_ROWS, ct * _TILE_COLS)
    return plain[:rows, :cols].contiguous().view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------------------------
# Grouped layouts
# ---------------------------------------------------------------------------------------------------------

def grouped_scale_tiles(total: int, num_groups: int) -> int:
    """128-wide tiles reserved along the grouped dim: ``total // 128 + num_groups`` >= sum_g ceil(size_g/128)."""
    return total // _TILE_ROWS + num_groups


def validate_offsets(offs: torch.Tensor, total: int | None) -> int:
    """Check ``offs``: 1-D int32, non-decreasing, ``0 <= offs[g] <= total`` (no upper bound for ``total=None``).
    Raises ValueError naming the fix.

    Reads the values (one device sync on GPU; the checks on dtype and rank are free) and returns ``offs[-1]``, the
    end of the last group (0 with no groups), from that same read.
    """
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        got = f"{offs.dtype} of shape {tuple(offs.shape)}" if isinstance(offs, torch.Tensor) else type(offs)
        raise ValueError(f"offs must be a 1-D torch.int32 tensor of cumulative group END offsets, got {got}")
    if offs.numel() == 0:
        return 0
    o = offs.cpu().to(torch.int64)
    if int(o[0]) < 0 or bool((o[1:] < o[:-1]).any()):
        raise ValueError(f"offs must be non-decreasing and >= 0 (cumulative end offsets), got {o.tolist()}")
    if total is not None and int(o[-1]) > total:
        raise ValueError(f"offs[-1] = {int(o[-1])} exceeds the grouped dim size {total}")
    return int(o[-1])


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` row ranges of the groups described by ``offs`` (host list; a device sync)."""
    o = offs.cpu().tolist()
    starts = [0] + o[:-1]
    return list(zip(starts, o))


def group_tile_starts(offs: torch.Tensor) -> torch.Tensor:
    """First 128-wide tile of each group in a grouped blocked layout: the exclusive prefix sum of
    ``ceil(size_g / 128)``.  int32, shape (G,), on ``offs``'s device."""
    o = offs.to(torch.int64)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    tiles = (sizes + _TILE_ROWS - 1) // _TILE_ROWS
    return (torch.cumsum(tiles, 0) - tiles).to(torch.int32)


def group_units_host(ends: list[int], unit: int) -> list[int]:
    """Running total of ``ceil(size_g / unit)`` over the groups of cumulative end offsets ``ends`` (Python ints,
    no torch op): group g's units end at entry g and start at entry g - 1 (0 for g = 0).  The host form of the
    grouped layouts' prefix sums (tiles, aligned columns)."""
    out, n, prev = [], 0, 0
    for e in ends:
        n += -(-(e - prev) // unit)
        out.append(n)
        prev = e
    return out


def group_tile_starts_host(ends: list[int]) -> list[int]:
    """:func:`group_tile_starts` of offsets given as Python ints (the grouped ops' host copy; no torch op)."""
    return ([0] + group_units_host(ends, _TILE_ROWS))[:-1]


def _check_align(align) -> None:
    if type(align) is not int or align < 1:
        raise ValueError(f"align must be a positive int (token groups padded to multiples of it), got {align!r}")


def padded_group_offsets(offs: torch.Tensor, align: int = _TILE_ROWS) -> torch.Tensor:
    """Cumulative END offsets of the groups of ``offs`` with every size rounded up to a multiple of ``align``:
    group g then starts at column ``align * (the exclusive prefix sum of ceil(size / align))`` (for ``align`` 128,
    ``128 * group_tile_starts(offs)[g]``).  int32 (G,), on ``offs``'s device, no host read (so ``offs`` is not
    validated here: :func:`validate_offsets` does that).  Raises ValueError for an ``align`` that is not a positive
    int or ``offs`` that is not a 1-D tensor."""
    _check_align(align)
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1:
        raise ValueError(f"offs must be a 1-D tensor of cumulative group END offsets, got "
                         f"{tuple(offs.shape) if isinstance(offs, torch.Tensor) else type(offs).__name__}")
    o = offs.to(torch.int64)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    return (torch.cumsum((sizes + align - 1) // align, 0) * align).to(torch.int32)


def pad_token_groups(x: torch.Tensor, offs: torch.Tensor, align: int = _TILE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) with token groups ``offs`` -> ``(xp, padded)``: xp (align * (M // align + G), K) holds group g's
    rows from row ``padded[g - 1]`` (0 for g = 0), then zero rows up to ``padded[g]``, and zero rows after the last
    group (rows of ``x`` at or past ``offs[-1]`` are dropped); ``padded = padded_group_offsets(offs, align)``.

    The colwise cast of a 2d-2d operand with ``token_align=128`` (``cute_mxfp8.ops.quantize_colwise``) is the
    grouped colwise cast of ``xp`` with offsets ``padded``: every group starts on a 128-aligned token, which the
    Hopper fast mode's wgrad reads without a gather.  The row count bounds the padded sizes
    (``sum_g ceil(size_g / align) <= M // align + G``), so it is known without reading ``offs``.  Raises ValueError
    for an ``x`` that is not 2-D, bad offsets or a bad ``align``."""
    _check_align(align)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"pad_token_groups takes a 2-D (M, K) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    m, k = x.shape
    validate_offsets(offs, m)
    g = offs.numel()
    padded = padded_group_offsets(offs, align)
    xp = x.new_zeros(align * (m // align + g), k)
    for (s, e), p in zip(group_bounds(offs), [0] + padded.tolist()[:-1]):
        xp[p:p + e - s] = x[s:e]
    return xp, padded


def to_blocked_scales_grouped_m(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Plain (M, C) row scales of a 2d-3d operand grouped along M -> a blocked buffer in which every group starts
    on a fresh 128-row tile (:func:`group_tile_starts`).

    Returns a contiguous 1-D ``float8_e8m0fnu`` buffer of ``grouped_scale_tiles(M, G) * 128 * ceil(C/4)*4`` bytes;
    unused tiles and padding are zero; rows at or past ``offs[-1]`` are not read.
    """
    _check_offs_tensor(offs)
    m, c = scales.shape
    g = offs.numel()
    validate_offsets(offs, m)
    ct = _ceil_div(c, _TILE_COLS)
    tile_bytes = _TILE_ROWS * ct * _TILE_COLS
    out = scales.view(torch.uint8).new_zeros(grouped_scale_tiles(m, g) * tile_bytes)
    for (s, e), t in zip(group_bounds(offs), group_tile_starts(offs).tolist()):
        if e > s:
            blk = to_blocked_scales(scales[s:e]).view(torch.uint8)
            out[t * tile_bytes: t * tile_bytes + blk.numel()] = blk
    return out.view(torch.float8_e8m0fnu)


def from_blocked_scales_grouped_m(blocked: torch.Tensor, offs: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_scales_grouped_m`: plain (rows, cols) scales, zero at rows >= offs[-1]."""
    _check_offs_tensor(offs)
    rows, cols = _check_rows_cols(rows, cols)
    g = offs.numel()
    validate_offsets(offs, rows)
    ct = _ceil_div(cols, _TILE_COLS)
    tile_bytes = _TILE_ROWS * ct * _TILE_COLS
    need = grouped_scale_tiles(rows, g) * tile_bytes
    if blocked.dim() != 1 or blocked.numel() != need:
        raise ValueError(f"grouped blocked scales for ({rows}, {cols}) with {g} groups need {need} bytes, "
                         f"got shape {tuple(blocked.shape)}")
    flat = blocked.view(torch.uint8)
    out = flat.new_zeros(rows, cols)
    for (s, e), t in zip(group_bounds(offs), group_tile_starts(offs).tolist()):
        if e > s:
            n = blocked_scales_numel(e - s, cols)
            out[s:e] = from_blocked_scales(flat[t * tile_bytes: t * tile_bytes + n], e - s, cols).view(torch.uint8)
    return out.view(torch.float8_e8m0fnu)


def quantize_mxfp8_grouped_k(x: torch.Tensor, offs: torch.Tensor, *, scale_mode: str = "rceil",
                             elem_dtype: torch.dtype = torch.float8_e4m3fn,
                             scale_block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (M, N) along dim 0 (the token dim of a 2d-2d wgrad operand) per token group.

    Blocks of 32 rows start at each group's first row and never cross a group end: a group's last partial block
    is quantized as if zero-padded.  Any group size works, including 0 and sizes not divisible by 32.
    ``scale_block=128`` (the Hopper fast mode, :func:`quantize_mxfp8`): runs of 4 blocks from each group's first
    row share the largest of their scales; a group's last run may be shorter, and no run crosses a group end.

    Returns ``(data, scales)``: ``data`` (M, N) ``elem_dtype``, zero at rows >= offs[-1]; ``scales`` plain and
    *aligned*: shape (4 * grouped_scale_tiles(M, G), N) ``float8_e8m0fnu``, where the blocks of group g occupy rows
    ``[4 * group_tile_starts(offs)[g], ... + ceil(size_g / 32))`` and every other row is zero.  The GEMM operand's
    scale matrix is ``scales.t()`` (N rows, block columns), whose group columns start on multiples of 4; the
    kernels take it blocked per group, :func:`to_blocked_scales_grouped_k` (``scales.t(), offs``).
    """
    _check_offs_tensor(offs)
    check_scale_block(scale_block)
    if x.dim() != 2:
        raise ValueError(f"quantize_mxfp8_grouped_k takes a 2-D (M, N) tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    validate_offsets(offs, m)
    g = offs.numel()
    data = torch.zeros(m, n, dtype=elem_dtype, device=x.device)
    scales = torch.zeros(4 * grouped_scale_tiles(m, g), n, dtype=torch.uint8, device=x.device)
    for (s, e), t in zip(group_bounds(offs), group_tile_starts(offs).tolist()):
        if e == s:
            continue
        size = e - s
        padded = x.new_zeros(_ceil_div(size, BLOCK_SIZE) * BLOCK_SIZE, n)
        padded[:size] = x[s:e]
        d, sc = quantize_mxfp8(padded, dim=0, scale_mode=scale_mode, elem_dtype=elem_dtype, scale_block=scale_block)
        data[s:e] = d[:size]
        scales[4 * t: 4 * t + sc.shape[0]] = sc.view(torch.uint8)
    return data, scales.view(torch.float8_e8m0fnu)


def dequantize_mxfp8_grouped_k(data: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor,
                               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp8_grouped_k`; rows >= offs[-1] come back as zero."""
    _check_offs_tensor(offs)
    m, n = data.shape
    validate_offsets(offs, m)
    out = torch.zeros(m, n, dtype=out_dtype, device=data.device)
    for (s, e), t in zip(group_bounds(offs), group_tile_starts(offs).tolist()):
        if e == s:
            continue
        nb = _ceil_div(e - s, BLOCK_SIZE)
        padded = data.new_zeros(nb * BLOCK_SIZE, n)
        padded[: e - s] = data[s:e]
        out[s:e] = dequantize_mxfp8(padded, scales[4 * t: 4 * t + nb], dim=0, out_dtype=out_dtype)[: e - s]
    return out


def to_blocked_scales_grouped_k(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Blocked layout of a 2d-2d operand's aligned grouped-K scale matrix (N, 4 * grouped_scale_tiles(M, G)), i.e.
    ``quantize_mxfp8_grouped_k(x, offs)[1].t()``, in the order PyTorch's ``torch._scaled_grouped_mm`` (2d-2d),
    torchao, FBGEMM and cuDNN-frontend use: each group's (N, 4 * ceil(size_g / 128)) scale columns are blocked on
    their own (:func:`to_blocked_scales`) and the groups' buffers follow each other, group g from byte
    ``ceil(N / 128) * 512 * group_tile_starts(offs)[g]``.  So a group's row tiles are ``ceil(size_g / 128)`` tiles
    apart, not the whole matrix's column tiles (:func:`grouped_k_scale_offset` is the byte map).

    Returns a contiguous 1-D ``float8_e8m0fnu`` buffer of ``blocked_scales_numel(N, 4 * grouped_scale_tiles(M,
    G))`` bytes (the same size as the plain matrix's blocked layout; bytes past the last group are zero).  Raises
    ValueError if ``scales`` is not (N, a multiple of 4) or ``offs`` does not fit it."""
    _check_offs_tensor(offs)
    if scales.dim() != 2 or scales.shape[1] % _TILE_COLS != 0:
        raise ValueError(f"grouped-K scales must be (N, 4 * tiles), got shape {tuple(scales.shape)}")
    _check_scales_dtype(scales)
    n, cols = scales.shape
    starts = _grouped_k_starts(offs, cols)
    rt = _ceil_div(n, _TILE_ROWS)
    out = scales.view(torch.uint8).new_zeros(blocked_scales_numel(n, cols))
    for t, tiles in starts:
        blk = to_blocked_scales(scales[:, 4 * t: 4 * (t + tiles)].contiguous()).view(torch.uint8)
        out[rt * 512 * t: rt * 512 * t + blk.numel()] = blk
    return out.view(torch.float8_e8m0fnu)


def from_blocked_scales_grouped_k(blocked: torch.Tensor, offs: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_scales_grouped_k`: plain (rows, cols) scales (``cols`` = 4 *
    grouped_scale_tiles(M, G)), zero outside the groups' columns."""
    _check_offs_tensor(offs)
    rows, cols = _check_rows_cols(rows, cols)
    _check_scales_dtype(blocked)
    need = blocked_scales_numel(rows, cols)
    if blocked.dim() != 1 or blocked.numel() != need:
        raise ValueError(f"grouped-K blocked scales for ({rows}, {cols}) need a 1-D buffer of {need} bytes, "
                         f"got shape {tuple(blocked.shape)}")
    flat = blocked.view(torch.uint8)
    out = flat.new_zeros(rows, cols)
    rt = _ceil_div(rows, _TILE_ROWS)
    for t, tiles in _grouped_k_starts(offs, cols):
        part = flat[rt * 512 * t: rt * 512 * (t + tiles)].view(torch.float8_e8m0fnu)
        out[:, 4 * t: 4 * (t + tiles)] = from_blocked_scales(part, rows, 4 * tiles).view(torch.uint8)
    return out.view(torch.float8_e8m0fnu)


def grouped_k_scale_offset(r: int, b: int, tile0: int, tiles: int, rows: int) -> int:
    """Byte offset, in :func:`to_blocked_scales_grouped_k`'s layout, of the scale of row ``r`` (< ``rows``, the
    scale matrix's rows) and block ``b`` of a group (its ``b``-th 32-element block) whose scale tiles start at
    ``tile0`` (``group_tile_starts``) and number ``tiles`` (``ceil(size_g / 128)``).  The kernels use the same
    formula (:func:`cute_mxfp8.kernels.mx_math.grouped_k_scale_offset`)."""
    return _ceil_div(rows, _TILE_ROWS) * 512 * tile0 + _blocked_offset(r, b, 4 * tiles)


def _blocked_offset(r: int, c: int, cols: int) -> int:
    return ((r // 128) * _ceil_div(cols, 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _grouped_k_starts(offs: torch.Tensor, cols: int) -> list[tuple[int, int]]:
    """[(first scale tile, tiles)] of the non-empty groups of ``offs``; raises ValueError if they pass ``cols``."""
    validate_offsets(offs, None)  # the scale matrix bounds offs[-1] only through its columns (checked below)
    bounds = group_bounds(offs)
    starts = group_tile_starts(offs).tolist()
    out = [(t, _ceil_div(e - s, _TILE_ROWS)) for (s, e), t in zip(bounds, starts) if e > s]
    if out and 4 * (out[-1][0] + out[-1][1]) > cols:
        raise ValueError(f"offs {offs.tolist()} needs {4 * (out[-1][0] + out[-1][1])} scale columns, the scales "
                         f"have {cols}: pass the offs the operand was quantized with")
    return out
