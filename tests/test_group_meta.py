"""The per-offsets cache of the grouped kernels' derived tensors (ops/group_meta.py): computed once per tensor
and key, recomputed when ``offs`` changes in place, dropped with ``offs``, never used for traced tensors."""

from __future__ import annotations

import gc

import pytest
import torch

from cute_mxfp8 import formats as F
from cute_mxfp8.ops.group_meta import cached_entries, derived


def _counter():
    calls = []

    def compute():
        calls.append(1)
        return torch.tensor([len(calls)])

    return calls, compute


def test_once_per_tensor_and_key():
    offs = torch.tensor([3, 7, 7, 12], dtype=torch.int32)
    calls, compute = _counter()
    first = derived(offs, "x", compute, 16)
    assert derived(offs, "x", compute, 16) is first and len(calls) == 1
    derived(offs, "x", compute, 32)  # another token count: another entry
    derived(offs, "y", compute, 16)  # another name: another entry
    assert len(calls) == 3
    equal = offs.clone()  # equal values, another tensor: not shared (identity, not value, is the key)
    derived(equal, "x", compute, 16)
    assert len(calls) == 4


def test_in_place_change_recomputes():
    offs = torch.tensor([3, 7], dtype=torch.int32)
    calls, compute = _counter()
    derived(offs, "x", compute)
    offs[1] = 9  # bumps the version counter
    assert int(derived(offs, "x", compute)) == 2 and len(calls) == 2


def test_entry_dies_with_its_tensor():
    before = cached_entries()
    offs = torch.tensor([1, 2], dtype=torch.int32)
    derived(offs, "x", lambda: 0)
    assert cached_entries() == before + 1
    del offs
    gc.collect()
    assert cached_entries() == before


def test_fake_tensors_are_not_cached():
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls, compute = _counter()
    with FakeTensorMode():
        offs = torch.empty(4, dtype=torch.int32)
        derived(offs, "x", compute)
        derived(offs, "x", compute)
    assert len(calls) == 2


def test_the_grouped_gemm_schedules_are_the_per_call_ones_cached():
    """What the SM90 grouped ops hand their kernels (CPU tensors here: the same torch code runs on the GPU)."""
    from cute_mxfp8 import formats as F
    from cute_mxfp8.ops import gemm_sm90 as G
    from cute_mxfp8.ops import token_layout as TL
    from cute_mxfp8.ops.gemm_common import device_offsets, group_schedule

    offs = torch.tensor([0, 1, 32, 65, 300, 300, 411], dtype=torch.int32)
    t = 450
    safe, sched = G._schedule_m(offs, t)
    assert torch.equal(safe, device_offsets(offs, t)) and torch.equal(sched, group_schedule(safe, 256))
    assert G._schedule_m(offs, t)[1] is sched  # cached
    safe, ends, sched_k = TL.schedule_k(offs, t, 16)
    _, starts, want_ends = TL.group_columns(safe, 16)
    assert torch.equal(ends, want_ends) and torch.equal(sched_k[0], starts)
    assert sched_k.shape == (2, 7) and torch.equal(sched_k[1], F.group_tile_starts(safe))
    assert TL.schedule_k(offs, t, 16)[2] is sched_k and TL.schedule_k(offs, t, 32)[2] is not sched_k
    bad = torch.tensor([5, 3, 900], dtype=torch.int32)  # out of contract: clamped, made non-decreasing
    assert G._schedule_m(bad, 100)[0].tolist() == [5, 5, 100]


