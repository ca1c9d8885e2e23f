"""The SM100 GEMM's architecture-independent parts run on the H200 (``kernels/gemm_checks.py``, docs/sm100_gemm.md):

* the fused epilogues: the device code the GEMM calls on its ``tcgen05.ld`` fragments, fed from a global fp32
  accumulator, must give exactly what the standalone fused SwiGLU kernels give (same ``mx_math`` functions) for
  the same accumulator, once the interleaved gate/up layout is undone: bytes and scales bit-exact;
* the blocked scale layout, built with run-time shapes as the GEMM builds it, gathers every scale of
  ``to_blocked_scales`` back to its block;
* the persistent tile schedule visits every output tile exactly once, for shapes not divisible by the tile."""

from __future__ import annotations

import pytest
import torch

from cute_mxfp8 import formats as F
from cute_mxfp8.swiglu import GATE_UP_TILE, pack_gate_up, split_gate_up
from fused_checks import assert_dh13_equal, concat_gate_up

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                         reason="needs an SM90 GPU (run on the H200 with -m gpu)")
ELEMS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def test_kernel_and_torch_layers_agree_on_the_gate_up_tile():
    from cute_mxfp8.kernels import gemm_epilogue as E

    assert E.GATE_UP_TILE == GATE_UP_TILE
    h = torch.arange(3 * GATE_UP_TILE)
    g, _ = split_gate_up(pack_gate_up(h, -h - 1, tile=GATE_UP_TILE), tile=GATE_UP_TILE)
    assert torch.equal(g, h)
    # gate_column is the kernel's map from an h column to its gate's h13 column
    packed = pack_gate_up(h, -h - 1, tile=GATE_UP_TILE)
    for c in (0, 31, 63, 64, 100, 191):
        assert packed[E.gate_column(c)] == c and packed[E.gate_column(c) + GATE_UP_TILE] == -c - 1


