"""Contracts of the differentiable functions and modules (issue 11), each class with the input that broke it:
one rounding of the bias; autocast changes nothing but the activation dtype; double backward raises; outputs
are not views and take in-place ops; token counts are range-checked before narrowing; grad_output of any
layout; NaN / Inf in rows past ``offs[-1]`` poison nothing; M = 0 and E = 0; activation checkpointing
(reentrant, non-reentrant, selective) is bit-equal to none.

CPU here; CUDA with ``pytest -m gpu`` (the sm90 kernels run the casts there).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cute_mxfp8 import MXFP8Config
from cute_mxfp8.nn import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP
from cute_mxfp8.ops import mxfp8_grouped_mm, mxfp8_linear, mxfp8_swiglu_mlp

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")])]
KINDS = ["linear", "mlp", "mlp_fused", "experts"]  # mlp_fused: GEMM1 / w2 dgrad as the fused-epilogue ops
D, I, E = 64, 128, 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(_bits(a), _bits(b)), what


def _module(kind: str, device, rng, hp=False):
    cfg = MXFP8Config(wgrad_with_hp=hp)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    if kind == "linear":
        return MXFP8Linear(D, 96, bias=True, device=device, config=cfg)
    if kind.startswith("mlp"):
        return MXFP8SwiGLUMLP(D, I, device=device, config=MXFP8Config(wgrad_with_hp=hp,
                                                                       fused_epilogues=kind == "mlp_fused"))
    return MXFP8GroupedExperts(D, I, E, device=device, config=cfg)


def _module_for(kind: str, lead: tuple, device, rng):
    """:func:`_module` for an input of leading dims ``lead`` (skips: grouped experts take (tokens, dim) only)."""
    if kind == "experts" and len(lead) > 1:
        pytest.skip("grouped experts take (tokens, dim)")
    return _module(kind, device, rng)


def _n(kind: str) -> int:
    """Output features of a module kind."""
    return 96 if kind == "linear" else D


def _counts(t: int, device) -> torch.Tensor:
    """Expert counts for t tokens with an empty expert and t // 5 rows past the last group."""
    used = t - t // 5
    return torch.tensor([used // 3, 0, used - used // 3], device=device)


def _call(kind, m, x, counts=None):
    if kind != "experts":
        return m(x)
    return m(x, _counts(x.shape[0], x.device) if counts is None else counts)


def _run(kind, m, x, dy, counts=None):
    """Forward + backward; returns (y, x.grad, param grads) and leaves the module's grads cleared."""
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = _call(kind, m, x, counts)
    y.backward(dy)
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _assert_runs_equal(a, b, what=""):
    _assert_bits(a[0], b[0], f"{what} output")
    _assert_bits(a[1], b[1], f"{what} input grad")
    for i, (ga, gb) in enumerate(zip(a[2], b[2])):
        _assert_bits(ga, gb, f"{what} param grad {i}")


# ---- 1. the bias is added to the fp32 accumulator, rounded once -----------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_bias_is_rounded_once_issue_example(device, bias_dtype):
    x = torch.ones(1, 32, dtype=torch.bfloat16, device=device)
    w = torch.full((32, 32), 8.0, dtype=torch.bfloat16, device=device)
    w[0, 0] = 9.0
    b = torch.zeros(32, dtype=bias_dtype, device=device)
    b[0] = 1.0
    assert mxfp8_linear(x, w, b)[0, 0].item() == 258.0  # 257 + 1, exact; bf16(257) + 1 gave 256
    lin = MXFP8Linear(32, 32, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    assert lin(x)[0, 0].item() == 258.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float32)])
