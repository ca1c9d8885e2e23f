"""The weight-wrapper subclass (``MXFP8TrainingWeight`` / ``quantize_weights_``): MXFP8 training without a module
swap.  CPU reference backend; the same code runs the kernels on a GPU."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compile_checks import assert_compile_matches_eager
from cute_mxfp8 import MXFP8Config, MXFP8Linear, MXFP8TrainingWeight, quantize_weights_
from cute_mxfp8.ops import mxfp8_grouped_mm

# cpu: the reference backend; cuda (the H200, -m gpu): the kernels
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 with -m gpu)")])]


class _Experts(nn.Module):
    """Grouped SwiGLU experts calling torch._grouped_mm as torchtitan 0.3 does (bf16 casts, transposed weights)."""

    def __init__(self, e=4, d=64, i=96, gen=None):
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.randn(e, i, d, generator=gen) * 0.05)
        self.w2_EDF = nn.Parameter(torch.randn(e, d, i, generator=gen) * 0.05)
        self.w3_EFD = nn.Parameter(torch.randn(e, i, d, generator=gen) * 0.05)

    def forward(self, x, offs):
        def gmm(a, w):
            return torch._grouped_mm(a, w.bfloat16().transpose(-2, -1), offs=offs)
        h = F.silu(gmm(x.bfloat16(), self.w1_EFD)) * gmm(x.bfloat16(), self.w3_EFD)
        return gmm(h, self.w2_EDF).type_as(x)


def _mlp(gen, act=nn.GELU):
    m = nn.Sequential(nn.Linear(64, 160), act(), nn.Linear(160, 96, bias=False))
    for p in m.parameters():
        nn.init.normal_(p, std=0.1, generator=gen)
    return m


@pytest.mark.parametrize("device", DEVICES)
def test_linear_weights_train_as_the_mxfp8_modules(device, rng):
    """Wrapped nn.Linear weights give the MXFP8Linear module path's outputs and gradients bit for bit (fresh data,
    21 tokens), state_dict stays plain, and five AdamW steps give the module path's losses exactly."""
    model = _mlp(rng).to(device)
    modules = copy.deepcopy(model)
    modules[0], modules[2] = MXFP8Linear.from_linear(modules[0]), MXFP8Linear.from_linear(modules[2])
    keys = list(model.state_dict())
    assert quantize_weights_(model) == ["0.weight", "2.weight"]
    assert isinstance(model[0].weight, MXFP8TrainingWeight) and isinstance(model[0].weight, nn.Parameter)
    assert type(model[0].bias) is nn.Parameter  # biases stay plain
    sd = model.state_dict()
    assert list(sd) == keys and all(type(v) is torch.Tensor for v in sd.values())

    losses, data_seed = [], int(torch.randint(0, 2**31, (1,), generator=rng))
    for m in (model, modules):
        # one AdamW implementation for both (on CUDA torch picks foreach for plain parameters and the per-tensor
        # loop for subclass ones: the same math, rounded differently)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        gen = torch.Generator().manual_seed(data_seed)
        run = []
        for _ in range(5):
            x = torch.randn(3, 7, 64, generator=gen).to(device)
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == losses[1]
    assert isinstance(model[0].weight, MXFP8TrainingWeight)  # the optimizer updated the inner tensor in place
    assert torch.equal(model[0].weight.inner, modules[0].weight.detach())
    x = torch.randn(5, 64, generator=rng).to(device)
    assert not torch.equal(model(x), _plain(model)(x))  # MXFP8, not the plain GEMM


def _plain(model):
    plain = copy.deepcopy(model)
    for mod in plain.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(p, MXFP8TrainingWeight):
                setattr(mod, name, nn.Parameter(p.inner.clone()))
    return plain


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mm_weights_run_the_mxfp8_grouped_gemm(device, rng):
    """torch._grouped_mm(x, w.bfloat16().transpose(-2, -1), offs=offs) on wrapped (E, N, K) weights is
    mxfp8_grouped_mm on the same weights: outputs and all gradients equal bit for bit, empty and odd groups."""
    experts = _Experts(gen=rng).to(device)
    ref = copy.deepcopy(experts)
    assert quantize_weights_(experts) == ["w1_EFD", "w2_EDF", "w3_EFD"]
    offs = torch.tensor([5, 5, 38, 41], dtype=torch.int32, device=device)
    x = torch.randn(44, 64, generator=rng).to(device)  # 3 rows past offs[-1]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = experts(xa, offs)
    y.square().sum().backward()

    def gmm(a, w):
        return mxfp8_grouped_mm(a, w.bfloat16(), offs)
    h = F.silu(gmm(xb.bfloat16(), ref.w1_EFD)) * gmm(xb.bfloat16(), ref.w3_EFD)
    y_ref = gmm(h, ref.w2_EDF).float()
    y_ref.square().sum().backward()
    assert torch.equal(y, y_ref) and bool(y[41:].eq(0).all())
    assert torch.equal(xa.grad, xb.grad)
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        assert torch.equal(getattr(experts, name).grad, getattr(ref, name).grad), name