def test_run_grouped_mm_launches_with_the_device_schedule_and_not_without_experts():
    """The shared 2d-3d launch path of both archs (CPU tensors and a recording stand-in for the kernel)."""
    from cute_mxfp8.ops.gemm_common import group_schedule, run_grouped_mm

    calls = []

    def kernel(*args):
        calls.append(args)
        args[4].fill_(1)  # d

    a, a_s = torch.zeros(300, 64, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    b, b_s = torch.zeros(3, 40, 64, dtype=torch.uint8), torch.zeros(3, 16, dtype=torch.uint8)
    offs = torch.tensor([100, 100, 900], dtype=torch.int32)  # out of contract: clamped to 300 on the "device"
    d = run_grouped_mm(kernel, a, a_s, b, b_s, offs, torch.float32, 256)
    assert d.shape == (300, 40) and bool((d == 1).all()) and len(calls) == 1
    _, b2, _, sfb, _, safe, sched = calls[0]
    assert b2.shape == (120, 64) and sfb.shape == (48,) and safe.tolist() == [100, 100, 300]
    assert torch.equal(sched, group_schedule(safe, 256))
    d0 = run_grouped_mm(kernel, a, a_s, b[:0], b_s[:0], offs[:0], torch.float32, 256)
    assert d0.shape == (300, 40) and bool((d0 == 0).all()) and len(calls) == 1  # E = 0: zeros, no launch


def test_run_wgrad_gathers_schedules_and_builds_only_when_it_launches(monkeypatch):
    """The shared 2d-2d launch path of both archs (CPU tensors; the gather kernel stood in for by its torch
    statement, the GEMM by a recorder): the kernel gets the aligned operands, the sanitized offsets and the
    (2, G) schedule; empty calls build nothing."""
    from cute_mxfp8.ops import token_layout as TL

    def gather(a, b, offs, ends, t, align, arch):
        src, starts = TL.aligned_token_layout(offs, t, align)
        p = torch.arange(src.numel())
        keep = torch.zeros(src.numel(), dtype=torch.bool)
        sizes = TL.group_columns(offs, align)[0]
        for s, n in zip(starts.tolist(), sizes.tolist()):
            keep[s:s + n] = True  # the kernel writes zeros after a group's tokens
        out = []
        for x in (a, b):
            y = x.index_select(1, src)
            y[:, ~keep] = 0
            out.append(y)
        assert p.numel() % align == 0 and arch == "arch"
        return tuple(out)

    monkeypatch.setattr(TL, "aligned_operands", gather)
    calls, builds = [], []

    def build():
        builds.append(1)
        return lambda *args: (calls.append(args), args[4].fill_(2))

    a = torch.arange(5 * 70, dtype=torch.int64).remainder(251).to(torch.uint8).view(5, 70)
    b = torch.arange(3 * 70, dtype=torch.int64).remainder(241).to(torch.uint8).view(3, 70)
    s_ = torch.zeros(16, dtype=torch.uint8)
    offs = torch.tensor([5, 5, 40, 900], dtype=torch.int32)  # out of contract: clamped to T = 70
    d = TL.run_wgrad(build, a, s_, b, s_, offs, torch.float32, 32, "arch")
    assert d.shape == (4, 5, 3) and bool((d == 2).all()) and len(calls) == 1
    a2, b2, _, _, flat, safe, sched = calls[0]
    assert safe.tolist() == [5, 5, 40, 70] and sched.shape == (2, 4)
    assert sched[0].tolist() == [0, 32, 32, 96]  # 32-aligned group starts (sizes 5, 0, 35, 30)
    assert torch.equal(a2[:, 96:126], a[:, 40:70]) and torch.equal(a2[:, 32:67], a[:, 5:40])
    assert bool((a2[:, 5:32] == 0).all()) and bool((a2[:, 67:96] == 0).all())  # zeros up to the next start
    assert flat.shape == (20, 3)
    for t_, g in ((0, 4), (70, 0)):  # no tokens, no groups: zeros, nothing built or launched
        z = TL.run_wgrad(build, a[:, :t_], s_, b[:, :t_], s_, offs[:g], torch.float32, 32, "arch")
        assert z.shape == (g, 5, 3) and bool((z == 0).all())
    assert len(builds) == 1 and len(calls) == 1


def test_validated_end_checks_every_call_on_one_read_per_version():
    """The grouped casts' offsets check: the values and errors of formats.validate_offsets, each call against its
    own total, on a host copy read once per tensor version (a write the version counter does not see is not
    re-read; an in-place op is)."""
    from cute_mxfp8.ops.group_meta import validated_end

    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    assert validated_end(offs, 10) == F.validate_offsets(offs, 10) == 10
    with pytest.raises(ValueError, match="exceeds the grouped dim size 9"):
        validated_end(offs, 9)
    offs.data[2] = 12  # not seen by the version counter: the cached copy answers
    assert validated_end(offs, 10) == 10
    offs.sub_(1)  # an in-place op: re-read
    assert validated_end(offs, 11) == 11
    bad = torch.tensor([4, 2], dtype=torch.int32)
    for t in (bad, bad.to(torch.int64), [1, 2]):
        with pytest.raises(ValueError) as got:
            validated_end(t, 10)
        with pytest.raises(ValueError) as want:
            F.validate_offsets(t, 10)
        assert str(got.value) == str(want.value)


def test_a_known_host_copy_spares_the_device_read():
    """The grouped module builds offs from host counts and records them: validated_end answers from that copy
    (a meta tensor has no values to read, so the answer can only come from the record)."""
    from cute_mxfp8.ops.group_meta import known_host_copy, validated_end

    host = torch.tensor([2, 5, 5], dtype=torch.int32)
    offs = host.to("meta")
    with pytest.raises(NotImplementedError):
        validated_end(offs, 8)  # nothing recorded: the device read is attempted
    known_host_copy(offs, host)
    assert validated_end(offs, 8) == 5
    with pytest.raises(ValueError, match="exceeds"):
        validated_end(offs, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 with -m gpu)")
@pytest.mark.parametrize("ends", [[0, 1, 32, 65, 300, 300, 411], [5, 3, 900], [450], [0, 0]])
def test_schedules_from_a_host_copy_equal_the_device_ones(ends):
    """With a known host copy (the grouped module's offs) the schedules are computed on the CPU and uploaded
    (group_meta.derived_tensors); without one, on the device.  Both give the same values, out-of-contract offsets
    (clamped, made non-decreasing) included, and the uploads land on offs's device."""
    from cute_mxfp8.ops import cute_kernels as CK
    from cute_mxfp8.ops import token_layout as TL
    from cute_mxfp8.ops.gemm_common import schedule_m
    from cute_mxfp8.ops.group_meta import host_copy, known_host_copy

    t = 450
    host = torch.tensor(ends, dtype=torch.int32)
    plain, known = host.cuda(), host.cuda()
    known_host_copy(known, host)
    assert host_copy(known) is host and host_copy(plain) is None
    for fn in (lambda o: schedule_m(o, t, 128), lambda o: TL.schedule_k(o, t, 128), lambda o: (CK._tile_starts(o),)):
        want, got = fn(plain), fn(known)
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert g.device == known.device and g.dtype == w.dtype and torch.equal(g, w), (ends, w, g)


def test_host_schedules_equal_the_torch_ones(rng):
    """The grouped ops' schedules computed from the host copy's Python ints (group_meta.derived_tensors' host
    path) equal the torch statements they replace, for random offsets in and out of contract (negative,
    decreasing, past T, empty groups) and every tile / align the kernels use."""
    from cute_mxfp8.ops import gemm_common as GC
    from cute_mxfp8.ops import token_layout as TL

    gen = rng
    for trial in range(300):
        g = int(torch.randint(1, 12, (), generator=gen))
        t = int(torch.randint(0, 2000, (), generator=gen))
        if trial % 3:
            ends = torch.randint(-50, t + 300, (g,), generator=gen).to(torch.int32)
        else:  # in contract: sorted, within [0, t]
            ends = torch.randint(0, t + 1, (g,), generator=gen).sort().values.to(torch.int32)
        host = ends.tolist()
        assert F.group_tile_starts_host(host) == F.group_tile_starts(ends).tolist(), host
        safe = GC.device_offsets(ends, t)
        assert GC.device_offsets_host(host, t) == safe.tolist(), (host, t)
        for tile_m in (64, 128, 256):
            assert GC.group_schedule_host(safe.tolist(), tile_m) == GC.group_schedule(safe, tile_m).tolist()
        for align in (16, 32, 128):
            _, starts, cols = TL.group_columns(safe, align)
            assert list(TL.group_columns_host(safe.tolist(), align)) == [starts.tolist(), cols.tolist()]


@pytest.mark.parametrize("counts,dtype", [
    ([3, 0, 5, 2], torch.int64), ([3, 0, 5, 2], torch.int32), ([3, 0, 5, 2], torch.uint8),
    ([7, -4, 6, 1], torch.int64), ([7, -4, 6, 1], torch.int32), ([40, 1, 0, 0], torch.uint8),
    ([0, 0, 0, 0], torch.int16), ([2**63 - 1, 1, 0, 0], torch.int64), ([2**63 - 1, 2**63 - 1, 3, 0], torch.int64)])
def test_device_offsets_from_counts_are_safe_and_equal_the_checked_ones(counts, dtype):
    """The grouped module's sync-free offsets: valid counts give offsets_from_counts' values; any others give
    non-decreasing offsets within [0, T] (negative counts as 0, groups cut at T, no int64 wrap), in int32."""
    from cute_mxfp8.nn.modules import device_offsets_from_counts, offsets_from_counts

    t = 12
    c = torch.tensor(counts, dtype=dtype)
    got = device_offsets_from_counts(c, 4, t)
    assert got.dtype == torch.int32 and got.shape == (4,)
    want = []
    for v in c.tolist():
        want.append(min(t, (want[-1] if want else 0) + max(v, 0)))
    assert got.tolist() == want
    if min(c.tolist()) >= 0 and sum(c.tolist()) <= t:
        assert torch.equal(got, offsets_from_counts(c, 4, t, "cpu"))
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([1.0, 2, 3, 4]), torch.tensor([True] * 4)):
        with pytest.raises(ValueError, match=r"integer tensor of shape \(4,\)"):
            device_offsets_from_counts(bad, 4, t)


