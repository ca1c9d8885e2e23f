"""The eager host path: launch plans of repeated casts (same bytes as the full path) and CUDA-graph capture of the
MXFP8 SwiGLU MLP forward + backward.  Host *time* is a benchmark (``bench quantize`` prints it), not a test."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cute_mxfp8 import MXFP8SwiGLUMLP, ops
from cute_mxfp8.ops import backends as B
from cute_mxfp8.ops import library as L

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)),
                         reason="needs an SM90 or SM100 GPU (run on the H200 with -m gpu)")
CASTS = {"quantize_rowwise": L.quantize_rowwise_impl, "quantize_colwise": L.quantize_colwise_impl,
         "quantize_dual": L.quantize_dual_impl}


def _bytes(outs):
    return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in outs]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(128, 128), (200, 96), (33, 64), (3, 160, 256), (2, 96, 96)])
@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("scale_block", [32, 128])
def test_planned_casts_equal_the_full_path(shape, blocked, scale_block, rng):
    """Second and later calls of a key run its launch plan: the same bytes as the op's full implementation, on
    fresh data each call, e4m3 and e5m2, blocked and plain scales, 2-D and 3-D (expert weights), 32- and
    128-blocks (the fast mode's one-launch casts), M not a multiple of 32 or 128."""
    for name, impl in CASTS.items():
        for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
            fn = getattr(ops, name)
            for i in range(3):
                x = (torch.randn(shape, generator=rng) * 4).to("cuda", torch.bfloat16)
                x[..., 0, :32] = 0  # an all-zero block
                x[..., 1, :8] *= 2.0 ** (i + 10)  # a block whose 128-block scale differs from its own
                got = fn(x, elem_dtype=elem, blocked=blocked, scale_block=scale_block)
                want = impl(x, "rceil", elem, blocked, None, "", scale_block)
                for g, w in zip(_bytes(got), _bytes(want)):
                    assert g.shape == w.shape and torch.equal(g, w), (name, elem, i)
            key = (name, x.shape, x.dtype, x.device, "rceil", elem, blocked, None, scale_block, None)
            assert B.PLANS.get(key) is not None, name  # the plan ran


def _random_offs(m: int, groups: int, rng) -> torch.Tensor:
    """Fresh CUDA offsets of ``groups`` groups over at most ``m`` rows: one empty group, and rows past
    ``offs[-1]`` unless the draw reaches ``m``."""
    ends = sorted(torch.randint(0, m + 1, (groups,), generator=rng).tolist())
    ends[1] = ends[0]
    return torch.tensor(ends, dtype=torch.int32, device="cuda")


def _planned(name: str) -> int:
    """Launch plans made (not None) for ``name`` with token groups."""
    return sum(1 for k, run in B.PLANS.items() if k[0] == name and "offs" in k and run is not None)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("scale_block", [32, 128])
@pytest.mark.parametrize("token_align", [0, 128])
def test_planned_grouped_casts_equal_the_full_path(blocked, scale_block, token_align, rng):
    """Token-group casts (dual and colwise; rowwise with blocked 128-block scales) repeat through their launch
    plans: the same bytes as the op's implementation on fresh data and fresh offsets each call (an empty group,
    rows past ``offs[-1]``, M not a multiple of 128), and a planned key still refuses bad offsets."""
    m, k = 1000, 192
    names = ["quantize_dual", "quantize_colwise"] + (["quantize_rowwise"] if blocked and scale_block == 128 else [])
    for name in names:
        fn, impl = getattr(ops, name), CASTS[name]
        extra = () if name == "quantize_rowwise" else (token_align,)
        kw = {} if name == "quantize_rowwise" else {"token_align": token_align}
        for i in range(3):
            x = (torch.randn(m, k, generator=rng) * 2.0 ** (3 * i)).to("cuda", torch.bfloat16)
            offs = _random_offs(m, 4, rng)
            got = fn(x, offs=offs, blocked=blocked, scale_block=scale_block, **kw)
            want = impl(x, "rceil", torch.float8_e4m3fn, blocked, offs, "", scale_block, *extra)
            for g, w in zip(_bytes(got), _bytes(want)):
                assert g.shape == w.shape and torch.equal(g, w), (name, i)
        assert _planned(name) >= 1, name  # the plan ran
        bad = torch.tensor([10, 20, 30, m + 1], dtype=torch.int32, device="cuda")  # the planned key's shape
        with pytest.raises(ValueError, match="offs"):
            fn(x, offs=bad, blocked=blocked, scale_block=scale_block, **kw)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["dense", "dense emit_hp fp32", "groups", "groups padded emit_hp"])