def test_other_uses_of_a_wrapped_weight_run_in_high_precision(rng):
    w = torch.randn(64, 96, generator=rng)
    wrapped = MXFP8TrainingWeight(w)
    x = torch.randn(8, 96, generator=rng)
    assert type(x @ wrapped.t()) is torch.Tensor and torch.equal(x @ wrapped.t(), x @ w.t())
    assert torch.equal(F.embedding(torch.tensor([3, 1]), wrapped), w[[3, 1]])
    assert torch.equal(wrapped * 2, w * 2) and type(wrapped * 2) is torch.Tensor
    assert isinstance(wrapped.t(), MXFP8TrainingWeight) and isinstance(wrapped[:32], MXFP8TrainingWeight)
    # F.linear is MXFP8 (differs from the plain product), the plain tensor is untouched
    assert not torch.equal(F.linear(x, wrapped), F.linear(x, w))
    w3 = torch.randn(2, 64, 96, generator=rng).bfloat16()
    xg = torch.randn(2, 8, 96, generator=rng).bfloat16()
    # a grouped form the wrapper does not redirect (3d-3d, no offsets) runs in high precision
    plain = torch._grouped_mm(xg, w3.transpose(-2, -1))
    got = torch._grouped_mm(xg, MXFP8TrainingWeight(w3).transpose(-2, -1))
    assert type(got) is torch.Tensor and torch.equal(got, plain)