def test_safe_offsets_are_not_read_on_the_host(monkeypatch):
    """check_offsets reads (validated_end) every offsets tensor except one mark_safe vouched for with a row count
    at most the op's; an in-place change drops the mark, and a device-made padded_offsets of safe offsets is known
    to be aligned (the wgrad then skips its gather without host values)."""
    from cute_mxfp8.ops import group_meta as GM, token_layout as TL
    from cute_mxfp8.nn.modules import device_offsets_from_counts

    reads = []
    real = GM.validated_end
    monkeypatch.setattr(GM, "validated_end", lambda o, t: reads.append(t) or real(o, t))
    offs = device_offsets_from_counts(torch.tensor([3, 0, 5]), 3, 10)
    GM.check_offsets(offs, 10)
    GM.check_offsets(offs, 64)
    assert reads == []
    GM.check_offsets(offs, 9)  # fewer rows than vouched for: read and checked (offs[-1] = 8 fits)
    assert reads == [9]
    with pytest.raises(ValueError, match="exceeds"):
        GM.check_offsets(offs, 7)
    plain = torch.tensor([3, 3, 8], dtype=torch.int32)
    GM.check_offsets(plain, 10)
    assert reads[-1] == 10
    padded = TL.padded_offsets(offs, 128)
    assert padded.tolist() == [128, 128, 256] and TL._groups_aligned(padded, 128 * (10 // 128 + 3), 128)
    assert not TL._groups_aligned(TL.padded_offsets(plain.clone(), 128), 384, 128)  # no mark, no host copy
    offs.add_(0)  # in place: the mark is gone
    reads.clear()
    GM.check_offsets(offs, 10)
    assert reads == [10]


_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the schedule kernel's build here is sm_90a: needs an SM90 GPU (run on the H200 with -m gpu)")])
_COUNTS = [[5], [0, 300], [128, 0, 129], [1, 2, 3, 700], [0, 0, 0, 0, 256], [1] * 33, [0] * 40 + [129],
           [int(c) for c in torch.randint(0, 400, (101,), generator=torch.Generator().manual_seed(5))]]


@pytest.mark.parametrize("device", ["cpu", _GPU])
@pytest.mark.parametrize("counts", _COUNTS, ids=lambda c: f"G{len(c)}-{sum(c)}")
def test_primed_fast_schedules_equal_the_lazy_ones_and_are_what_the_users_get(counts, device):
    """prime_fast_schedules records, in one buffer, the values every fast-mode user computes lazily (casts' tile
    starts, 2d-3d and 2d-2d schedules, padded offsets and their alignment), under the keys those users look up:
    each call below returns a primed view (inside the buffer), equal to the same call on an unprimed copy.  On
    the GPU the buffer comes from the schedule kernel (one warp; more than 32 groups give lanes several)."""
    from cute_mxfp8.nn.modules import device_offsets_from_counts
    from cute_mxfp8.ops import cute_kernels as CK, gemm_common as GC, token_layout as TL

    t = sum(counts) + 70
    offs = device_offsets_from_counts(torch.tensor(counts, device=device), len(counts), t)
    lazy = offs.clone()
    TL.prime_fast_schedules(offs, t, "sm_90a" if device == "cuda" else None)
    tp = 128 * (t // 128 + len(counts))

    def calls(o):
        padded = TL.padded_offsets(o, 128)
        return [CK._tile_starts(o), *GC.schedule_m(o, t, 128), padded, *TL.schedule_k(padded, tp, 128)]

    got, want = calls(offs), calls(lazy)
    base = got[0].untyped_storage().data_ptr()
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g, w)
        same_as_offs = g.data_ptr() == offs.data_ptr()  # device_offsets of safe offsets: offs' own storage
        assert same_as_offs or g.untyped_storage().data_ptr() == base and g.data_ptr() % 16 == 0
    assert TL._groups_aligned(got[3], tp, 128)
    other = device_offsets_from_counts(torch.tensor(counts, device=device), len(counts), t + 1)
    TL.prime_fast_schedules(other, t)  # vouched for another row count: nothing recorded
    from cute_mxfp8.ops.group_meta import recorded

    assert recorded(offs, "tile_starts") is got[0] and recorded(other, "tile_starts") is None


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100f"])
def test_fast_schedule_kernel_compiles(arch):
    """One warp: the lane scan's 5 shuffles, six stores per group, no local memory."""
    from cute_mxfp8.jit import compile_fast_schedules

    ptx = compile_fast_schedules(arch, keep_ptx=True).__ptx__
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("shfl.sync.up") == 5 and ptx.count("st.global") % 6 == 0


def test_prime_fast_schedules_takes_torch_ops_without_an_arch_or_on_the_cpu(monkeypatch):
    """``arch`` picks the kernel for CUDA offsets only; CPU offsets (and ``arch=None``) take torch ops."""
    from cute_mxfp8.nn.modules import device_offsets_from_counts
    from cute_mxfp8.ops import token_layout as TL

    def refuse(arch):
        raise AssertionError("the schedule kernel is for CUDA offsets")

    monkeypatch.setattr(TL, "compile_fast_schedules", refuse)
    offs = device_offsets_from_counts(torch.tensor([3, 0, 300]), 3, 400)
    TL.prime_fast_schedules(offs, 400, "sm_90a")
    assert TL.padded_offsets(offs, 128).tolist() == [128, 128, 512]


def test_primed_offsets_are_freed_with_their_tensor():
    """No primed entry keeps the offsets tensor it is keyed on alive: a training loop's per-step offsets (and the
    padded offsets made from them) leave the cache when the step drops them."""
    from cute_mxfp8.nn.modules import device_offsets_from_counts
    from cute_mxfp8.ops import token_layout as TL

    gc.collect()
    before = cached_entries()
    for _ in range(5):
        offs = device_offsets_from_counts(torch.tensor([3, 0, 300]), 3, 400)
        TL.prime_fast_schedules(offs, 400)
        TL.schedule_k(TL.padded_offsets(offs, 128), 128 * (400 // 128 + 3), 128)
        del offs
        gc.collect()
    assert cached_entries() == before


def test_inference_tensors_are_not_cached_and_still_checked():
    """Inference tensors have no version counter: nothing is recorded for them, and the checks read them as any
    other offsets.  The module's offsets are made as normal tensors under inference mode, so they keep their mark
    (no host read there either); numpy and symbolic sizes are taken."""
    import numpy as np
    from torch.fx.experimental.proxy_tensor import make_fx

    from cute_mxfp8.nn.modules import device_offsets_from_counts, offsets_from_counts
    from cute_mxfp8.ops.group_meta import check_offsets, known_host_copy, safe_bound

    with torch.inference_mode():
        offs = torch.tensor([3, 7], dtype=torch.int32)
        known_host_copy(offs, offs.clone())  # not recorded, no error
        mark_offs = device_offsets_from_counts(torch.tensor([3, 4]), 2, np.int64(10))
        assert mark_offs.tolist() == [3, 7] and not mark_offs.is_inference() and safe_bound(mark_offs) == 10
        assert not offsets_from_counts([3, 4], 2, 10, "cpu").is_inference()
        check_offsets(offs, 10)
        with pytest.raises(ValueError, match="exceeds"):
            check_offsets(offs, 6)
    args = (torch.randn(10, 4), torch.tensor([3, 4]))
    gm = make_fx(lambda x, c: device_offsets_from_counts(c, 2, x.shape[0]), tracing_mode="symbolic")(*args)
    assert gm(torch.randn(12, 4), torch.tensor([9, 9])).tolist() == [9, 12]


@pytest.mark.parametrize("args,match", [
    (([3, 4], 2, 10), "must be an integer tensor"), ((torch.tensor([3, 4]), 2, -1), "num_tokens must be an int"),
    ((torch.tensor([3, 4]), 2, 12.5), "num_tokens must be an int >= 0, got 12.5"),
    ((torch.tensor([3, 4]), True, 9), "num_experts"),
    ((torch.tensor([3, 4]), 2, 2**31), "past the int32 token offsets")])
def test_device_offsets_refuse_bad_arguments(args, match):
    from cute_mxfp8.nn.modules import device_offsets_from_counts

    with pytest.raises(ValueError, match=match):
        device_offsets_from_counts(*args)


def test_the_fast_grouped_mlp_primes_offsets_made_safe_on_the_device(rng):
    """mxfp8_swiglu_mlp in the fast mode primes the schedules of offsets vouched for on the device (what the grouped
    module and the torchtitan experts pass), so its callers need not; 32-blocks and unmarked offsets stay lazy."""
    from cute_mxfp8 import MXFP8Config
    from cute_mxfp8.nn.modules import device_offsets_from_counts
    from cute_mxfp8.ops import mxfp8_swiglu_mlp
    from cute_mxfp8.ops.group_meta import recorded

    x = torch.randn(160, 64, generator=rng)
    ws = [torch.randn(3, 128, 64, generator=rng), torch.randn(3, 64, 128, generator=rng),
          torch.randn(3, 128, 64, generator=rng)]
    for block, primed in ((128, True), (32, False)):
        offs = device_offsets_from_counts(torch.tensor([100, 0, 28]), 3, 160)
        unmarked = offs.clone()
        cfg = MXFP8Config(hopper_block_k=block)
        assert torch.equal(mxfp8_swiglu_mlp(x, *ws, offs, cfg), mxfp8_swiglu_mlp(x, *ws, unmarked, cfg))
        assert (recorded(offs, "tile_starts") is not None) == primed and recorded(unmarked, "tile_starts") is None


def test_lookups_record_nothing_and_the_aligned_layout_helpers_keep_their_formulas():
    """host_copy / safe_bound only look (no cache entry left behind for an unseen tensor); aligned_width is the
    documented bound (M + align * G), split_halves puts every group's first halves before all second halves, and
    the 2d-2d wgrad limits take no groups as nothing to launch and refuse aligned operands past int32 indexing."""
    from cute_mxfp8 import ops
    from cute_mxfp8.ops import gemm_sm100, group_meta
    from cute_mxfp8.ops import token_layout as TL

    o = torch.tensor([1], dtype=torch.int32)
    n = cached_entries()
    assert group_meta.host_copy(o) is None and group_meta.safe_bound(o) is None
    assert cached_entries() == n
    assert TL.aligned_width(100, 3, 16) == 160 and TL.aligned_width(0, 0, 128) == 0
    assert TL.split_halves(torch.arange(8.).view(2, 4, 1)).flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    none = torch.empty(0, dtype=torch.int32)  # no groups: nothing launches, so no operand is refused
    a, a_s = ops.quantize_colwise(torch.randn(70, 64), offs=none)
    odd = torch.empty(a.shape[0] + 1, 70, dtype=a.dtype)[1:]  # contiguous, not 16-byte aligned
    assert odd.data_ptr() % 16 and gemm_sm100.LIMITS["grouped_mm_wgrad"](odd, a_s, odd, a_s, none, torch.float32) is None
    e4, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    s16 = torch.empty(16, dtype=e8, device="meta")
    big = TL.wgrad_limits(torch.empty(32, 2**15 - 1, dtype=e4, device="meta"), s16,
                          torch.empty(2**16, 2**15 - 1, dtype=e4, device="meta"), s16,
                          torch.tensor([2**15 - 1], dtype=torch.int32, device="meta"), 32)
    assert big is not None and "would exceed 2147483647 elements" in big
