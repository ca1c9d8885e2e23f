"""FSDP2 (``fully_shard``) with MXFP8 layers, in two processes: converted modules (``convert_to_mxfp8``) and wrapped
weights (``quantize_weights_``).  CPU: gloo; two GPUs (``-m gpu``, e.g. the nvidia-h200-x2 machine): NCCL.

Every rank trains on the same batches, so data-parallel averaging of identical gradients is exact and the sharded
run must reproduce the one-process MXFP8 run bit for bit (a plain-precision run differs, so the MXFP8 path ran).
The all-gathered bytes per step are counted; on GPUs the step time is printed."""

from __future__ import annotations

import copy
import functools
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

from cute_mxfp8 import MXFP8Config, convert_to_mxfp8, quantize_weights_
from cute_mxfp8.formats import blocked_scales_numel

D, I, E, STEPS = 64, 128, 4, 4


class _Block(nn.Module):
    """A SwiGLU FFN (w1/w2/w3 Linears), an output projection and routed-expert weights used through
    torch._grouped_mm (fixed token groups, so the run is deterministic)."""

    def __init__(self, ckpt: bool = False, experts: int = E):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, I, bias=False), nn.Linear(D, I, bias=False)
        self.w2 = nn.Linear(I, D, bias=False)
        self.proj = nn.Linear(D, D)
        self.experts_w = nn.Parameter(torch.randn(experts, D, D) * 0.05)
        self.ckpt = ckpt  # activation checkpointing: the forward runs again inside the backward

    def forward(self, x):
        if self.ckpt:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        h = self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        h = self.proj(h).flatten(0, -2)
        n, e = h.shape[0], self.experts_w.shape[0]
        ends = [n // 4, n // 4, 3 * n // 4, n] if e == 4 else [n * (j + 1) // e for j in range(e)]
        offs = torch.tensor(ends, dtype=torch.int32, device=h.device)
        return torch._grouped_mm(h, self.experts_w.transpose(-2, -1), offs=offs)


class _FFN(nn.Module):
    """torchtitan-style FeedForward (w1, w2, w3): convert_to_mxfp8 makes it one fused MXFP8SwiGLUMLP."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, I, bias=False), nn.Linear(D, I, bias=False)
        self.w2 = nn.Linear(I, D, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def _model(kind: str, seed: int, device, mxfp8: bool = True) -> nn.Module:
    """kind "wrapped": two _Blocks with quantize_weights_; "uneven": the same with 3 experts, which two ranks
    shard unevenly (2 + 1); "modules": FFN, Linear, FFN with convert_to_mxfp8; ``mxfp8=False``: the same model
    left plain."""
    torch.manual_seed(seed)
    if kind in ("wrapped", "uneven"):
        model = nn.Sequential(*(_Block(experts=3 if kind == "uneven" else E) for _ in range(2)))
    else:
        model = nn.Sequential(_FFN(), nn.Linear(D, D), _FFN())
    model.to(device)
    if mxfp8 and kind in ("wrapped", "uneven"):
        quantize_weights_(model)
    elif mxfp8:
        convert_to_mxfp8(model)
    return model


def _train(model, seed: int, device, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    losses, times = [], []
    for _ in range(steps):
        x = torch.randn(4, 32, D, generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, times


def _count_all_gathers(counter: list):
    """Wrap torch.distributed's all-gather entry points to add every call's input bytes to ``counter``."""
    for name in ("all_gather_single", "all_gather_into_tensor"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def counted(output, inp, *args, _fn=fn, **kwargs):
            counter.append(inp.numel() * inp.element_size())
            return _fn(output, inp, *args, **kwargs)
        setattr(dist, name, counted)


def _worker(rank, world, port, kind, seed, device_type, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        model = _model(kind, seed, device)
        for child in model:
            fully_shard(child)
        fully_shard(model)
        counter = []
        _count_all_gathers(counter)
        losses, times = _train(model, seed, device)
        sd = model.state_dict()
        plain = all(type(v.to_local()) is torch.Tensor for v in sd.values())
        queue.put((rank, losses, sum(counter) / STEPS, times, plain))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_fsdp(kind, seed, device_type, world=2):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, kind, seed, device_type, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def _check(kind, seed, device_type):
    device = torch.device(device_type)
    single, _ = _train(_model(kind, seed, device), seed, device)
    plain, _ = _train(_model(kind, seed, device, mxfp8=False), seed, device)
    assert single != plain  # MXFP8 numerics, not the plain GEMMs
    results = _run_fsdp(kind, seed, device_type)
    # (FSDP2 pads a shard of an uneven split to ceil(rows / 2) rows: those bytes travel too)
    hp_bytes = sum(-(-p.shape[0] // 2) * 2 * p[0].numel() * p.element_size()
                   for p in _model(kind, seed, "cpu", mxfp8=False).parameters())
    for rank, losses, gathered, times, plain_sd in results:
        assert losses == single, (rank, losses, single)
        assert plain_sd  # the sharded state dict holds plain tensors, as an unconverted model's
        # the all-gathers move the high-precision shards, twice per step (forward, and backward after the
        # reshard): each rank sends the parameter bytes (plus FSDP's shard padding)
        assert hp_bytes <= gathered <= 1.05 * hp_bytes, (gathered, hp_bytes)
    print(f"FSDP2 {kind} on 2 x {device_type}: losses {single}; all-gathered {results[0][2] / 1e3:.1f} kB per "
          f"rank per step ({hp_bytes / 1e3:.1f} kB of parameters); step times (s) {[round(t, 4) for t in results[0][3]]}")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wrapped", "uneven", "modules"])
def test_fully_shard_two_processes_reproduce_one(kind, seed):
    pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _check(kind, seed, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (the nvidia-h200-x2 machine)")
@pytest.mark.parametrize("kind", ["wrapped", "modules"])
def test_fully_shard_two_gpus_reproduce_one(kind, seed):
    _check(kind, seed, "cuda")


def test_deepcopy_of_a_wrapped_model_is_independent(seed):
    model = _model("wrapped", seed, "cpu")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].w1.weight.inner.zero_()
    assert bool(model[0].w1.weight.inner.abs().sum() > 0)


# ---- the MXFP8 all-gather (MXFP8Config(fsdp_mxfp8_all_gather=True)) -----------------------------------------------
# Scenarios, each against the bf16 all-gather of the same model (MixedPrecisionPolicy(param_dtype=bf16)):
#   mxfp8       every block its own FSDP unit (resharded after forward: rowwise in forward, colwise in backward)
#   mxfp8_root  one FSDP unit, the root (not resharded after forward: the colwise operand is gathered on demand)
#   mxfp8_ckpt  blocks under activation checkpointing (the recomputed forward gathers the rowwise one on demand)
AG_SCENARIOS = ("bf16", "mxfp8", "mxfp8_root", "mxfp8_ckpt")


def _ag_worker(rank, world, port, seed, device_type, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        counter = []
        _count_all_gathers(counter)
        out = {}
        try:
            _ag_scenarios(seed, device, counter, out)
        except Exception as exc:  # the parent reports it instead of waiting for a result that never comes
            queue.put((rank, f"{type(exc).__name__}: {exc}"))
            raise
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _ag_scenarios(seed, device, counter, out):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    for scenario in AG_SCENARIOS:
        torch.manual_seed(seed)
        model = nn.Sequential(*(_Block(ckpt=scenario == "mxfp8_ckpt") for _ in range(2))).to(device)
        quantize_weights_(model, MXFP8Config(fsdp_mxfp8_all_gather=scenario != "bf16"))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if scenario != "mxfp8_root":
            for child in model:
                fully_shard(child, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        counter.clear()
        losses, times = _train(model, seed, device)
        out[scenario] = (losses, sum(counter) / STEPS, times)


def _ag_bytes_per_rank_step(world: int) -> tuple[int, int]:
    """(MXFP8, bf16) bytes each rank sends per step: every parameter's shard twice (forward, backward)."""
    mx = bf16 = 0
    for name, p in _Block().named_parameters():
        bf16 += 2 * p.numel() // world
        if name == "experts_w":  # rowwise (e, N, K) fp8 + per-expert blocked scales
            mx += (E // world) * (D * D + blocked_scales_numel(D, D // 32))
        elif p.dim() == 2:  # fp8 + plain scales
            mx += p.numel() // world * 33 // 32
        else:
            mx += 2 * p.numel() // world  # the bias stays bf16
    return 2 * 2 * mx, 2 * 2 * bf16  # two blocks, forward + backward


def _check_mxfp8_all_gather(seed, device_type, world=2):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_ag_worker, args=(r, world, port, seed, device_type, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r[0])
    for rank, out in results:
        assert isinstance(out, dict), f"rank {rank} failed: {out}"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want_mx, want_bf16 = _ag_bytes_per_rank_step(world)
    for rank, out in results:
        base = out["bf16"][0]
        for scenario in AG_SCENARIOS[1:]:
            # bit for bit: each rank's quantized shards are the unsharded weight's MXFP8 operands
            assert out[scenario][0] == base, (rank, scenario, out[scenario][0], base)
        if world > 1:  # (FSDP2 copies instead of all-gathering in a world of one)
            assert want_bf16 <= out["bf16"][1] <= 1.05 * want_bf16, (out["bf16"][1], want_bf16)
            assert want_mx <= out["mxfp8"][1] <= 1.05 * want_mx, (out["mxfp8"][1], want_mx)
    out = results[0][1]
    print(f"FSDP2 {world} x {device_type}, bf16 params: losses {out['bf16'][0]}")
    for scenario in AG_SCENARIOS:
        losses, sent, times = out[scenario]
        ratio = f" ({sent / out['bf16'][1]:.3f} of bf16)" if out["bf16"][1] else ""
        print(f"  {scenario:11s} all-gathered {sent / 1e3:7.1f} kB per rank per step{ratio}; "
              f"step times (s) {[round(t, 4) for t in times]}")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1])
def test_mxfp8_all_gather_processes_equal_bf16_all_gather(seed, world):
    pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _check_mxfp8_all_gather(seed, "cpu", world)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp8_all_gather_gpus_equals_bf16_all_gather(seed):
    """Two GPUs over NCCL where there are two (the nvidia-h200-x2 machine); on one GPU a world of one, which runs
    the hooks, the kernels on the shards and NCCL's all-gather of the uint8 buffers."""
    _check_mxfp8_all_gather(seed, "cuda", world=min(2, torch.cuda.device_count()))