def test_in_place_changes_of_a_wrapped_weight_reach_autograds_check(rng):
    """The backward casts the weight's dgrad operand from the weight it saved, so an in-place change of the
    wrapped weight between forward and backward (an optimizer step) is refused as for a bf16 weight; the wrapper's
    in-place ops run below autograd on the inner tensor and bump its version themselves.  Ops that only read the
    weight (an EMA's add_, copy_ from it) do not; without an input gradient nothing is saved and it is allowed."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    lin = nn.Linear(256, 128, dtype=torch.bfloat16)
    quantize_weights_(lin)
    x = torch.randn(64, 256, generator=rng).bfloat16().requires_grad_()
    y = lin(x)
    with torch.no_grad():
        lin.weight.mul_(-1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    want = torch.autograd.grad(lin(x).sum(), x)[0]
    y = lin(x)
    ema = torch.zeros(128, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        ema.mul_(0.5).add_(lin.weight)
        ema.copy_(lin.weight)
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], want)
    y = lin(x.detach())
    with torch.no_grad():
        lin.weight.mul_(2)
    y.sum().backward()
    assert lin.weight.grad is not None


def test_checkpoints_copies_and_errors(rng, tmp_path):
    model = _mlp(rng)
    unconverted = copy.deepcopy(model)
    quantize_weights_(model, MXFP8Config(scale_mode="floor"))
    twin = copy.deepcopy(model)
    assert isinstance(twin[0].weight, MXFP8TrainingWeight) and twin[0].weight.config.scale_mode == "floor"
    assert twin[0].weight.requires_grad and twin[0].weight.inner.data_ptr() != model[0].weight.inner.data_ptr()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    unconverted.load_state_dict(torch.load(buf))
    for a, b in zip(unconverted.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    fresh = _mlp(rng)
    quantize_weights_(fresh)
    fresh.load_state_dict(unconverted.state_dict())
    assert isinstance(fresh[0].weight, MXFP8TrainingWeight)
    assert torch.equal(fresh[0].weight.inner, unconverted[0].weight.detach())
    torch.save(model, tmp_path / "whole.pt")  # the module itself pickles with its wrapped weights
    back = torch.load(tmp_path / "whole.pt", weights_only=False)
    x = torch.randn(4, 64, generator=rng)
    assert isinstance(back[0].weight, MXFP8TrainingWeight) and torch.equal(back(x), model(x))

    with pytest.raises(TypeError, match="bfloat16 or float32"):
        MXFP8TrainingWeight(torch.zeros(32, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="MXFP8Config"):
        quantize_weights_(_mlp(rng), config="rceil")
    odd = nn.Linear(48, 64)
    assert quantize_weights_(odd) == []  # K = 48: left plain by the default filter
    forced = nn.Linear(48, 64)  # a filter_fn choosing it: refused when wrapped (not at the first forward)
    with pytest.raises(ValueError, match=r"filter_fn chose weight of shape \(64, 48\)"):
        quantize_weights_(forced, filter_fn=lambda mod, name, p: name == "weight")
    assert type(forced.weight) is nn.Parameter


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(rng):
    # ReLU, not GELU: inductor's fused GELU differs from eager's by an ulp on most elements, and an ulp at a
    # rounding boundary moves a second-layer input's MXFP8 byte (CI seed 412241259 did); ReLU is exact in both
    model = _mlp(rng, act=nn.ReLU)
    experts = _Experts(gen=rng)
    quantize_weights_(model)
    quantize_weights_(experts)
    offs = torch.tensor([7, 7, 20, 32], dtype=torch.int32)
    # the experts under aot_eager: inductor would fuse their bf16 SiLU * up without the eager bf16 rounding of
    # the product, which changes h's MXFP8 bytes (inductor's numerics, not the wrapper's)
    assert_compile_matches_eager(model, (torch.randn(2, 9, 64, generator=rng),))
    assert_compile_matches_eager(experts, (torch.randn(32, 64, generator=rng), offs), backend="aot_eager")


def test_ties_lists_and_casts(rng):
    """Tied weights stay one parameter (one AdamW update per step); ops taking lists of wrapped weights (torch.cat,
    the foreach optimizers) run on the inner tensors; copies to other dtypes come back plain."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 64)
            self.a, self.head = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.a(self.emb(ids)))

    model = Tied()
    ref = copy.deepcopy(model)
    names = quantize_weights_(model)
    assert model.head.weight is model.emb.weight and isinstance(model.emb.weight, MXFP8TrainingWeight)
    assert set(names) == {"emb.weight", "head.weight", "a.weight"} and len(list(model.parameters())) == 2
    ids = torch.randint(0, 64, (4, 8), generator=rng)
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, foreach=True)
        m(ids).square().mean().backward()
        opt.step()
    step = (model.emb.weight.inner - ref.emb.weight.detach()).abs().max()
    assert float(step) < 0.02  # one update (MXFP8 vs plain gradients), not two
    w = MXFP8TrainingWeight(torch.randn(64, 32, generator=rng))
    assert torch.equal(torch.cat([w, w]), torch.cat([w.inner, w.inner]))
    assert type(w.to(torch.float16)) is torch.Tensor and w.to(torch.float16).dtype == torch.float16
    assert isinstance(w.to(torch.bfloat16), MXFP8TrainingWeight)
    assert type(w.new_zeros(3, dtype=torch.int64)) is torch.Tensor
    opt = torch.optim.AdamW([nn.Parameter(w)], lr=1e-2, foreach=True)
    opt.param_groups[0]["params"][0].grad = torch.ones(64, 32)
    opt.step()


def test_plan_cache_keys_never_hide_argument_errors():
    from cute_mxfp8 import ops
    x = torch.randn(32, 32)
    with pytest.raises((TypeError, ValueError)):
        ops.quantize_rowwise(x, scale_mode=["rceil"])
    with pytest.raises(TypeError, match="blocked"):
        ops.quantize_rowwise(x, blocked=1)