def test_bias_single_rounding_on_integer_data(device, x_dtype, bias_dtype, rng):
    """Integers in [-8, 8] quantize exactly in e4m3 and their products sum exactly in fp32, so the MXFP8 result
    must be the exact ``x·wᵀ + b`` rounded once to the output dtype, bit for bit."""
    x = torch.randint(-8, 9, (256, 64), generator=rng).to(device, x_dtype)
    w = torch.randint(-8, 9, (64, 64), generator=rng).to(device, x_dtype)
    b = (torch.randint(-256, 256, (64,), generator=rng) / 4).to(device, bias_dtype)  # exact in bf16 and fp32
    want = (x.double() @ w.double().t() + b.double()).to(x_dtype)
    _assert_bits(mxfp8_linear(x, w, b), want)
    lin = MXFP8Linear(64, 64, device=device, dtype=x_dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias = torch.nn.Parameter(b)
    _assert_bits(lin(x), want)


# ---- 2. autocast: the activation in the autocast dtype, nothing else changes -----------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hp", [False, True])
def test_modules_under_autocast_equal_explicit_bf16(device, kind, hp, rng):
    m = _module(kind, device, rng, hp)
    x = torch.randn(150, D, generator=rng).to(device)
    dy = torch.randn(150, _n(kind), generator=rng).to(device, torch.bfloat16)
    want = _run(kind, m, x.bfloat16(), dy)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = _run(kind, m, x, dy)
    _assert_bits(got[0], want[0], "output")
    _assert_bits(got[1], want[1].float(), "input grad")  # autocast's cast back to fp32 is exact
    for g, w in zip(got[2], want[2]):
        _assert_bits(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mm_under_autocast_equals_explicit_bf16(device, rng):
    offs = torch.tensor([30, 30, 100], dtype=torch.int32, device=device)
    x = torch.randn(120, D, generator=rng).to(device)
    w = (torch.randn(E, I, D, generator=rng) / 8).to(device)
    dy = torch.randn(120, I, generator=rng).to(device, torch.bfloat16)

    def run(x):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mxfp8_grouped_mm(xx, ww, offs)
        y.backward(dy)
        return y.detach(), xx.grad, [ww.grad]

    want = run(x.bfloat16())
    with torch.autocast(device, dtype=torch.bfloat16):
        got = run(x)
    _assert_runs_equal((got[0], got[1].bfloat16(), got[2]), want, "grouped_mm")


def test_autocast_dtype_other_than_bf16_is_refused(rng):
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="torch.bfloat16"):
        mxfp8_linear(torch.randn(4, 64, generator=rng), torch.randn(32, 64, generator=rng))


# ---- 3. double backward raises ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["linear", "grouped_mm", "mlp", "grouped_mlp"])
def test_double_backward_raises(fn, device, rng):
    x = torch.randn(40, D, generator=rng).to(device).requires_grad_()
    offs = torch.tensor([10, 10, 40], dtype=torch.int32, device=device)
    w = (torch.randn(E, I, D, generator=rng) / 8).to(device).requires_grad_()
    w2 = (torch.randn(E, D, I, generator=rng) / 8).to(device).requires_grad_()
    call = {"linear": lambda: mxfp8_linear(x, w[0]),
            "grouped_mm": lambda: mxfp8_grouped_mm(x, w, offs),
            "mlp": lambda: mxfp8_swiglu_mlp(x, w[0], w2[0], w[1]),
            "grouped_mlp": lambda: mxfp8_swiglu_mlp(x, w, w2, w, offs=offs)}[fn]
    gx, = torch.autograd.grad(call().sum(), x)  # first order works
    assert gx.shape == x.shape and not gx.requires_grad
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(call().sum(), x, create_graph=True)


# ---- 4. outputs are not views: in-place ops work as on nn.Linear ---------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead", [(77,), (3, 40)])
def test_outputs_take_in_place_ops(kind, lead, device, rng):
    m = _module_for(kind, lead, device, rng)
    x = torch.randn(*lead, D, generator=rng).to(device)
    dy = torch.randn(*lead, _n(kind), generator=rng).to(device)
    want = _run(kind, m, x, 2 * dy)  # y.mul_(2) doubles every gradient, exactly (a power of two)
    xx = x.clone().requires_grad_()
    y = _call(kind, m, xx)
    assert not y._is_view() and y._base is None
    y.mul_(2).add_(1)  # residual-style in-place update
    y.backward(dy)
    _assert_bits(xx.grad, want[1])
    for p, g in zip(m.parameters(), want[2]):
        _assert_bits(p.grad, g)


# ---- 5. token counts are range-checked before narrowing ---------------------------------------------------

@pytest.mark.parametrize("counts,match", [
    (torch.tensor([2**32 + 24, 40]), r"num_tokens_per_expert sums to 4294967360 but x has 64"),
    (torch.tensor([2**62, 2**62]), r"num_tokens_per_expert sums to 9223372036854775808"),  # int64 sum wraps
    (torch.tensor([2**31 - 1, 10], dtype=torch.int32), r"num_tokens_per_expert sums to 2147483657"),
    (torch.tensor([-8, 40]), r"num_tokens_per_expert must be >= 0"),
    (torch.tensor([True, False]), "integer tensor"),
    ([30, 40], "sums to 70 but x has 64"),
    (torch.tensor([2**64 - 10, 20], dtype=torch.uint64), "sums to 18446744073709551626"),  # read as uint64
    ([2**64, 0], "sums to 18446744073709551616"),  # Python ints past int64
    ([1.5, 2], "integer tensor or a sequence of ints"),
    ([True, 3], "integer counts"),
])
def test_counts_are_checked_in_their_own_dtype(counts, match, rng):
    ex = MXFP8GroupedExperts(64, 64, 2)
    with pytest.raises(ValueError, match=match):
        ex(torch.randn(64, 64, generator=rng), counts)


def test_offsets_stay_inside_int32():
    """Counts that fit the tokens but not int32 offsets (only reachable with 2**31 rows) are refused too."""
    from cute_mxfp8.nn.modules import offsets_from_counts

    for counts in (torch.tensor([2**32 + 1, 0]), [2**31, 5]):
        with pytest.raises(ValueError, match="past the int32 token offsets"):
            offsets_from_counts(counts, 2, 2**33, "cpu")
    assert offsets_from_counts([], 0, 5, "cpu").shape == (0,)
    assert offsets_from_counts((3, 0, 4), 3, 9, "cpu").tolist() == [3, 3, 7]


def test_narrow_count_dtypes_do_not_wrap(rng):
    """uint8 counts summing past 255 (a uint8 cumsum would wrap) give the int64 counts' result."""
    ex = MXFP8GroupedExperts(64, 64, 2)
    x = torch.randn(320, 64, generator=rng)
    with torch.no_grad():
        _assert_bits(ex(x, torch.tensor([200, 100], dtype=torch.uint8)), ex(x, torch.tensor([200, 100])))


# ---- 6. grad_output of any layout -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_grad_output(device, kind, rng):
    m = _module(kind, device, rng)
    x = torch.randn(130, D, generator=rng).to(device)
    n = _n(kind)
    dy = torch.randn(130, n, generator=rng).to(device)
    want = _run(kind, m, x, dy)
    _assert_runs_equal(_run(kind, m, x, dy.t().contiguous().t()), want, "transposed dy")
    wide = torch.zeros(130, 2 * n, device=device)
    wide[:, ::2] = dy
    _assert_runs_equal(_run(kind, m, x, wide[:, ::2]), want, "sliced dy")
    _assert_runs_equal(_run(kind, m, x.t().contiguous().t(), dy), want, "transposed x")


# ---- 7. NaN / Inf in rows past offs[-1] poison nothing -------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["grouped_mm", "grouped_mlp", "experts"])
@pytest.mark.parametrize("hp", [False, True])
def test_rows_past_the_last_group_poison_nothing(device, fn, hp, rng):
    t, end = 150, 120
    offs = torch.tensor([40, 40, end], dtype=torch.int32, device=device)
    cfg = MXFP8Config(wgrad_with_hp=hp)
    x = torch.randn(t, D, generator=rng).to(device)
    w = (torch.randn(E, I, D, generator=rng) / 8).to(device)
    w2 = (torch.randn(E, D, I, generator=rng) / 8).to(device)
    ex = _module("experts", device, rng, hp)
    n = I if fn == "grouped_mm" else D
    dy = torch.randn(t, n, generator=rng).to(device)

    def run(x, dy):
        leaves = [a.clone().requires_grad_() for a in (x, w, w2)]
        if fn == "grouped_mm":
            y = mxfp8_grouped_mm(leaves[0], leaves[1], offs, cfg)
        elif fn == "grouped_mlp":
            y = mxfp8_swiglu_mlp(leaves[0], leaves[1], leaves[2], leaves[1] * 0.5, offs=offs, config=cfg)
        else:
            return _run("experts", ex, x, dy, counts=torch.tensor([40, 0, end - 40], device=device))
        y.backward(dy)
        return y.detach(), leaves[0].grad, [leaves[1].grad] + ([leaves[2].grad] if fn != "grouped_mm" else [])

    clean = run(x, dy)
    xp, dyp = x.clone(), dy.clone()
    xp[end:] = float("nan")
    xp[end + 1:, 3] = float("inf")
    dyp[end:] = float("nan")
    dyp[end:, 0] = -float("inf")
    poisoned = run(xp, dyp)
    _assert_runs_equal(poisoned, clean, fn)
    assert torch.all(poisoned[0][end:] == 0) and torch.all(poisoned[1][end:] == 0)


# ---- 8. M = 0 and E = 0 through every function and module ---------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty_token_batches(device, kind, lead, rng):
    m = _module_for(kind, lead, device, rng)
    x = torch.randn(*lead, D, device=device, requires_grad=True)
    y = _call(kind, m, x)
    assert y.shape == (*lead, _n(kind))
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None and torch.all(p.grad == 0) for p in m.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_zero_experts(device, rng):
    ex = MXFP8GroupedExperts(D, I, 0, device=device)
    x = torch.randn(12, D, generator=rng).to(device).requires_grad_()
    y = ex(x, torch.zeros(0, dtype=torch.int64))
    assert y.shape == (12, D) and torch.all(y == 0)
    y.sum().backward()
    assert torch.all(x.grad == 0) and all(p.grad.shape == p.shape for p in ex.parameters())
    offs = torch.zeros(0, dtype=torch.int32, device=device)
    w = torch.zeros(0, I, D, device=device, requires_grad=True)
    y = mxfp8_grouped_mm(x, w, offs)
    assert y.shape == (12, I) and torch.all(y == 0)
    y.sum().backward()
    assert w.grad.shape == (0, I, D)


# ---- 9. activation checkpointing is bit-equal to none --------------------------------------------------------

def _sac_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing: keep the GEMM outputs, recompute the casts."""
    if op in (torch.ops.cute_mxfp8.mm.default, torch.ops.cute_mxfp8.grouped_mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "selective"])
def test_activation_checkpointing_is_bit_equal(kind, mode, device, rng):
    m = _module(kind, device, rng)
    x = torch.randn(100, D, generator=rng).to(device)
    dy = torch.randn(100, _n(kind), generator=rng).to(device)
    want = _run(kind, m, x, dy)
    counts = _counts(100, device)

    class Wrapped(torch.nn.Module):
        def forward(self, x):
            fn = functools.partial(_call, kind, m, counts=counts)
            if mode == "reentrant":
                return checkpoint(fn, x, use_reentrant=True)
            kw = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _sac_policy)} \
                if mode == "selective" else {}
            return checkpoint(fn, x, use_reentrant=False, **kw)

    xx = x.clone().requires_grad_()
    y = Wrapped()(xx)
    y.backward(dy)
    _assert_bits(y.detach(), want[0])
    _assert_bits(xx.grad, want[1])
    for p, g in zip(m.parameters(), want[2]):
        _assert_bits(p.grad, g)


# ---- 10. tensors the forward made are freed during the backward; retain_graph and hooks as with save_for_backward

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hp", [False, True])
def test_retain_graph_backward_twice_gives_the_same_grads(kind, hp, device, rng):
    m = _module(kind, device, rng, hp=hp)
    x = torch.randn(100, D, generator=rng).to(device)
    dy = torch.randn(100, _n(kind), generator=rng).to(device)
    want = _run(kind, m, x, dy)
    xx = x.clone().requires_grad_()
    y = _call(kind, m, xx)
    y.backward(dy, retain_graph=True)
    first = [xx.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    y.backward(dy)  # the grads accumulate: twice the first
    _assert_bits(first[0], want[1])
    for g, w in zip(first[1:], want[2]):
        _assert_bits(g, w)
    for t, g in zip([xx] + list(m.parameters()), first):
        torch.testing.assert_close(t.grad, 2 * g, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_save_on_cpu_is_bit_equal(kind, device, rng):
    """Saved-tensor hooks (here CPU offload) see every tensor the backward needs, as with save_for_backward."""
    m = _module(kind, device, rng)
    x = torch.randn(100, D, generator=rng).to(device)
    dy = torch.randn(100, _n(kind), generator=rng).to(device)
    want = _run(kind, m, x, dy)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.cpu(), t.device

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0].to(p[1])):
        got = _run(kind, m, x, dy)
    _assert_runs_equal(got, want, kind)
    assert len(packed) >= 3  # the MXFP8 Function's colwise casts (and the weight) went through the hooks


@pytest.mark.parametrize("kind", KINDS)
def test_without_the_private_autograd_apis_every_tensor_is_saved(kind, monkeypatch, rng):
    """Where torch lacks the private functions the early release relies on (or they change signature), the
    Functions fall back to save_for_backward for every tensor: the same bytes."""
    from cute_mxfp8.ops import autograd as A

    m = _module(kind, "cpu", rng)
    x = torch.randn(100, D, generator=rng)
    dy = torch.randn(100, _n(kind), generator=rng)
    want = _run(kind, m, x, dy)
    assert isinstance(_call(kind, m, x.clone().requires_grad_()).grad_fn.made, list)  # released early here
    monkeypatch.setattr(A, "_KEEP_GRAPH", None)
    # every tensor saved: ctx.made holds how many of the saved ones the forward made (x's 2 colwise tensors for
    # the Linear; the MLP's 7: x's 2, h13, h's 2, W13's colwise pair or its Nones; the weights' colwise casts are
    # made in the backward)
    assert _call(kind, m, x.clone().requires_grad_()).grad_fn.made == (2 if kind == "linear" else 7)
    _assert_runs_equal(_run(kind, m, x, dy), want, kind)
    monkeypatch.undo()

    def other_signature():
        return None

    monkeypatch.setattr(torch._C._autograd, "_top_saved_tensors_default_hooks", other_signature)
    assert A._saved_tensor_hooks_active()
    _assert_runs_equal(_run(kind, m, x, dy), want, kind)


@pytest.mark.parametrize("kind", ["linear", "mlp", "experts"])
def test_a_backward_after_one_that_raised_says_to_run_the_forward_again(kind, monkeypatch, rng):
    """The backward frees the tensors its forward made as it goes, so one that raised part way (e.g. out of
    memory) cannot be retried: the next backward says so (torch's saved tensors would have survived)."""
    from cute_mxfp8.ops import autograd as A

    m = _module(kind, "cpu", rng)
    x = torch.randn(100, D, generator=rng).requires_grad_()
    y = _call(kind, m, x)
    real = A._wgrad

    def fail(*args, **kw):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(A, "_wgrad", fail)
    with pytest.raises(torch.OutOfMemoryError):
        y.sum().backward()
    monkeypatch.setattr(A, "_wgrad", real)
    with pytest.raises(RuntimeError, match="raised after it had begun freeing .* run the forward again"):
        y.sum().backward()
    _call(kind, m, x).sum().backward()  # a new forward works


def test_compiled_autograd_traces_the_backward_without_graph_breaks(rng):
    """Under compiled autograd the backward is traced: it neither queries the engine (a graph break) nor takes the
    tensors off ctx (the traced graph owns them), and gives the eager gradients."""
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    from torch._dynamo.utils import counters

    if not hasattr(ca, "_enable"):
        pytest.skip("this torch has no compiled_autograd._enable")
    m = _module("mlp", "cpu", rng)
    x = torch.randn(100, D, generator=rng)
    dy = torch.randn(100, D, generator=rng)
    want = _run("mlp", m, x, dy)
    torch._dynamo.reset()
    counters.clear()
    with ca._enable(torch.compile(backend="eager")):
        got = _run("mlp", m, x, dy)
    _assert_runs_equal(got, want, "compiled autograd")
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("fn", ["linear", "grouped_mm", "mlp"])
def test_in_place_change_of_a_saved_input_is_refused(fn, rng):
    """``wgrad_with_hp`` keeps x itself for the wgrad: changing it in place before the backward raises, as
    save_for_backward does for every input."""
    cfg = MXFP8Config(wgrad_with_hp=True)
    x = torch.randn(40, D, generator=rng).requires_grad_()
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    w = (torch.randn(E, I, D, generator=rng) / 8).requires_grad_()
    w2 = (torch.randn(E, D, I, generator=rng) / 8).requires_grad_()
    xi = x * 1  # a non-leaf the function saves
    y = {"linear": lambda: mxfp8_linear(xi, w[0], config=cfg),
         "grouped_mm": lambda: mxfp8_grouped_mm(xi, w, offs, config=cfg),
         "mlp": lambda: mxfp8_swiglu_mlp(xi, w[0], w2[0], w[1], config=cfg)}[fn]()
    xi.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("grouped,fused", [(False, False), (False, True), (True, False), (True, True)])
def test_mlp_backward_frees_h13_before_the_w13_wgrad(grouped, fused, monkeypatch, rng):
    """The SwiGLU MLP's saved h13 (M, 2I) and W13's colwise cast are gone (no reference left) when the last GEMM,
    the w13 wgrad, is queued: the backward's peak no longer holds them beside its outputs."""
    import weakref

    from cute_mxfp8.ops import api, autograd as A

    refs, at_last = [], []
    for name in ("dswiglu_quant", "mm_dswiglu_quant"):
        real = getattr(api, name)

        def spy(*args, real=real, **kw):
            refs.append(weakref.ref(args[-1]))  # h13, both ops' last positional argument
            return real(*args, **kw)

        monkeypatch.setattr(api, name, spy)
    real_wgrad = A._wgrad

    def wgrad(*args, **kw):
        at_last.append([r() is None for r in refs])
        return real_wgrad(*args, **kw)

    monkeypatch.setattr(A, "_wgrad", wgrad)
    x = torch.randn(200, D, generator=rng).requires_grad_()
    e = (E,) if grouped else ()
    w1, w3 = ((torch.randn(*e, I, D, generator=rng) / 8).requires_grad_() for _ in range(2))
    w2 = (torch.randn(*e, D, I, generator=rng) / 8).requires_grad_()
    offs = torch.tensor([50, 50, 170], dtype=torch.int32) if grouped else None
    y = mxfp8_swiglu_mlp(x, w1, w2, w3, offs=offs, config=MXFP8Config(fused_epilogues=fused))
    y.backward(torch.randn_like(y))
    # the w2 wgrad (before the dSwiGLU: dy's and h's colwise casts are freed first), then the w13 wgrad
    assert len(refs) == 1 and at_last == [[], [True]]


@pytest.mark.parametrize("grouped", [False, True])
def test_fast_mode_mlp_casts_w13_colwise_in_the_backward_after_the_dswiglu(grouped, monkeypatch, rng):
    """With ``hopper_block_k=128`` the MLP's forward casts W13 rowwise only and its backward casts it colwise once
    the dSwiGLU has run (no fp8 W13 held from the forward, none beside the dSwiGLU); w1 and w3 are saved for that
    cast only when x needs a gradient, so without one an in-place weight update between forward and backward is
    not refused (as bf16 autograd would not); plain MXFP8 casts W13 once, dual, in the forward."""
    from cute_mxfp8.ops import api

    calls = []
    for name in ("quantize_gate_up", "dswiglu_quant"):
        real = getattr(api, name)

        def spy(*args, real=real, name=name, **kw):
            calls.append(kw.get("direction", "dual") if name == "quantize_gate_up" else name)
            return real(*args, **kw)

        monkeypatch.setattr(api, name, spy)
    e = (E,) if grouped else ()
    offs = torch.tensor([50, 50, 170], dtype=torch.int32) if grouped else None
    x = torch.randn(200, D, generator=rng)
    w1, w3 = ((torch.randn(*e, I, D, generator=rng) / 8).requires_grad_() for _ in range(2))
    w2 = (torch.randn(*e, D, I, generator=rng) / 8).requires_grad_()
    for cfg, want in ((MXFP8Config(hopper_block_k=128), ["rowwise", "dswiglu_quant", "colwise"]),
                      (MXFP8Config(), ["dual", "dswiglu_quant"])):
        calls.clear()
        y = mxfp8_swiglu_mlp(x.clone().requires_grad_(), w1, w2, w3, offs=offs, config=cfg)
        y.backward(torch.ones_like(y))
        assert calls == want
    calls.clear()
    y = mxfp8_swiglu_mlp(x, w1, w2, w3, offs=offs, config=MXFP8Config(hopper_block_k=128))  # no dx: no late cast
    with torch.no_grad():
        w1.mul_(2)
    y.backward(torch.ones_like(y))
    assert calls == ["rowwise", "dswiglu_quant"]
    y = mxfp8_swiglu_mlp(x.clone().requires_grad_(), w1, w2, w3, offs=offs, config=MXFP8Config(hopper_block_k=128))
    with torch.no_grad():
        w3.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # w3 is read by the backward
        y.backward(torch.ones_like(y))


@pytest.mark.parametrize("fn", ["linear", "grouped_mm", "mlp_w2"])
@pytest.mark.parametrize("sb", [32, 128])
def test_weights_are_cast_colwise_in_the_backward_right_before_their_dgrad(fn, sb, monkeypatch, rng):
    """The weight's forward cast is rowwise only; its dgrad operand is cast colwise in the backward from the saved
    weight (no fp8 copy of it held from the forward to the backward, as bf16 autograd holds none), only where the
    input's gradient needs it (the MLP's W2: always, its dgrad feeds every other gradient).  So an in-place change
    of the weight between forward and backward is refused as bf16's would be, and without an input gradient it is
    not; the gradients equal the reference's product of the casts (checked bit for bit elsewhere)."""
    from cute_mxfp8.ops import api

    calls = []
    for name in ("quantize_rowwise", "quantize_colwise", "quantize_dual"):
        real = getattr(api, name)

        def spy(x, *args, real=real, name=name, **kw):
            calls.append((name, tuple(x.shape)))
            return real(x, *args, **kw)

        monkeypatch.setattr(api, name, spy)
    cfg = MXFP8Config(hopper_block_k=sb)
    offs = torch.tensor([50, 50, 170], dtype=torch.int32)
    x = torch.randn(200, D, generator=rng)
    if fn == "linear":
        w = (torch.randn(I, D, generator=rng) / 8).requires_grad_()
        run = lambda x: mxfp8_linear(x, w, config=cfg)  # noqa: E731
    elif fn == "grouped_mm":
        w = (torch.randn(E, I, D, generator=rng) / 8).requires_grad_()
        run = lambda x: mxfp8_grouped_mm(x, w, offs, config=cfg)  # noqa: E731
    else:
        w1, w3 = ((torch.randn(E, I, D, generator=rng) / 8).requires_grad_() for _ in range(2))
        w = (torch.randn(E, D, I, generator=rng) / 8).requires_grad_()
        run = lambda x: mxfp8_swiglu_mlp(x, w1, w, w3, offs=offs, config=cfg)  # noqa: E731
    shape = tuple(w.shape)
    y = run(x.clone().requires_grad_())
    assert ("quantize_rowwise", shape) in calls and all(c[1] != shape for c in calls if c[0] != "quantize_rowwise")
    calls.clear()
    y.backward(torch.ones_like(y))
    assert calls.count(("quantize_colwise", shape)) == 1  # the dgrad operand, cast now
    y = run(x.clone().requires_grad_())
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.ones_like(y))
    if fn != "mlp_w2":  # no input gradient: no dgrad, the weight is not saved
        y = run(x)
        with torch.no_grad():
            w.mul_(0.5)
        calls.clear()
        y.backward(torch.ones_like(y))
        assert ("quantize_colwise", shape) not in calls


# ---- bad inputs are refused in the forward, naming the argument --------------------------------------------------

@pytest.mark.parametrize("call,exc,match", [
    (lambda: mxfp8_linear(torch.randn(4, 64), torch.randn(40, 64)), ValueError, "out_features N=40 not a multiple"),
    (lambda: mxfp8_grouped_mm(torch.randn(8, 64), torch.randn(2, 48, 64), torch.tensor([4, 8], dtype=torch.int32)),
     ValueError, "N=48 not a multiple"),
    (lambda: mxfp8_swiglu_mlp(torch.randn(8, 64), torch.randn(48, 64), torch.randn(64, 48), torch.randn(48, 64)),
     ValueError, "I=48 not a multiple"),
    (lambda: mxfp8_grouped_mm(torch.randn(8, 64), torch.randn(2, 32, 64), None), ValueError, "offs must be"),
    (lambda: mxfp8_grouped_mm(torch.randn(8, 64), torch.randn(2, 32, 64), [4, 8]), ValueError, "got list"),
    (lambda: mxfp8_swiglu_mlp(torch.randn(8, 64), *[torch.randn(2, 32, 64)] * 3, offs=[4, 8]), ValueError, "got list"),
    (lambda: mxfp8_linear([[1.0] * 32], torch.randn(32, 32)), TypeError, "x must be a torch.Tensor"),
])
def test_bad_inputs_fail_in_the_forward(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_the_ops_name_bad_offs_and_tiles():
    from cute_mxfp8 import ops

    with pytest.raises(ValueError, match="got list"):
        ops.quantize_rowwise(torch.randn(8, 32), offs=[4, 8])
    with pytest.raises(ValueError, match="grouped GEMMs require it"):
        ops.grouped_mm(*ops.quantize_rowwise(torch.randn(8, 32)), *ops.quantize_rowwise(torch.randn(1, 32, 32)), None)
    with pytest.raises(ValueError, match="positive multiple of 32"):
        ops.quantize_gate_up(torch.randn(64, 32), torch.randn(64, 32), gate_up_tile=-32)


@pytest.mark.parametrize("k,n", [(0, 32), (64, 0)])
def test_zero_width_linear_layers(k, n, rng):
    """As nn.Linear: K = 0 gives the bias, N = 0 an empty output; gradients have the right shapes."""
    lin = MXFP8Linear(k, n)
    ref = torch.nn.Linear(k, n)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4, k, generator=rng, requires_grad=True)
    y = lin(x)
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)
    y.sum().backward()
    assert x.grad.shape == x.shape and lin.weight.grad.shape == (n, k)
    torch.testing.assert_close(lin.bias.grad, torch.full((n,), 4.0))