@pytest.mark.parametrize("scale_block", [32, 128])
def test_planned_swiglu_casts_equal_the_full_path(case, scale_block, rng):
    """``swiglu_quant`` / ``dswiglu_quant`` repeat through their launch plans: the same bytes as the ops'
    implementations on fresh inputs (and offsets) each call; bf16 and fp32 inputs (the 128-block casts of fp32 run
    in two launches), with and without the high-precision output, dense and with token groups."""
    m, i = 300, 256
    dtype = torch.float32 if "fp32" in case else torch.bfloat16
    emit_hp, grouped, token_align = "emit_hp" in case, "groups" in case, 128 if "padded" in case else 0
    for name in ("swiglu_quant", "dswiglu_quant"):
        for it in range(3):
            h13 = (torch.randn(m, 2 * i, generator=rng) * 2.0 ** it).to("cuda", dtype)
            dh = torch.randn(m, i, generator=rng).to("cuda", dtype)
            offs = _random_offs(m, 3, rng) if grouped else None
            tensors = (h13,) if name == "swiglu_quant" else (dh, h13)
            got = getattr(ops, name)(*tensors, emit_hp=emit_hp, offs=offs, scale_block=scale_block,
                                     token_align=token_align)
            impl = getattr(L, f"{name}_impl")
            want = impl(*tensors, "rceil", torch.float8_e4m3fn, True, emit_hp, offs, "", scale_block, token_align)
            for g, w in zip(_bytes(got), _bytes(want)):
                assert g.shape == w.shape and torch.equal(g, w), (name, it)
        assert any(k[0] == name and run is not None for k, run in B.PLANS.items()), name  # the plan ran


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scale_block", [32, 128])
def test_planned_gemms_equal_the_full_path(scale_block, rng):
    """``mm`` (with and without a bias; 128 x 128 weight blocks in the fast mode), ``grouped_mm`` and
    ``grouped_mm_wgrad`` (``split_halves`` in the fast mode) repeat through their launch plans: the same bits as
    the ops' implementations on fresh operands and offsets each call."""
    m, n, k, e = 384, 256, 256, 3
    kw = dict(scale_block=scale_block)
    b2d = scale_block == 128
    for it in range(3):
        x = torch.randn(m, k, generator=rng).to("cuda", torch.bfloat16)
        w = torch.randn(e, n, k, generator=rng).to("cuda", torch.bfloat16)
        bias = torch.randn(n, generator=rng).to("cuda", torch.bfloat16)
        a, a_s = ops.quantize_rowwise(x, **kw)
        b, b_s = ops.quantize_rowwise(w[0], blocks_2d=b2d, **kw)
        for bias_ in (None, bias):
            got = ops.mm(a, a_s, b, b_s, bias=bias_, b_blocks_2d=b2d, **kw)
            want = L.mm_impl(a, a_s, b, b_s, torch.bfloat16, "", bias_, scale_block, b2d)
            assert torch.equal(got, want), ("mm", it, bias_ is None)
        offs = _random_offs(m, e, rng)
        ga, ga_s = ops.quantize_rowwise(x, offs=offs, **kw)
        gb, gb_s = ops.quantize_rowwise(w, blocks_2d=b2d, **kw)
        got = ops.grouped_mm(ga, ga_s, gb, gb_s, offs, b_blocks_2d=b2d, **kw)
        assert torch.equal(got, L.grouped_mm_impl(ga, ga_s, gb, gb_s, offs, torch.bfloat16, "", scale_block, b2d))
        dy = torch.randn(m, n, generator=rng).to("cuda", torch.bfloat16)
        align = 128 if b2d else 0
        (ca, ca_s), (cb, cb_s) = (ops.quantize_colwise(t, offs=offs, token_align=align, **kw) for t in (dy, x))
        woffs = ops.padded_offsets(offs) if align else offs
        got = ops.grouped_mm_wgrad(ca, ca_s, cb, cb_s, woffs, split_halves=b2d, out_dtype=torch.bfloat16, **kw)
        want = L.grouped_mm_wgrad_impl(ca, ca_s, cb, cb_s, woffs, torch.bfloat16, "", scale_block, b2d)
        assert torch.equal(got, want), ("wgrad", it)
    for name in ("mm", "grouped_mm", "grouped_mm_wgrad"):
        assert any(k[0] == name and run is not None for k, run in B.PLANS.items()), name  # the plan ran