def test_data_assignment_and_dtype_conversions(rng, caplog):
    """``w.data = t`` replaces the wrapped tensor (it was ignored: the wrapper kept computing with the old one);
    ``model.half()`` on a wrapped model raises instead of leaving a wrapper that says float16 around a bf16
    tensor; ``model.to(torch.bfloat16)`` / ``.float()`` convert the inner tensor.  ``quantize_weights_`` leaves an
    fp16 model's weights plain and logs them, like ``convert_to_mxfp8``; a filter that picks one raises."""
    model = _mlp(rng).to(torch.bfloat16)
    quantize_weights_(model)
    w = model[0].weight
    new = torch.randn(160, 64, generator=rng)  # fp32: the dtype may change between the two weight dtypes
    w.data = new
    assert type(w) is MXFP8TrainingWeight and w.inner is new and w.dtype == torch.float32
    assert torch.equal(w * 1, new) and type(w.data) is MXFP8TrainingWeight
    with pytest.raises(TypeError, match=r"model.to\(torch.bfloat16\)"):
        model.half()
    assert model[0].weight.inner.dtype == model[0].weight.dtype  # never the float16 wrapper around bf16
    with pytest.raises(TypeError, match="float64"):
        w.data = new.double()
    model.to(torch.bfloat16)
    for lin in (model[0], model[2]):
        assert type(lin.weight) is MXFP8TrainingWeight and lin.weight.inner.dtype == torch.bfloat16
    model.float()
    assert model[2].weight.inner.dtype == torch.float32
    x = torch.randn(5, 64, generator=rng)
    assert model(x).dtype == torch.float32

    half = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).half()
    with caplog.at_level("INFO", logger="cute_mxfp8"):
        assert quantize_weights_(half) == []
    assert "left 0.weight in high precision: a torch.float16 weight" in caplog.text
    assert type(half[0].weight) is nn.Parameter
    with pytest.raises(TypeError, match=r"filter_fn chose 1.weight, a torch.float16 parameter"):
        quantize_weights_(half, filter_fn=lambda mod, name, p: mod is half[1] and name == "weight")


def test_unknown_backend_is_refused_when_the_layers_are_made():
    from cute_mxfp8 import MXFP8GroupedExperts, MXFP8SwiGLUMLP, convert_to_mxfp8

    bogus = MXFP8Config(backend="sm91")
    for make in (lambda: MXFP8Linear(64, 64, config=bogus), lambda: MXFP8SwiGLUMLP(64, 128, config=bogus),
                 lambda: MXFP8GroupedExperts(64, 128, 2, config=bogus),
                 lambda: MXFP8TrainingWeight(torch.zeros(64, 64), bogus),
                 lambda: convert_to_mxfp8(nn.Sequential(nn.Linear(64, 64)), config=bogus),
                 lambda: quantize_weights_(nn.Sequential(nn.Linear(64, 64)), bogus)):
        with pytest.raises(ValueError, match=r"backend='sm91'\) names no registered backend; use one of \["):
            make()
    assert type(MXFP8Linear(64, 64, config=MXFP8Config(backend="reference")).config) is MXFP8Config
    with pytest.raises(ValueError, match=r"backend must be a backend name \(str\) or None .*got ''"):
        MXFP8Config(backend="")  # (it ran as None, unlike every other unregistered name)


def test_lazy_and_convolution_weights_are_left_plain():
    """A LazyLinear not materialized yet has no shape: convert / from_linear / quantize_weights_ skip or refuse it
    naming the fix (convert replaced it by an MXFP8Linear with in_features=0, quantize_weights_ crashed in torch);
    a Conv1d's (out, in, k) kernel is no expert weight (the default filter wrapped it, and the MXFP8 all-gather
    then refused the convolution)."""
    from cute_mxfp8 import convert_to_mxfp8

    lazy = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 64))
    report = convert_to_mxfp8(lazy)
    assert type(lazy[0]) is nn.LazyLinear and isinstance(lazy[2], MXFP8Linear)
    assert "not materialized its parameters yet" in str(report)
    with pytest.raises(ValueError, match="not materialized its parameters yet .* run one forward first"):
        MXFP8Linear.from_linear(nn.LazyLinear(64))
    lazy = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 64))
    assert quantize_weights_(lazy) == ["2.weight"]
    lazy(torch.randn(4, 32))  # materialized now: the next call wraps it
    assert quantize_weights_(lazy) == ["0.weight"]
    with pytest.raises(ValueError, match="filter_fn chose 0.weight, which its lazy module has not materialized"):
        quantize_weights_(nn.Sequential(nn.LazyLinear(64)), filter_fn=lambda m, n, p: n == "weight")
    conv = nn.Sequential(nn.Conv1d(64, 64, 32), nn.Conv2d(4, 4, 1))
    assert quantize_weights_(conv) == [] and type(conv[0].weight) is nn.Parameter
    assert "experts-like" not in str(convert_to_mxfp8(conv))


