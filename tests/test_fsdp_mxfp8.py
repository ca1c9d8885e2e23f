"""The FSDP2 MXFP8 all-gather's pieces in one process (cute_mxfp8.nn.fsdp); the multi-process runs are in
tests/test_fsdp.py.  Each rank's quantized shard, all-gathered and assembled, must be byte for byte the MXFP8
operand of the unsharded weight, and every way the mode cannot hold must raise naming the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cute_mxfp8 import MXFP8Config, quantize_weights_
from cute_mxfp8.nn import fsdp
from cute_mxfp8.nn.weight import MXFP8TrainingWeight
from cute_mxfp8.ops import api

CFG = MXFP8Config(fsdp_mxfp8_all_gather=True)


def _weight(shape, gen, dtype):
    w = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 4
    flat = w.view(-1, shape[-1])
    flat[0] = 0.0  # an all-zero row: zero scales
    flat[1, :32] = 3e-40  # fp32 subnormals (flushed in bf16): the smallest E8M0 scale
    flat[2, 5] = 1e4  # one large value: the others of its block fall into e4m3's subnormal range
    return w.to(dtype)


def _gathered(w, kind, world):
    """What FSDP's all-gather hands fsdp_post_all_gather: each rank's inputs concatenated along dim 0."""
    shards = w.chunk(world, dim=0)
    per_rank = [fsdp._shard_operands(s, kind, CFG) for s in shards]
    return [torch.cat([r[i] for r in per_rank]) for i in range(2)]


@pytest.mark.parametrize("shape,world", [((128, 96), 2), ((256, 160), 4), ((64, 32), 2), ((4, 64, 96), 2),
                                         ((6, 96, 64), 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_assembled_operands_equal_quantizing_the_unsharded_weight(shape, world, dtype, rng):
    w = _weight(shape, rng, dtype)
    want = {"row": api.quantize_rowwise(w), "col": api.quantize_colwise(w)}
    for kind in ("row", "col"):
        parts = _gathered(w, kind, world)
        # the two kinds send the same sizes (FSDP2 allocates its all-gather buffers once)
        assert [p.numel() for p in parts] == [p.numel() for p in _gathered(w, "col" if kind == "row" else "row", world)]
        data, scales = fsdp._assemble(kind, parts, shape, world, CFG.elem_dtype)
        want_data, want_scales = want[kind]
        assert data.shape == want_data.shape and data.dtype == want_data.dtype
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)), kind
        assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8)), kind


class _Mesh:
    """The part of a DeviceMesh the pre-all-gather hook uses."""
    ndim = 1

    def __init__(self, world):
        self.world = world

    def size(self, dim=None):
        return self.world

    def get_group(self, dim=None):
        return None


@pytest.mark.parametrize("shape,world,why", [((96, 64), 2, "32-row"), ((100, 64), 3, "not divisible"),
                                             ((5, 64, 64), 2, "not divisible")])
def test_shardings_that_split_blocks_raise(shape, world, why):
    w = MXFP8TrainingWeight(torch.randn(shape), CFG)
    local = w.chunk(world)[0]
    with pytest.raises(ValueError, match=why) as err:
        local.fsdp_pre_all_gather(_Mesh(world), torch.Size(shape), None, None, None)
    assert "fsdp_mxfp8_all_gather=False" in str(err.value)


def _unsharded(shape, world, rng, kind="row"):
    """An MXFP8GatheredWeight as FSDP2 builds it from the hooks (no process group: the kind given is present)."""
    w = MXFP8TrainingWeight(_weight(shape, rng, torch.float32), CFG)
    local = w.chunk(world)[0]
    inputs, meta = local.fsdp_pre_all_gather(_Mesh(world), torch.Size(shape), None, None, None)
    assert meta[0] == "row"  # outside the autograd engine: the forward's operand
    meta = (kind, *meta[1:])
    gw, inner = local.fsdp_post_all_gather(tuple(_gathered(w.inner, kind, world)), meta, torch.float32)
    return w, gw


def test_unsharded_weight_runs_linear_views_and_refuses_other_ops(rng):
    w, gw = _unsharded((64, 96), 2, rng)
    assert isinstance(gw, fsdp.MXFP8GatheredWeight) and gw.shape == (64, 96) and gw.dtype == torch.float32
    param = nn.Parameter(torch.as_strided(gw, (64, 96), (96, 1)))  # what FSDP2 does with it
    assert type(param) is fsdp.MXFP8GatheredWeight and param.requires_grad
    x = torch.randn(5, 96, generator=rng)
    # forward from the gathered operand = the wrapped (unsharded) weight's MXFP8 linear
    y = F.linear(x, param)
    assert torch.equal(y, F.linear(x, w))
    assert type(param.t()) is fsdp.MXFP8GatheredWeight and param.t().shape == (96, 64)
    for use in (lambda: x @ param.t(), lambda: param + 1, lambda: F.embedding(torch.tensor([1]), param),
                lambda: param.sum()):
        with pytest.raises(RuntimeError, match="fsdp_mxfp8_all_gather=False"):
            use()


def test_grouped_mm_on_the_unsharded_weight_matches_the_wrapped_weight(rng):
    w, gw = _unsharded((4, 64, 96), 2, rng)
    x = torch.randn(40, 96, generator=rng)
    offs = torch.tensor([8, 8, 30, 40], dtype=torch.int32)
    y = torch._grouped_mm(x, gw.transpose(-2, -1), offs=offs)
    assert torch.equal(y, torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def test_backward_without_the_colwise_operand_needs_a_process_group(rng):
    """The colwise operand of a weight gathered rowwise is all-gathered on demand: with no process group that
    is torch.distributed's error, not a wrong gradient."""
    _, gw = _unsharded((64, 96), 2, rng)
    param = nn.Parameter(gw)
    F.linear(torch.randn(5, 96, generator=rng), param).sum().backward()
    assert param.grad.shape == (64, 96)  # the wgrad needs no weight operand
    x = torch.randn(5, 96, generator=rng, requires_grad=True)
    with pytest.raises((RuntimeError, ValueError)):
        F.linear(x, param).sum().backward()