def _gate_up_key(w1, w3, blocked, blocks_2d, direction="dual"):
    return ("quantize_gate_up", w1.shape, w1.dtype, w1.device, w3.shape, w3.dtype, w3.device, "rceil",
            torch.float8_e4m3fn, blocked, 0, None, 128, blocks_2d, direction, None)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(128, 96), (2, 256, 160)])
@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("blocks_2d", [False, True])
def test_planned_gate_up_cast_equals_the_full_path(shape, blocked, blocks_2d, rng):
    """The fast mode's W13 cast from w1 and w3 (``quantize_gate_up``, 128-blocks) repeats through its plan: the
    same bytes as the op's implementation on fresh weights each call; a non-contiguous w3 takes the full path."""
    kw = dict(blocked=blocked, scale_block=128, blocks_2d=blocks_2d)
    for i in range(3):
        w1, w3 = ((torch.randn(shape, generator=rng) * 2.0 ** (4 * i)).to("cuda", torch.bfloat16) for _ in range(2))
        got = ops.quantize_gate_up(w1, w3, **kw)
        want = L.quantize_gate_up_impl(w1, w3, "rceil", torch.float8_e4m3fn, blocked, 0, "", 128, blocks_2d)
        for g, w in zip(_bytes(got), _bytes(want)):
            assert g.shape == w.shape and torch.equal(g, w), i
    assert B.PLANS.get(_gate_up_key(w1, w3, blocked, blocks_2d)) is not None  # the plan ran
    w3t = w3.transpose(-2, -1).contiguous().transpose(-2, -1)  # same values, not contiguous
    for g, w in zip(_bytes(ops.quantize_gate_up(w1, w3t, **kw)), _bytes(want)):
        assert torch.equal(g, w)
    for _ in range(2):  # the colwise pair alone (the MLP's backward call) through its own plan
        got = ops.quantize_gate_up(w1, w3, direction="colwise", **kw)
        assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(_bytes(got), _bytes(want)[2:]))


def test_gate_up_cast_keeps_no_plan_on_the_reference(rng):
    w1, w3 = torch.randn(128, 64, generator=rng), torch.randn(128, 64, generator=rng)
    a = ops.quantize_gate_up(w1, w3, scale_block=128)
    key = _gate_up_key(w1, w3, True, False)
    assert key in B.PLANS and B.PLANS[key] is None  # CPU: the reference, no plan, the full path every call
    b = ops.quantize_gate_up(w1, w3, scale_block=128)
    assert all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(a, b))
    with pytest.raises(ValueError, match="128"):  # a bad call after a planned key still gets the full checks
        ops.quantize_gate_up(w1[:96], w3[:96], scale_block=128)


def test_reference_backend_keeps_no_plan_and_keys_see_the_backend_variable(monkeypatch, rng):
    x = torch.randn(64, 64, generator=rng)
    a = ops.quantize_rowwise(x)
    key = ("quantize_rowwise", x.shape, x.dtype, x.device, "rceil", torch.float8_e4m3fn, True, None, 32, None)
    assert key in B.PLANS and B.PLANS[key] is None  # CPU: the reference, no plan, the full path every call
    b = ops.quantize_rowwise(x)
    assert all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(a, b))
    monkeypatch.setenv(B.ENV_VAR, "reference")
    ops.quantize_rowwise(x)
    assert key[:-1] + ("reference",) in B.PLANS
    monkeypatch.setenv(B.ENV_VAR, "nope")
    with pytest.raises(B.BackendUnavailableError, match="unknown cute_mxfp8 backend 'nope'"):
        ops.quantize_rowwise(x)  # a changed variable is never answered from an old plan