def test_numpy_and_lists_of_a_wrapped_weight(rng):
    """``.numpy()``, ``np.asarray`` and ``.tolist()`` (TensorBoard histograms, wandb) read the inner tensor
    (torch refuses them for tensor subclasses); ``.numpy()`` of one that requires grad raises as torch's does."""
    import numpy as np

    w = nn.Parameter(MXFP8TrainingWeight(torch.randn(64, 32, generator=rng)))
    assert np.array_equal(w.detach().numpy(), w.inner.numpy()) and np.asarray(w.detach()).shape == (64, 32)
    assert w.tolist() == w.inner.tolist()
    with pytest.raises(RuntimeError, match="requires grad"):
        w.numpy()
    with pytest.raises(TypeError, match="must be set to a tensor"):
        w.data = 3


def test_convert_leaves_weights_wrapped_with_another_config(rng):
    """A Linear whose weight ``quantize_weights_`` wrapped runs in MXFP8 with the wrapper's config; converting it
    with another config would silently replace that config: ``convert_to_mxfp8`` skips it (the reason names the
    fix) and converts the others; with the same config it converts (the results do not change)."""
    import torch.nn as nn

    from cute_mxfp8 import MXFP8Config, convert_to_mxfp8, quantize_weights_

    floor = MXFP8Config(scale_mode="floor")
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    assert quantize_weights_(model, floor, filter_fn=lambda mod, name, p: mod is model[0]) == ["0.weight"]
    x = torch.randn(32, 64, generator=rng)
    want = model[0](x)
    report = convert_to_mxfp8(model, config=MXFP8Config())
    assert [fqn for fqn, _ in report.converted] == ["1"]
    assert [fqn for fqn, _ in report.skipped] == ["0"] and "quantize_weights_" in report.skipped[0][1]
    assert type(model[0]) is nn.Linear and torch.equal(model[0](x), want)
    report = convert_to_mxfp8(model, config=floor)
    assert [fqn for fqn, _ in report.converted] == ["0"] and torch.equal(model[0](x), want)


def test_quantize_weights_names_what_it_leaves_and_refuses_filtered_shapes_it_cannot_run(caplog):
    """The default filter leaves Linears whose dims are not multiples of 32 plain and logs each with the reason
    (as ``convert_to_mxfp8`` reports them); a ``filter_fn`` that picks such a weight or a bias gets a ValueError
    at wrap time naming the parameter and its shape (before: wrapped, then the first forward failed)."""
    import logging

    import torch.nn as nn

    from cute_mxfp8 import quantize_weights_

    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64), nn.Linear(64, 64))
    with caplog.at_level(logging.INFO, logger="cute_mxfp8"):
        assert quantize_weights_(model) == ["2.weight"]
    logged = caplog.text
    assert "left 0.weight in high precision: out_features N=40" in logged and "left 1.weight" in logged
    for name, says in (("weight", r"filter_fn chose 0\.weight of shape \(40, 64\)"),
                       ("bias", r"filter_fn chose 0\.bias of shape \(40,\)")):
        model[0] = nn.Linear(64, 40)
        with pytest.raises(ValueError, match=says):
            quantize_weights_(model, filter_fn=lambda m, n, p, name=name: m is model[0] and n == name)