# ---- 10. on a kernel GPU every op of a training step has a kernel (no op passed over to the reference) ----------

@pytest.mark.parametrize("backend,kind", [("sm90", "linear"), ("sm90", "mlp"), ("sm90", "experts"), ("sm100", "linear"),
                                          ("sm100", "mlp"), ("sm100", "experts")])
def test_every_op_of_a_training_step_runs_on_the_kernel_backend(backend, kind, monkeypatch, rng):
    """The automatic choice, simulated on the CPU for an SM90 / SM100 device: each op call records the backend its
    arguments select (the reference then computes it).  An op whose arguments the kernels refuse would run on the
    fp32 emulation, an order of magnitude slower: as the dSwiGLU cast of fp32 dh with bf16 h13 once did."""
    from cute_mxfp8.ops import backends as B
    from cute_mxfp8.ops import library as L

    for name in ("sm90", "sm100"):
        monkeypatch.setattr(B._BACKENDS[name], "unavailable_reason",
                            (lambda d: None) if name == backend else (lambda d: "simulated: another arch"))
    chosen = []

    def get_impl(op, device, requested=None, args=None):
        chosen.append((op, B.resolve_backend(device, requested, op, args)))
        return B._BACKENDS["reference"].ops[op]

    monkeypatch.setattr(L, "get_impl", get_impl)
    monkeypatch.setattr(B, "make_plan", lambda *args: None)  # no launch plans of the simulated kernels
    monkeypatch.setattr(B, "PLANS", {})
    x = torch.randn(512, 256, generator=rng, dtype=torch.bfloat16).requires_grad_()
    if kind == "experts":
        y = MXFP8GroupedExperts(256, 192, 4, dtype=torch.bfloat16)(x, torch.tensor([100, 0, 250, 162]))
    elif kind == "linear":
        y = MXFP8Linear(256, 96, dtype=torch.bfloat16)(x)
    else:
        y = MXFP8SwiGLUMLP(256, 192, dtype=torch.bfloat16)(x)
    y.backward(torch.randn_like(y))
    assert len(chosen) >= 4 and all(b == backend for op, b in chosen), [c for c in chosen if c[1] != backend]
    if kind == "experts":  # the 2d-2d wgrad too, on both kernel backends
        assert "grouped_mm_wgrad" in {op for op, _ in chosen}
    fused = B._BACKENDS[backend].fuses_grouped_mlp if kind == "experts" else B._BACKENDS[backend].fuses_mlp
    if kind in ("mlp", "experts") and fused:
        assert {"mm_swiglu_quant", "mm_dswiglu_quant"} <= {op for op, _ in chosen}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("cfg", [dict(), dict(wgrad_with_hp=True), dict(hopper_block_k=128)])