@pytest.mark.gpu
@gpu
def test_mlp_forward_backward_captures_into_cuda_graphs(rng):
    """torch.cuda.make_graphed_callables on MXFP8SwiGLUMLP: replays give the eager output and gradients."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    mlp = MXFP8SwiGLUMLP(256, 512).cuda()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_eager = mlp(x)
    y_eager.float().square().sum().backward()
    grads = [x.grad.clone(), *[p.grad.clone() for p in mlp.parameters()]]
    y_eager = y_eager.detach().clone()  # free the eager graph: its AccumulateGrad nodes belong to another stream
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    graphed = torch.cuda.make_graphed_callables(mlp, (x,))
    for _ in range(2):
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        y = graphed(x)
        y.float().square().sum().backward()
    assert torch.equal(y, y_eager)
    for g, want in zip([x.grad, *[p.grad for p in mlp.parameters()]], grads):
        assert torch.equal(g, want)


def _experts_pair(block: int, rng, **config):
    """Two grouped-experts modules with the same weights: CUDA counts kept on the device (the default) and
    checked on the host (``validate_counts=True``)."""
    from cute_mxfp8 import MXFP8Config, MXFP8GroupedExperts

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    kw = dict(device="cuda", dtype=torch.bfloat16, config=MXFP8Config(hopper_block_k=block, **config))
    fast = MXFP8GroupedExperts(256, 256, 4, **kw)
    checked = MXFP8GroupedExperts(256, 256, 4, validate_counts=True, **kw)
    checked.load_state_dict(fast.state_dict())
    return fast, checked


def _step(mod, x, counts, dy):
    x.grad = None
    mod.zero_grad(set_to_none=True)
    y = mod(x, counts)
    y.backward(dy)
    return [y.detach(), x.grad, *[p.grad for p in mod.parameters()]]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block", [32, 128])
def test_grouped_experts_step_never_syncs_and_equals_the_checked_path(block, rng):
    """With CUDA counts the grouped module's forward + backward reads nothing back from the GPU (sync debug mode
    "error" raises on any synchronizing call) and gives the bits of the host-checked path, with 401 rows past
    the counts' sum (more than one tail CTA of the casts) and an empty expert.  Out-of-contract counts (negative,
    summing past T) are clamped on the device: the result is that of the clamped counts."""
    fast, checked = _experts_pair(block, rng)
    x = torch.randn(900, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(900, 256, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([70, 0, 129, 300], device="cuda")
    want = _step(checked, x, counts, dy)
    _step(fast, x, counts, dy)  # first call: kernels compiled
    torch.cuda.synchronize()
    with _no_syncs():
        got = _step(fast, x, counts, dy)
    assert torch.all(got[0][499:] == 0)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    bad = torch.tensor([-5, 600, 0, 900], device="cuda")  # -> 0, 600, 0, 300 (cut at T = 900)
    got = _step(fast, x, bad, dy)
    want = _step(checked, x, torch.tensor([0, 600, 0, 300], device="cuda"), dy)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["wgrad_with_hp", "frozen_experts", "no_grad"])
def test_grouped_rowwise_only_casts_never_sync(mode, rng):
    """The 32-block grouped casts that are rowwise only (x's and dy's with ``wgrad_with_hp``, x's with frozen
    experts or under ``torch.no_grad``) read nothing back either (their offsets were made on the device: the dual
    tile kernel casts the rows past the groups) and give the host-checked path's bits.  (``wgrad_with_hp``'s
    backward still reads the offsets for its per-group fp32 wgrads: only its forward is checked for syncs.)"""
    fast, checked = _experts_pair(32, rng, wgrad_with_hp=mode == "wgrad_with_hp")
    for mod in (fast, checked):
        mod.requires_grad_(mode != "frozen_experts")
    x = torch.randn(900, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(900, 256, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([70, 0, 129, 300], device="cuda")

    def step(mod, checked_part=None):
        x.grad = None
        mod.zero_grad(set_to_none=True)
        with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
            with checked_part or contextlib.nullcontext():
                y = mod(x, counts)
                if mode == "frozen_experts":
                    y.backward(dy)
            if mode == "wgrad_with_hp":
                y.backward(dy)
        return [t for t in (y.detach(), x.grad, *[p.grad for p in mod.parameters()]) if t is not None]

    want = step(checked)
    step(fast)  # first call: kernels compiled
    torch.cuda.synchronize()
    got = step(fast, _no_syncs())
    assert len(got) == len(want) == {"wgrad_with_hp": 5, "frozen_experts": 2, "no_grad": 1}[mode]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@contextlib.contextmanager
def _no_syncs():
    """CUDA sync debug mode "error": any synchronizing call inside raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@gpu
