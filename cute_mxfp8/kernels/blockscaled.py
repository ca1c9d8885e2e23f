"""Global-memory layouts of MXFP8 operands as the SM100 block-scaled GEMM sees them (tcgen05
``kind::mxf8f6f4``, scale vector 32).  Layout algebra only, no kernel code, so the GEMM kernel and the tests use
the very same functions.

Scale factors: one E8M0 byte per 32 consecutive elements along K, stored in the blocked layout of the cuBLAS
block-scaling docs (``cute_mxfp8.formats.to_blocked_scales``): 128 x 4 tiles of 512 bytes, tiles row-major over
(MN / 128, K / 128), inside a tile row ``r`` and scale column ``c`` at ``(r % 32) * 16 + (r % 128 // 32) * 4 + c``.
The tcgen05 MMA reads the same 128 x 4 atom from tensor memory (PTX ISA, "tcgen05 matrix scale factor layout"),
so the GEMM copies whole tiles with TMA + ``tcgen05.cp`` and never reshuffles bytes.  The DSL's
``BlockScaledBasicChunk`` is that atom; :func:`scale_layout` tiles it over an operand.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.utils import blockscaled_layout

SF_VEC = 32  # elements per E8M0 scale (OCP MX v1.0 block size)


def scale_layout(mn, k, batches=1) -> cute.Layout:
    """Layout of the blocked scales of an (MN, K) operand, per batch (expert) ``l``, indexed by ELEMENT
    coordinates ``(mn, k, l)``: the byte offset of the scale of element (mn, k) in the (L, blocked numel) buffer.
    Stride 0 inside each 32-element vector.  ``mn``/``k``/``batches`` may be static ints or dynamic DSL values;
    K must be a multiple of 32 (a partial 128-row or 4-column tile is padded, as in ``to_blocked_scales``)."""
    return blockscaled_layout.tile_atom_to_shape_SF((mn, k, batches), SF_VEC)