def _unblock(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.from_blocked_scales(buf.view(torch.float8_e8m0fnu), rows, cols).view(torch.uint8)


def _run_check(mode, acc, h13, elem, scale_mode, emit_hp):
    """The epilogue check kernel's outputs, rowwise / colwise scales unblocked to plain (rows, cols/32)."""
    from cute_mxfp8.jit import compile_epilogue_check

    fn = compile_epilogue_check(mode, str(h13.dtype).split(".")[-1], elem, scale_mode, emit_hp, "sm_90a")
    m = acc.shape[0]
    n = acc.shape[1] // 2 if mode == "swiglu" else 2 * acc.shape[1]
    mp = -(-m // 32) * 32
    dev = acc.device
    q = torch.empty(m, n, dtype=ELEMS[elem], device=dev)
    qt = torch.empty(n, mp, dtype=ELEMS[elem], device=dev)
    qs = torch.zeros(F.blocked_scales_numel(m, n // 32), dtype=torch.uint8, device=dev)
    qts = torch.zeros(F.blocked_scales_numel(n, mp // 32), dtype=torch.uint8, device=dev)
    hp = torch.empty((m, n) if emit_hp else (1, 32), dtype=torch.float32, device=dev)  # the epilogue's h is fp32
    fn(acc, h13, q, qs, qt, qts, hp)
    return q, _unblock(qs, m, n // 32), qt, _unblock(qts, n, mp // 32), hp if emit_hp else None


def _accumulator(m: int, n: int, device) -> torch.Tensor:
    acc = torch.randn(m, n, device=device) * 4
    acc[0] = 0.0  # a zero row
    if m > 3:
        acc[1, :64] = 1e4  # saturating gate and up
        acc[2, 5] = float("nan")  # poisons its rowwise block and its column's colwise block
        acc[3, :32] = -100.0  # sigmoid exactly 0
    return acc


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,i", [(200, 192), (77, 64), (256, 320)])
@pytest.mark.parametrize("elem,scale_mode,emit_hp", [("e4m3", "rceil", False), ("e5m2", "floor", True)])
def test_swiglu_epilogue_equals_standalone_kernel(m, i, elem, scale_mode, emit_hp):
    from cute_mxfp8 import ops

    acc = _accumulator(m, 2 * i, "cuda")  # GEMM1's accumulator, interleaved gate/up
    h13 = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")  # unused by the forward
    q, qs, qt, qts, hp = _run_check("swiglu", acc, h13, elem, scale_mode, emit_hp)
    rq, rqs, rqt, rqts, rhp = ops.swiglu_quant(concat_gate_up(acc, -1), scale_mode=scale_mode, elem_dtype=ELEMS[elem],
                                               blocked=False, emit_hp=emit_hp, backend="sm90")
    assert torch.equal(qs, rqs.view(torch.uint8)) and torch.equal(qts, rqts.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8))
    if emit_hp:
        torch.testing.assert_close(hp, rhp, rtol=0, atol=0, equal_nan=True)
    assert int(qs.max()) == 255 and int(qts.max()) == 255  # the NaN block is in there


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,i", [(200, 192), (77, 64), (256, 320)])
@pytest.mark.parametrize("elem,scale_mode,emit_hp", [("e4m3", "rceil", True), ("e5m2", "floor", False)])
def test_dswiglu_epilogue_equals_standalone_kernel(m, i, elem, scale_mode, emit_hp):
    from cute_mxfp8 import ops

    dh = _accumulator(m, i, "cuda")  # GEMM3's accumulator
    h13 = (torch.randn(m, 2 * i, device="cuda") * 3).to(torch.bfloat16)  # saved by the forward, interleaved
    h13[min(4, m - 1), :32] = -95.0  # sigmoid subnormal
    q, qs, qt, qts, hp = _run_check("dswiglu", dh, h13, elem, scale_mode, emit_hp)
    rq, rqs, rqt, rqts, rhp = ops.dswiglu_quant(dh, concat_gate_up(h13, -1).float(), scale_mode=scale_mode,
                                                elem_dtype=ELEMS[elem], blocked=False, emit_hp=emit_hp,
                                                backend="sm90")
    # the epilogue writes dh13 interleaved like h13: undo it
    assert_dh13_equal((q, qt, hp), (qs, qts), (rq, rqs, rqt, rqts, rhp), emit_hp)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows,k", [(1, 32), (128, 128), (300, 96), (1000, 7168), (4097, 2080)])
def test_gemm_scale_layout_gathers_to_blocked_scales(rows, k):
    from cute_mxfp8.jit import compile_scale_layout_probe

    plain = torch.randint(0, 256, (rows, k // 32), dtype=torch.uint8, device="cuda")
    buf = F.to_blocked_scales(plain.view(torch.float8_e8m0fnu)).view(torch.uint8)
    got = torch.full_like(plain, 7)
    compile_scale_layout_probe("sm_90a")(buf, got)
    assert torch.equal(got, plain)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n_tile,max_ctas,cluster", [(128, 148, (1, 1)), (256, 148, (1, 1)), (128, 7, (1, 1)),
                                                     (128, 132, (2, 1)), (256, 132, (4, 1)), (128, 8, (2, 2))])
@pytest.mark.parametrize("m,n", [(1, 8), (129, 200), (1000, 4104), (8192, 8192), (16384, 7168)])
def test_gemm_tile_schedule_covers_every_tile_once(n_tile, max_ctas, cluster, m, n):
    """The device order (the probe) is the plain-Python :func:`tile_order`: every tile once, each at the
    cluster-tile index the reference gives it."""
    from cute_mxfp8.jit import compile_tile_schedule_probe
    from cute_mxfp8.kernels.tile_scheduler import tile_order

    count = torch.zeros(-(-m // 128), -(-n // n_tile), dtype=torch.int32, device="cuda")
    order = torch.full_like(count, -1)
    compile_tile_schedule_probe(n_tile, max_ctas, "sm_90a", False, cluster)(count, order, m, n)
    assert bool((count == 1).all()), f"tiles visited {count.unique().tolist()} times"
    want = torch.full_like(count, -1)
    flat = tile_order(*count.shape, cluster, clusters=1)[0]  # one cluster: its list is the cluster-tile order
    for linear, (mt, nt) in enumerate(flat):
        for i in range(cluster[0]):
            for j in range(cluster[1]):
                if mt + i < count.shape[0] and nt + j < count.shape[1]:
                    want[mt + i, nt + j] = linear
    assert torch.equal(order, want)


@pytest.mark.gpu
@gpu
def test_persistent_grid_is_the_resident_clusters():
    """The ops' persistent grid: CUDA's occupancy answer for clusters of the ops' shape (no fallback)."""
    import warnings

    from cute_mxfp8.ops.gemm_sm100 import CLUSTER_MN, max_ctas

    size = CLUSTER_MN[0] * CLUSTER_MN[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the SM-count fallback warns
        n = max_ctas(torch.device("cuda", torch.cuda.current_device()))
    assert n % size == 0 and size <= n <= torch.cuda.get_device_properties(0).multi_processor_count