def test_grouped_experts_capture_into_cuda_graphs(rng):
    """Sync-free, the grouped module's forward + backward captures (torch.cuda.make_graphed_callables with the
    counts as a graph input): replays give the eager output and gradients, also after the counts change."""
    fast, checked = _experts_pair(128, rng)
    x = torch.randn(640, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(640, 256, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([128, 0, 200, 290], device="cuda")
    graphed = torch.cuda.make_graphed_callables(fast, (x, counts))  # fast.forward is the graphed one from now on
    for new in ([128, 0, 200, 290], [10, 300, 0, 129]):
        counts.copy_(torch.tensor(new))
        want = _step(checked, x, counts, dy)  # eager, same weights
        x.grad = None
        fast.zero_grad(set_to_none=True)
        y = graphed(x, counts)
        y.backward(dy)
        for g, w in zip([y.detach(), x.grad, *[p.grad for p in fast.parameters()]], want):
            assert torch.equal(g, w)


def test_a_backend_plan_runs_from_the_second_call_on(rng):
    """The plan mechanism on the CPU: a probe backend (the reference's ops, a counting plan) above the others."""
    ref = B._BACKENDS["reference"]
    calls = []

    def plan(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32):
        impl = ref.ops["quantize_rowwise"]

        def run(x):
            calls.append(x.shape)
            return impl(x, scale_mode, elem_dtype, blocked, None, scale_block)
        return run

    B.register_backend(B.Backend("probe", 100, lambda d: None, ops=dict(ref.ops), plans={"quantize_rowwise": plan}))
    try:
        x = torch.randn(64, 96, generator=rng)
        outs = [ops.quantize_rowwise(x) for _ in range(3)]
        assert len(calls) == 2  # the first call took the full path
        assert all(torch.equal(o[0].view(torch.uint8), outs[0][0].view(torch.uint8)) for o in outs)
        ops.quantize_rowwise(x.t().contiguous().t())  # not contiguous: the full path, no plan
        ops.quantize_rowwise(x.requires_grad_())  # requires grad with grad mode on: the custom op, no plan
        assert len(calls) == 2
        with pytest.raises(ValueError, match="scale_block"):  # 32.0 == 32 as a key: never answered by the plan
            ops.quantize_rowwise(x.detach(), scale_block=32.0)
        assert len(calls) == 2
    finally:
        del B._BACKENDS["probe"]
        B.register_backend(ref)  # restores the order and drops the probe's plans
    assert not B.PLANS


def test_grouped_and_swiglu_plans_run_from_the_second_call_on(rng):
    """Token-group casts and the SwiGLU casts take launch plans too (the mechanism on the CPU: a probe backend
    with counting plans): the plan gets each call's ``offs``, a new offsets shape or ``token_align`` is a new
    key, and a call whose flag has another type (``emit_hp=1``) is never answered by a plan."""
    ref = B._BACKENDS["reference"]
    calls = []

    def dual_plan(x, scale_mode, elem_dtype, blocked, offs=None, scale_block=32, token_align=0):
        impl = ref.ops["quantize_dual"]

        def run(x, offs=None):
            calls.append(("dual", None if offs is None else offs.tolist()))
            return impl(x, scale_mode, elem_dtype, blocked, offs, scale_block, token_align)
        return run

    def swiglu_plan(h13, scale_mode, elem_dtype, blocked, emit_hp, offs=None, scale_block=32, token_align=0):
        impl = ref.ops["swiglu_quant"]

        def run(h13, offs):
            calls.append(("swiglu", None if offs is None else offs.tolist()))
            return impl(h13, scale_mode, elem_dtype, blocked, emit_hp, offs, scale_block, token_align)
        return run

    B.register_backend(B.Backend("probe", 100, lambda d: None, ops=dict(ref.ops),
                                 plans={"quantize_dual": dual_plan, "swiglu_quant": swiglu_plan}))
    try:
        x = torch.randn(256, 64, generator=rng)
        first = ops.quantize_dual(x, offs=torch.tensor([100, 256], dtype=torch.int32), token_align=128)
        again = ops.quantize_dual(x, offs=torch.tensor([100, 256], dtype=torch.int32), token_align=128)
        assert calls == [("dual", [100, 256])]  # the first call took the full path
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(first, again))
        ops.quantize_dual(x, offs=torch.tensor([3, 90], dtype=torch.int32), token_align=128)
        assert calls[-1] == ("dual", [3, 90])  # each call's offsets
        ops.quantize_dual(x, offs=torch.tensor([3, 90], dtype=torch.int32))  # token_align 0: another key
        ops.quantize_dual(x, offs=torch.tensor([3, 90, 256], dtype=torch.int32), token_align=128)  # 3 groups: too
        assert len(calls) == 2
        h13 = torch.randn(64, 128, generator=rng)
        outs = [ops.swiglu_quant(h13, offs=o) for o in (None, None, torch.tensor([40, 64], dtype=torch.int32),
                                                        torch.tensor([10, 20], dtype=torch.int32))]
        assert calls[2:] == [("swiglu", None), ("swiglu", [10, 20])]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outs[0], outs[1]))
        with pytest.raises(TypeError, match="emit_hp"):  # 1 == True as a key: never answered by the plan
            ops.swiglu_quant(h13, emit_hp=1)
        assert len(calls) == 4
    finally:
        del B._BACKENDS["probe"]
        B.register_backend(ref)
    assert not B.PLANS