def test_swiglu_mlp_frozen_subsets_get_the_same_gradients(device, grouped, cfg, rng):
    """Every non-empty subset of (x, w1, w2, w3) needing a gradient gets exactly the gradients the full backward
    gives (the backward skips dh, dx and dW13 when only w2 trains, and each wgrad whose weight is frozen), and the
    others none; with only w2 training, w2 is not saved (an in-place change of it is then allowed, as in bf16
    autograd, where dh is not computed either)."""
    import itertools

    from cute_mxfp8 import MXFP8Config
    from cute_mxfp8.ops import mxfp8_swiglu_mlp

    # CPU: the reference; CUDA: the automatic backend (the sm90 kernels on the H200), bf16 as a model runs them
    config = MXFP8Config(backend="reference" if device == "cpu" else None, **cfg)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    e, d, i, m = (3, 64, 128, 200) if grouped else (1, 64, 128, 96)
    shape = (e,) if grouped else ()

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=rng) * scale).to(device, dt)

    x = rand(m, d)
    w1, w3 = (rand(*shape, i, d, scale=0.1) for _ in range(2))
    w2 = rand(*shape, d, i, scale=0.1)
    offs = torch.tensor([50, 120, 200], dtype=torch.int32, device=device) if grouped else None
    dy = rand(m, d)

    def grads(which):
        leaves = {n: t.detach().clone().requires_grad_(n in which) for n, t in
                  (("x", x), ("w1", w1), ("w2", w2), ("w3", w3))}
        y = mxfp8_swiglu_mlp(leaves["x"], leaves["w1"], leaves["w2"], leaves["w3"], offs, config)
        y.backward(dy)
        return {n: t.grad for n, t in leaves.items()}, leaves, y

    full, _, _ = grads({"x", "w1", "w2", "w3"})
    for k in range(1, 4):
        for which in itertools.combinations(("x", "w1", "w2", "w3"), k):
            got, _, _ = grads(set(which))
            for n in ("x", "w1", "w2", "w3"):
                if n in which:
                    assert torch.equal(got[n], full[n]), (which, n)
                else:
                    assert got[n] is None
    # only w2 trains: w2 is not saved, so changing it in place before the backward is allowed (bf16 autograd
    # does not save it either: h needs no gradient)
    leaves = {n: t.detach().clone().requires_grad_(n == "w2") for n, t in (("x", x), ("w1", w1), ("w2", w2),
                                                                           ("w3", w3))}
    y = mxfp8_swiglu_mlp(leaves["x"], leaves["w1"], leaves["w2"], leaves["w3"], offs, config)
    with torch.no_grad():
        leaves["w2"].mul_(2)
    y.backward(dy)
    assert torch.equal(leaves["w2"].grad, full["w2"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["linear", "experts", "mlp", "mlp_grouped", "mlp_fast"])
def test_casts_only_what_a_gradient_reads(kind, device, monkeypatch, rng):
    """Under ``torch.no_grad`` the forward makes no colwise cast (x's for the wgrad, W13's for the dgrad) and gives
    the same bits as with grad; with x frozen the backward casts dy colwise only (its rowwise cast feeds dx), and
    in the MLP with only w2 training, too.  CPU: the reference backend, fp32; CUDA: the automatic one, bf16."""
    from cute_mxfp8.ops import api

    calls = []
    for name in ("quantize_rowwise", "quantize_colwise", "quantize_dual", "quantize_gate_up"):
        def spy(*args, real=getattr(api, name), name=name, **kw):
            calls.append(name if name != "quantize_gate_up" else f"gate_up {kw.get('direction')}")
            return real(*args, **kw)

        monkeypatch.setattr(api, name, spy)
    cfg = MXFP8Config(backend="reference" if device == "cpu" else None, hopper_block_k=128 if kind == "mlp_fast"
                      else 32)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    grouped = kind in ("experts", "mlp_grouped", "mlp_fast")
    e = (E,) if grouped else ()
    x = torch.randn(200, D, generator=rng).to(device, dt)
    offs = torch.tensor([50, 60, 200], dtype=torch.int32, device=device) if grouped else None
    ws = [(torch.randn(*e, I, D, generator=rng) / 8).to(device, dt),
          (torch.randn(*e, D, I, generator=rng) / 8).to(device, dt),
          (torch.randn(*e, I, D, generator=rng) / 8).to(device, dt)]

    def run(x, trains):
        w = [t.clone().requires_grad_(n in trains) for n, t in zip(("w1", "w2", "w3"), ws)]
        if kind == "linear":
            return mxfp8_linear(x, w[0], config=cfg)
        if kind == "experts":
            return mxfp8_grouped_mm(x, w[0], offs, config=cfg)
        return mxfp8_swiglu_mlp(x, *w, offs, config=cfg)

    with_grad = run(x.clone().requires_grad_(), {"w1", "w2", "w3"})
    calls.clear()
    with torch.no_grad():
        y = run(x.clone().requires_grad_(), {"w1", "w2", "w3"})
    _assert_bits(y, with_grad.detach())
    assert calls and not {"quantize_colwise", "quantize_dual", "gate_up colwise", "gate_up dual"} & set(calls), calls

    y = run(x, {"w1"} if kind in ("linear", "experts") else {"w2"})
    calls.clear()
    y.backward(torch.randn_like(y))
    assert calls == ["quantize_colwise"], calls  # dy's colwise cast for the one wgrad