def test_wrapping_and_converting_in_either_order_never_changes_a_layers_config_silently(caplog):
    """``quantize_weights_`` checks every choice before it wraps anything (an error leaves the model as it was);
    it leaves weights of modules ``convert_to_mxfp8`` made with other numerics as they are (logged; with the same
    numerics it wraps them, e.g. for the MXFP8 all-gather); ``convert_to_mxfp8`` converts an FFN whose one Linear
    was wrapped with another config Linear by Linear (the wrapped one skipped), and takes configs differing only
    in ``fsdp_mxfp8_all_gather`` as the same; a filter_fn of the wrong arity is refused naming the call."""
    import logging

    import torch.nn as nn

    from cute_mxfp8 import MXFP8Config, convert_to_mxfp8, quantize_weights_
    from cute_mxfp8.nn.weight import MXFP8TrainingWeight

    floor = MXFP8Config(scale_mode="floor")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 40))
    with pytest.raises(ValueError, match="0.bias.*nothing was wrapped"):
        quantize_weights_(model, floor, filter_fn=lambda m, n, p: m is not model[2])
    assert not any(isinstance(p, MXFP8TrainingWeight) for p in model.parameters())
    with pytest.raises(TypeError, match=r"filter_fn\(module, parameter name, parameter\)"):
        quantize_weights_(model, filter_fn=lambda m, n: True)
    with pytest.raises(TypeError, match=r"filter_fn\(module, fully qualified name\)"):
        convert_to_mxfp8(model, filter_fn=lambda m: True)

    convert_to_mxfp8(model, config=floor)  # 0 and 1 become MXFP8Linear (2 is 40 wide)
    with caplog.at_level(logging.INFO, logger="cute_mxfp8"):
        assert quantize_weights_(model, MXFP8Config()) == []
    assert "left 0.weight as it is" in caplog.text
    with caplog.at_level(logging.INFO, logger="cute_mxfp8"):
        assert quantize_weights_(model, MXFP8Config(scale_mode="floor", fsdp_mxfp8_all_gather=True)) == [
            "0.weight", "1.weight"]
    # the converted modules cast their weights themselves: an MXFP8-gathered weight would fail their forward
    assert not any(model[i].weight.config.fsdp_mxfp8_all_gather for i in (0, 1))
    assert "0.weight all-gathers in high precision: 0 (made by convert_to_mxfp8) casts it itself" in caplog.text
    # the other order: wrapped for the MXFP8 all-gather, then converted with the same numerics
    ag = MXFP8Config(fsdp_mxfp8_all_gather=True)
    other = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    quantize_weights_(other, ag)
    assert [f for f, _ in convert_to_mxfp8(other, config=ag).converted] == ["0", "1"]
    assert not any(m.weight.config.fsdp_mxfp8_all_gather for m in other)

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = (nn.Linear(a, b, bias=False) for a, b in ((64, 96), (96, 64), (64, 96)))

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    ffn = nn.Sequential(FFN())
    quantize_weights_(ffn, floor, filter_fn=lambda m, n, p: m is ffn[0].w1 and n == "weight")
    report = convert_to_mxfp8(ffn)
    assert sorted(f for f, _ in report.converted) == ["0.w2", "0.w3"]
    assert sorted(f for f, _ in report.skipped) == ["0", "0.w1"]
    tied = nn.Sequential(nn.Linear(64, 64))
    quantize_weights_(tied, dataclasses.replace(floor, fsdp_mxfp8_all_gather=True))
    assert [f for f, _ in convert_to_mxfp8(tied, config=floor).converted] == ["0"]


def test_quantize_weights_warns_when_it_wraps_nothing_it_could_have():
    """fp16 / fp64 weights and dims that are not multiples of 32 stay plain (logged); a call that wraps nothing
    because of that, leaving the model with no MXFP8 weight, says so in a warning naming the first one and why.  A
    model with some weight wrapped (now or by an earlier call), or with no candidate at all, stays quiet."""
    import warnings

    for model, why in ((nn.Sequential(nn.Linear(64, 64)).half(), "a torch.float16 weight"),
                       (nn.Sequential(nn.Linear(64, 64, dtype=torch.float64)), "a torch.float64 weight"),
                       (nn.Sequential(nn.Linear(48, 64)), "in_features K=48 not a multiple of the MX block size 32")):
        with pytest.warns(UserWarning, match=f"wrapped no weight: 1 left in high precision, e.g. 0.weight: {why}"):
            assert quantize_weights_(model) == []

    class Experts(nn.Module):  # 3-D expert weights (E, N, K) with a dim that is no multiple of 32
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(2, 96, 40))

    with pytest.warns(UserWarning, match=r"wrapped no weight: 1 left in high precision, e.g. 0.w1: 3-D weight \(E, "
                                         r"N, K\): K=40 not a multiple of the MX block size 32"):
        assert quantize_weights_(nn.Sequential(Experts())) == []

    class PatchEmbed(nn.Module):  # 3-D parameters that are no expert weights: neither wrapped nor reported
        def __init__(self):
            super().__init__()
            self.pos_embed, self.cls_token = nn.Parameter(torch.zeros(1, 197, 64)), nn.Parameter(torch.zeros(1, 1, 64))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quantize_weights_(PatchEmbed()) == []
        assert quantize_weights_(nn.Sequential(nn.Bilinear(40, 64, 64, bias=False))) == []
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(48, 64))  # one wrapped: the other is logged only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quantize_weights_(model) == ["0.weight"]
        assert quantize_weights_(model) == []  # (already wrapped)
        assert quantize_weights_(nn.Sequential(nn.ReLU())) == []