def test_gemm_plans_skip_the_checks_and_run_the_op(monkeypatch, rng):
    """A GEMM's launch plan is the backend's op itself (``backends.same_op_plans``): from the second call of a
    key on, the library's implementation (its checks, the backend choice) is skipped and the op runs; a call with
    another shape, a bias, or a flag of another type goes the full way."""
    ref = B._BACKENDS["reference"]
    ran = []
    ops_ = {**ref.ops, "mm": lambda *args: ran.append("mm") or ref.ops["mm"](*args)}
    B.register_backend(B.Backend("probe", 100, lambda d: None, ops=ops_, plans=B.same_op_plans(ops_, ["mm"])))
    full = []
    impl = L.mm_impl
    monkeypatch.setattr(L, "mm_impl", lambda *args: full.append(1) or impl(*args))
    try:
        (a, a_s), (b, b_s) = (ops.quantize_rowwise(torch.randn(r, 64, generator=rng)) for r in (32, 96))
        outs = [ops.mm(a, a_s, b, b_s) for _ in range(3)]
        assert ran == ["mm"] * 3 and len(full) == 1  # calls 2 and 3 ran the plan
        assert all(torch.equal(o, outs[0]) for o in outs)
        ops.mm(a, a_s, b, b_s, bias=torch.zeros(96))  # a bias: another key
        with pytest.raises(ValueError, match="scale_block"):  # 32.0 == 32 as a key: never answered by the plan
            ops.mm(a, a_s, b, b_s, scale_block=32.0)
        assert len(full) == 2 and len(ran) == 4  # (the wrapper refused 32.0 before the library)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the full path runs ops with autocast off: no plan
            ops.mm(a, a_s, b, b_s)
        assert len(full) == 3 and len(ran) == 5
    finally:
        del B._BACKENDS["probe"]
        B.register_backend(ref)
    assert not B.PLANS