def test_config_flag_and_tied_embeddings():
    with pytest.raises(ValueError, match="fsdp_mxfp8_all_gather"):
        MXFP8Config(fsdp_mxfp8_all_gather=1)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
    model[1].weight = model[0].weight  # tied (64, 32)
    quantize_weights_(model, CFG)
    assert model[0].weight is model[1].weight
    assert not model[1].weight.config.fsdp_mxfp8_all_gather  # the embedding needs its high-precision values
    assert model[2].weight.config.fsdp_mxfp8_all_gather


def test_world_of_one_sends_one_packed_buffer(rng):
    """FSDP2 passes only the first all-gather input through in a world of one: both parts travel as one buffer."""
    w = MXFP8TrainingWeight(_weight((64, 96), rng, torch.float32), CFG)
    inputs, meta = w.fsdp_pre_all_gather(_Mesh(1), torch.Size((64, 96)), None, None, None)
    assert len(inputs) == 1 and inputs[0].dtype == torch.uint8 and inputs[0].numel() == 64 * 96 * 33 // 32
    gw, _ = w.fsdp_post_all_gather((inputs[0].clone(),), meta, torch.float32)
    x = torch.randn(3, 96, generator=rng)
    assert torch.equal(F.linear(x, gw), F.linear(x, w))


def test_misuse_raises_naming_the_fix(rng):
    """Wrapping after fully_shard, a non-Shard(0) placement, an fp16 MixedPrecisionPolicy and torch.compile of the
    gathered weight all raise before anything runs, naming what to do instead."""
    class _Sharded(torch.Tensor):  # stands in for a DTensor parameter (what fully_shard leaves behind)
        _local_tensor = None

    model = nn.Sequential(nn.Linear(64, 64))
    model[0].weight = nn.Parameter(torch.randn(64, 64).as_subclass(_Sharded))
    with pytest.raises(ValueError, match="before fully_shard"):
        quantize_weights_(model, CFG)

    w = MXFP8TrainingWeight(torch.randn(64, 96), CFG)
    with pytest.raises(ValueError, match="Shard\\(0\\)"):
        w[:, :48].fsdp_pre_all_gather(_Mesh(2), torch.Size((64, 96)), None, None, None)

    class _Policy:
        param_dtype = torch.float16
    with pytest.raises(ValueError, match="param_dtype=torch.bfloat16"):
        w.chunk(2)[0].fsdp_pre_all_gather(_Mesh(2), torch.Size((64, 96)), None, None, _Policy())

    _, gw = _unsharded((64, 96), 2, rng)
    x = torch.randn(4, 96, generator=rng)
    with pytest.raises(Exception, match="eager mode only"):
        torch.compile(lambda x: F.linear(x, gw), backend="eager", fullgraph=True)(x)


def test_uneven_shard_error_names_the_parameter():
    model = nn.Sequential(nn.Linear(64, 96, bias=False))
    quantize_weights_(model, CFG)
    model[0].weight = nn.Parameter(model[0].weight.chunk(2)[0])  # the module holds the shard, as under fully_shard
    with pytest.raises(ValueError, match="Linear.weight"):
        model[0].weight.fsdp_pre_all_gather(_Mesh(2), torch.Size((96, 64)), None, model[0], None)