def test_first_calls_under_vmap_keep_no_plan(rng):
    """A first eager call under ``torch.vmap`` (batched tensors have no data pointer) takes the full path and asks
    for no plan: it gives the per-sample results, as later calls do."""
    x = torch.randn(3, 64, 64, generator=rng, dtype=torch.bfloat16) * 8
    h13 = torch.randn(3, 32, 64, generator=rng)
    for fn, inp in ((lambda t: ops.quantize_rowwise(t, blocked=False)[0].view(torch.uint8), x),
                    (lambda t: ops.swiglu_quant(t, blocked=False)[0].view(torch.uint8), h13)):
        for _ in range(2):
            got = torch.vmap(fn)(inp)
            assert torch.equal(got, torch.stack([fn(t) for t in inp]))


def test_swiglu_launchers_keep_no_input_alive():
    """A SwiGLU cast's launcher (what its launch plan keeps) holds shapes and dtypes, not the first call's tensors:
    the unfused MLP frees its GEMM1 output right after the cast."""
    import gc
    import weakref

    from cute_mxfp8.ops import cute_kernels as CK

    h13, dh = torch.randn(64, 128), torch.randn(64, 64)
    runs = [CK._swiglu_launcher("sm_90a", "fwd", (h13,), "rceil", torch.float8_e4m3fn, True, False, None, 128, 0),
            CK._swiglu_launcher("sm_90a", "bwd", (dh, h13), "rceil", torch.float8_e4m3fn, True, True, 2, 128, 128)]
    refs = [weakref.ref(h13), weakref.ref(dh)]
    del h13, dh
    gc.collect()
    assert all(r() is None for r in refs) and len(runs) == 2


def test_eager_wrappers_run_the_implementation_and_traced_calls_the_custom_op(monkeypatch, rng):
    """api's GEMM and gate/up wrappers skip the dispatcher in eager mode (plain tensors or nn.Parameter, nothing
    that requires grad under grad mode); otherwise the custom op runs.  Both give the same result."""
    from cute_mxfp8.ops import api

    seen = []
    for name in ("_mm", "_grouped_mm", "_grouped_mm_wgrad", "_quantize_gate_up"):
        op = getattr(L, name)
        monkeypatch.setattr(L, name, lambda *a, op=op, name=name: seen.append(name) or op(*a))
    x, w = torch.randn(64, 96, generator=rng), torch.randn(32, 96, generator=rng)
    (a, a_s), (b, b_s) = ops.quantize_rowwise(x), ops.quantize_rowwise(w)
    y = api.mm(a, a_s, b, b_s)
    offs = torch.tensor([20, 64], dtype=torch.int32)
    ga, ga_s = ops.quantize_rowwise(x, offs=offs)
    gb, gb_s = ops.quantize_rowwise(torch.randn(2, 32, 96, generator=rng))
    gy = api.grouped_mm(ga, ga_s, gb, gb_s, offs)
    (ca, ca_s), (cb, cb_s) = ops.quantize_colwise(x[:, :32], offs=offs), ops.quantize_colwise(x, offs=offs)
    gw = api.grouped_mm_wgrad(ca, ca_s, cb, cb_s, offs)
    w1, w3 = (torch.nn.Parameter(torch.randn(2, 32, 96, generator=rng)) for _ in range(2))
    with torch.no_grad():
        gu = api.quantize_gate_up(w1, w3)
    assert seen == []
    bias = torch.randn(32, generator=rng, requires_grad=True)  # requires grad under grad mode: the custom op
    assert torch.equal(api.mm(a, a_s, b, b_s, bias=bias.detach()), api.mm(a, a_s, b, b_s, bias=bias).detach())
    assert seen == ["_mm"]
    assert [t.view(torch.uint8).tolist() for t in api.quantize_gate_up(w1, w3)] == \
        [t.view(torch.uint8).tolist() for t in gu] and seen == ["_mm", "_quantize_gate_up"]
    assert torch.equal(L._mm(a, a_s, b, b_s, torch.bfloat16, "", None, 32), y)
    assert torch.equal(L._grouped_mm(ga, ga_s, gb, gb_s, offs, torch.bfloat16, "", 32), gy)
    assert torch.equal(L._grouped_mm_wgrad(ca, ca_s, cb, cb_s, offs, torch.float32, "", 32), gw)


def test_wrappers_name_bad_argument_types_and_meta_tensors_take_the_op(rng):
    """Bad argument types raise TypeError naming the argument on every wrapper (never an AttributeError deep in
    the op or a silent coercion); meta tensors go through the op's fake (its output shapes), not the eager path."""
    x, w = torch.randn(64, 96, generator=rng), torch.randn(32, 96, generator=rng)
    (a, a_s), (b, b_s) = ops.quantize_rowwise(x), ops.quantize_rowwise(w)
    offs = torch.tensor([20, 64], dtype=torch.int32)
    ga, ga_s = ops.quantize_rowwise(x, offs=offs)
    gb, gb_s = ops.quantize_rowwise(torch.randn(2, 32, 96, generator=rng))
    w1 = w3 = torch.randn(64, 96, generator=rng)
    bad = {
        "a must be a torch.Tensor": lambda: ops.mm(None, a_s, b, b_s),
        "bias must be a torch.Tensor": lambda: ops.mm(a, a_s, b, b_s, bias=[0.0] * 32),
        "backend must be None or a str": lambda: ops.mm(a, a_s, b, b_s, backend=0),
        "out_dtype must be a torch.dtype": lambda: ops.mm(a, a_s, b, b_s, out_dtype=5),
        "b_scales must be a torch.Tensor": lambda: ops.grouped_mm(ga, ga_s, gb, None, offs),
        "a must be a torch.Tensor ": lambda: ops.grouped_mm_wgrad(None, a_s, b, b_s, offs),
        "w1 must be a torch.Tensor": lambda: ops.quantize_gate_up(None, w3),
        "blocked must be a bool": lambda: ops.quantize_gate_up(w1, w3, blocked=1),
        "gate_up_tile must be an int": lambda: ops.quantize_gate_up(w1, w3, gate_up_tile=True),
        "emit_hp must be a bool": lambda: ops.mm_swiglu_quant(a, a_s, b, b_s, gate_up_tile=64, emit_hp=1),
        "backend must be None or a str ": lambda: ops.quantize_rowwise(x, backend=False),
    }
    for msg, call in bad.items():
        with pytest.raises(TypeError, match=msg.strip()):
            call()
    meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    y = ops.grouped_mm(meta(ga), meta(ga_s), meta(gb), meta(gb_s), meta(offs))
    assert y.device.type == "meta" and y.shape == (64, 32)
    ca, ca_s = ops.quantize_colwise(x[:, :32], offs=offs)
    cb, cb_s = ops.quantize_colwise(x, offs=offs)
    dw = ops.grouped_mm_wgrad(meta(ca), meta(ca_s), meta(cb), meta(cb_s), meta(offs))
    assert dw.device.type == "meta" and dw.shape == (2, 32, 96)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scale_block", [32, 128])
def test_grouped_dual_cast_zeroes_its_two_scale_buffers_in_one_launch(scale_block, rng):
    """A grouped dual cast (x's and dy's in the grouped step; the SwiGLU casts' too) zero-fills the padding of its
    two blocked scale buffers with one launch, then casts with one: two kernels, the reference's bytes, on buffers
    the caching allocator hands back dirty (a 0xFF-filled block freed just before)."""
    x = torch.randn(1000, 256, generator=rng).to("cuda", torch.bfloat16)
    offs = torch.tensor([100, 100, 612, 900], dtype=torch.int32, device="cuda")
    kw = dict(offs=offs, scale_block=scale_block, token_align=128 if scale_block == 128 else 0)
    want = ops.quantize_dual(x.cpu(), backend="reference", **{**kw, "offs": offs.cpu()})
    ops.quantize_dual(x, **kw)  # compiled
    torch.cuda.synchronize()
    torch.full((1 << 20,), 255, dtype=torch.uint8, device="cuda")  # freed at once: dirty memory for the outputs
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = ops.quantize_dual(x, **kw)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, kernels
    for g, w in zip(_bytes(got), _bytes(want)):
        assert torch.equal(g.cpu(), w)
