"""Drop-in modules and convert_to_mxfp8: naming, state dicts, skip rules (cases section E), torch.compile."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cute_mxfp8 import MXFP8Config, convert_to_mxfp8
from cute_mxfp8.nn import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP
from cute_mxfp8.ops import mxfp8_linear, mxfp8_swiglu_mlp


class FeedForward(nn.Module):  # torchtitan naming
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ReluGLU(FeedForward):  # same structure, different math: must not become an MXFP8SwiGLUMLP
    def forward(self, x):
        return self.w2(F.relu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):  # torchtitan naming
    def __init__(self, dim, hidden, num_experts):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim ** 0.5)

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for xe, w1, w2, w3 in zip(torch.split(x, num_tokens_per_expert.tolist()), self.w1, self.w2, self.w3):
            outs.append(F.linear(F.silu(F.linear(xe, w1)) * F.linear(xe, w3), w2))
        return torch.cat(outs)


class Block(nn.Module):
    def __init__(self, dim=64, hidden=128, experts=4):
        super().__init__()
        self.attn_proj = nn.Linear(dim, dim)
        self.ffn = FeedForward(dim, hidden)
        self.glu = ReluGLU(dim, hidden)
        self.router = nn.Linear(dim, 16, bias=False)  # 16 outputs: not a multiple of 32
        self.experts = GroupedExperts(dim, hidden, experts)

    def forward(self, x):
        h = self.attn_proj(x) + self.ffn(x) + self.glu(x) + self.router(x).sum(-1, keepdim=True)
        counts = torch.tensor([3, 0, 5, x.shape[0] - 8])
        return h + self.experts(h, counts)


def _sqnr(ref, x):
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def test_convert_report_state_dict_and_values(caplog, rng):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = Block()
    x = torch.randn(20, 64, generator=rng)
    ref = model(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="cute_mxfp8"):
        report = convert_to_mxfp8(model)
    converted = dict(report.converted)
    assert converted == {"attn_proj": "MXFP8Linear", "ffn": "MXFP8SwiGLUMLP", "glu.w1": "MXFP8Linear",
                         "glu.w2": "MXFP8Linear", "glu.w3": "MXFP8Linear", "experts": "MXFP8GroupedExperts"}
    skipped = dict(report.skipped)
    assert list(skipped) == ["glu", "router"] and "out_features=16" in skipped["router"] and "32" in skipped["router"]
    assert "forward is not w2(silu(w1(x)) * w3(x))" in skipped["glu"]  # a look-alike FFN is reported, its Linears taken
    assert "router" in caplog.text  # the reason is logged
    assert type(model.router) is nn.Linear and isinstance(model.ffn, MXFP8SwiGLUMLP)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    y = model(x)
    assert _sqnr(ref, y) > 20
    assert "router" in str(report) and "MXFP8SwiGLUMLP" in str(report)


def test_state_dicts_interchange_both_ways(rng):
    stock = FeedForward(64, 128)
    mx = MXFP8SwiGLUMLP(64, 128)
    assert list(mx.state_dict()) == list(stock.state_dict())
    mx.load_state_dict(stock.state_dict())
    stock2 = FeedForward(64, 128)
    stock2.load_state_dict(mx.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(), stock2.state_dict().values()))
    lin, mlin = nn.Linear(64, 96), MXFP8Linear(64, 96)
    mlin.load_state_dict(lin.state_dict())
    nn.Linear(64, 96).load_state_dict(mlin.state_dict())
    ge, mge = GroupedExperts(64, 128, 3), MXFP8GroupedExperts(64, 128, 3)
    mge.load_state_dict(ge.state_dict())
    assert list(mge.state_dict()) == ["w1", "w2", "w3"]


def test_modules_forward_equals_functional(rng):
    x = torch.randn(10, 64, generator=rng)
    lin = MXFP8Linear(64, 96)
    assert torch.equal(lin(x), mxfp8_linear(x, lin.weight, lin.bias))
    assert isinstance(lin, nn.Linear)
    mlp = MXFP8SwiGLUMLP(64, 128)
    assert torch.equal(mlp(x), mxfp8_swiglu_mlp(x, mlp.w1.weight, mlp.w2.weight, mlp.w3.weight))
    ex = MXFP8GroupedExperts(64, 128, 2)
    out = ex(x, torch.tensor([4, 3]))
    assert out.shape == (10, 64) and torch.all(out[7:] == 0)
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        ex(x, torch.tensor([4, 3, 3]))


def test_cases_E_router_rule():
    with pytest.raises(ValueError, match="out_features=16 not a multiple of the MX block size 32"):
        MXFP8Linear(64, 16)
    with pytest.raises(ValueError, match="hidden_dim=100"):
        MXFP8SwiGLUMLP(64, 100)
    with pytest.raises(ValueError, match="dim=48"):
        MXFP8GroupedExperts(48, 64, 2)


def test_filter_fn_and_root_and_idempotence():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    report = convert_to_mxfp8(model, filter_fn=lambda mod, fqn: fqn != "2")
    assert dict(report.converted) == {"0": "MXFP8Linear"} and type(model[2]) is nn.Linear
    assert convert_to_mxfp8(model).converted == [("2", "MXFP8Linear")]  # already-converted modules stay
    root = nn.Linear(64, 64)
    report = convert_to_mxfp8(root)
    assert report.converted == [] and "root" in report.skipped[0][1]


def test_config_reaches_modules_and_validates():
    cfg = MXFP8Config(scale_mode="floor", elem_dtype=torch.float8_e5m2)
    model = nn.Sequential(FeedForward(64, 64))
    convert_to_mxfp8(model, config=cfg)
    assert model[0].config == cfg
    with pytest.raises(ValueError, match="scale_mode"):
        MXFP8Config(scale_mode="round")
    with pytest.raises(ValueError, match="elem_dtype"):
        MXFP8Config(elem_dtype=torch.bfloat16)


def test_meta_device_model_converts_by_structure():
    with torch.device("meta"):
        model = nn.Sequential(FeedForward(64, 128), nn.Linear(64, 64))
    report = convert_to_mxfp8(model)
    assert dict(report.converted) == {"0": "MXFP8SwiGLUMLP", "1": "MXFP8Linear"}


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(rng):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = nn.Sequential(nn.Linear(64, 64), FeedForward(64, 128))
    convert_to_mxfp8(model)
    x = torch.randn(2, 7, 64, generator=rng)
    eager_x = x.clone().requires_grad_()
    y_eager = model(eager_x)
    y_eager.sum().backward()
    g_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    comp_x = x.clone().requires_grad_()
    y_comp = compiled(comp_x)
    y_comp.sum().backward()
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comp_x.grad, eager_x.grad, rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), g_eager):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


class GeluSum(FeedForward):
    def forward(self, x):
        return 0.5 * self.w2(F.gelu(self.w1(x)) + self.w3(x))


class Scaled(FeedForward):
    def forward(self, x):
        return 1.01 * super().forward(x)


class Clamped(FeedForward):
    def forward(self, x):
        return self.w2((F.silu(self.w1(x)) * self.w3(x)).clamp(-10, 10))


class Dropout(FeedForward):
    def forward(self, x):
        return self.w2(F.dropout(F.silu(self.w1(x)) * self.w3(x), 0.1, self.training))


class ExpertsScaled(GroupedExperts):
    def forward(self, x, num_tokens_per_expert):
        return 2 * super().forward(x, num_tokens_per_expert)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("cls", [GeluSum, Scaled, Clamped, Dropout])
def test_lookalike_ffns_are_not_swapped(cls, device):
    with torch.device(device):
        model = nn.Sequential(cls(64, 128), ExpertsScaled(64, 128, 3), GroupedExperts(64, 128, 3))
    model.eval()  # dropout is inactive in eval mode; the probe still sees it
    report = convert_to_mxfp8(model)
    assert type(model[0]) is cls and type(model[1]) is ExpertsScaled
    assert isinstance(model[2], MXFP8GroupedExperts)
    assert dict(report.converted) == {"0.w1": "MXFP8Linear", "0.w2": "MXFP8Linear", "0.w3": "MXFP8Linear",
                                      "2": "MXFP8GroupedExperts"}
    assert not model[0].training  # training flags restored after the probe


def test_convert_leaves_global_rng_alone():
    model = nn.Sequential(FeedForward(64, 128), GroupedExperts(64, 64, 2), Dropout(64, 64))
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    convert_to_mxfp8(model)
    assert torch.equal(torch.rand(4), expected)


def test_unsupported_weight_dtype_is_skipped_with_reason():
    model = nn.Sequential(FeedForward(64, 128), nn.Linear(64, 64)).half()
    report = convert_to_mxfp8(model)
    assert report.converted == []
    assert dict(report.skipped) == {"0": "parameters in torch.float16: MXFP8 layers take bfloat16 or float32 weights",
                                    "1": "parameters in torch.float16: MXFP8 layers take bfloat16 or float32 weights"}


def test_filter_fn_keeps_a_whole_ffn_in_high_precision():
    model = nn.Sequential(FeedForward(64, 128), nn.Linear(64, 64))
    report = convert_to_mxfp8(model, filter_fn=lambda mod, fqn: not isinstance(mod, FeedForward))
    assert type(model[0]) is FeedForward and type(model[0].w1) is nn.Linear
    assert report.converted == [("1", "MXFP8Linear")] and report.skipped == [("0", "excluded by filter_fn")]


def test_a_second_convert_with_another_config_reports_what_it_left():
    """Converting again with other numerics left the MXFP8 modules on their first config without a word."""
    from cute_mxfp8 import MXFP8Config

    model = nn.Sequential(FeedForward(64, 128), nn.Linear(64, 64))
    convert_to_mxfp8(model)
    again = convert_to_mxfp8(model)  # the same numerics: a no-op, nothing to report
    assert again.converted == [] and again.skipped == []
    floor = convert_to_mxfp8(model, config=MXFP8Config(scale_mode="floor"))
    assert floor.converted == [] and [f for f, _ in floor.skipped] == ["0", "1"]
    assert all("already MXFP8 with another config" in why and "scale_mode='rceil'" in why for _, why in floor.skipped)
    assert model[1].config.scale_mode == "rceil"


def test_already_converted_root_and_linear_subclasses():
    assert convert_to_mxfp8(MXFP8SwiGLUMLP(64, 128)).converted == []
    model = nn.Sequential(nn.MultiheadAttention(64, 2))
    report = convert_to_mxfp8(model)
    assert report.converted == [] and report.skipped[0][0] == "0.out_proj"
    assert "MultiheadAttention reads out_proj" in report.skipped[0][1]

    class Plain(nn.Linear):  # a framework's Linear (torchtitan's): nn.Linear's forward, converted
        pass

    class Scaled(nn.Linear):  # its own forward: kept, and said why
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Plain(64, 64), Scaled(64, 64))
    report = convert_to_mxfp8(model)
    assert report.converted == [("0", "MXFP8Linear")] and isinstance(model[0], MXFP8Linear)
    assert report.skipped[0][0] == "1" and "overrides nn.Linear.forward" in report.skipped[0][1]
    with pytest.raises(TypeError, match="MXFP8Config"):
        convert_to_mxfp8(model, config={"scale_mode": "floor"})


def test_grouped_experts_counts_validation():
    ex = MXFP8GroupedExperts(64, 64, 2)
    x = torch.randn(6, 64)
    assert torch.equal(ex(x, [2, 3]), ex(x, torch.tensor([2, 3])))  # a list of ints is accepted
    with pytest.raises(ValueError, match="integer tensor"):
        ex(x, torch.tensor([2.5, 3.5]))
    with pytest.raises(ValueError, match=r"\(tokens, dim\)"):
        ex(x.view(2, 3, 64), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"num_tokens_per_expert sums to 7 but x has 6"):
        ex(x, torch.tensor([4, 3]))
    with pytest.raises(ValueError, match="meta device"):
        ex(x, torch.tensor([2, 3], device="meta"))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ex(x.tolist(), torch.tensor([2, 3]))
    with pytest.raises(TypeError, match="MXFP8Config"):
        MXFP8Linear(64, 64, config={"scale_mode": "floor"})


def test_grouped_experts_compile_keeps_the_mlp_in_one_graph(rng):
    """Eager, the module hands the counts read to the autograd function (after the weights' casts); compiled, it
    reads them first, so the only breaks are the counts read and the whole MLP stays one autograd graph (forward
    and backward compiled), bit-identical to eager."""
    torch._dynamo.reset()
    ex = MXFP8GroupedExperts(64, 128, 4)
    x = torch.randn(100, 64, generator=rng).requires_grad_()
    counts = torch.tensor([20, 0, 50, 20])
    explain = torch._dynamo.explain(ex)(x, counts)
    assert explain.graph_break_count <= 2, explain.break_reasons
    y = ex(x, counts)
    y.sum().backward()
    want = [y.detach(), x.grad.clone(), *(p.grad.clone() for p in ex.parameters())]
    x.grad = None
    ex.zero_grad(set_to_none=True)
    yc = torch.compile(ex)(x, counts)
    yc.sum().backward()
    got = [yc.detach(), x.grad, *(p.grad for p in ex.parameters())]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_grouped_experts_with_device_counts_compile_fullgraph_without_recompiling(rng, monkeypatch):
    """Device counts (CUDA counts on x's device; here the CPU stands in, through the module's predicate) take
    ``device_offsets_from_counts`` under torch.compile too: one graph with ``fullgraph=True`` (it failed on a
    data-dependent guard), no recompile when only the counts' values change, bit-identical to eager."""
    from cute_mxfp8.nn import modules as M

    monkeypatch.setattr(M, "_counts_on_device", lambda counts, x: type(counts) is torch.Tensor)
    torch._dynamo.reset()
    ex = MXFP8GroupedExperts(64, 128, 4)
    compiled = torch.compile(ex, fullgraph=True, backend="aot_eager")
    frames = []
    for counts in ([20, 0, 50, 20], [5, 40, 0, 30], [0, 0, 0, 90]):
        counts = torch.tensor(counts)
        x = torch.randn(100, 64, generator=rng)
        results = []
        for fn in (ex, compiled):
            xi = x.clone().requires_grad_()
            y = fn(xi, counts)
            y.square().sum().backward()
            results.append([y.detach(), xi.grad, *(p.grad.clone() for p in ex.parameters())])
            ex.zero_grad(set_to_none=True)
        assert all(torch.equal(g, w) for g, w in zip(*results))
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[0] >= 1 and frames[1:] == [frames[0]] * 2, frames  # the later counts reuse the first graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 with -m gpu)")
def test_grouped_experts_with_cuda_counts_compile_fullgraph_on_the_gpu(rng):
    """The CUDA path of the test above, on the kernels: one graph, new counts reuse it, bit-equal to eager."""
    torch._dynamo.reset()
    ex = MXFP8GroupedExperts(256, 256, 4, device="cuda", dtype=torch.bfloat16)
    for p in ex.parameters():
        nn.init.normal_(p, std=0.05)
    compiled = torch.compile(ex, fullgraph=True, backend="aot_eager")
    frames = []
    for counts in ([100, 0, 300, 112], [7, 200, 150, 155]):
        counts = torch.tensor(counts, device="cuda")
        x = torch.randn(512, 256, generator=rng).to("cuda", torch.bfloat16)
        results = []
        for fn in (ex, compiled):
            xi = x.clone().requires_grad_()
            y = fn(xi, counts)
            y.float().square().sum().backward()
            results.append([y.detach(), xi.grad, *(p.grad.clone() for p in ex.parameters())])
            ex.zero_grad(set_to_none=True)
        assert all(torch.equal(g, w) for g, w in zip(*results))
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[0] >= 1 and frames[1] == frames[0], frames


def test_grouped_experts_pickled_before_validate_counts_still_run(rng):
    """A module saved before ``validate_counts`` existed (no instance attribute) runs with the class default; the
    constructor refuses a non-bool."""
    ex = MXFP8GroupedExperts(64, 64, 2)
    x = torch.randn(6, 64, generator=rng)
    want = ex(x, [2, 3])
    del ex.__dict__["validate_counts"]
    assert ex.validate_counts is False and torch.equal(ex(x, [2, 3]), want)
    with pytest.raises(TypeError, match="validate_counts must be a bool"):
        MXFP8GroupedExperts(64, 64, 2, validate_counts=1)
    assert "validate_counts" not in MXFP8GroupedExperts(64, 64, 2, validate_counts=True).state_dict()
    ex.validate_counts = "no"  # set after construction: refused at the forward, not read as True
    with pytest.raises(TypeError, match="validate_counts must be a bool, got 'no'"):
        ex(x, [2, 3])


def test_entry_points_name_the_fix_for_wrong_argument_types():
    """A model that is not an nn.Module, a filter_fn that is not callable and non-int layer dims raise TypeError
    naming the argument (they crashed inside: AttributeError, 'int' object is not callable, torch.empty)."""
    from cute_mxfp8 import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP, convert_to_mxfp8, quantize_weights_

    with pytest.raises(TypeError, match="convert_to_mxfp8 takes the model"):
        convert_to_mxfp8("model")
    with pytest.raises(TypeError, match="quantize_weights_ takes the model"):
        quantize_weights_(3)
    lin = nn.Linear(64, 64)
    with pytest.raises(TypeError, match="filter_fn must be None or a callable"):
        convert_to_mxfp8(lin, filter_fn=3)
    with pytest.raises(TypeError, match="filter_fn must be None or a callable"):
        quantize_weights_(lin, filter_fn=3)
    with pytest.raises(TypeError, match="dim must be an int"):
        MXFP8GroupedExperts(128.0, 64, 4)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        MXFP8GroupedExperts(128, 64, 4.0)
    with pytest.raises(ValueError, match="num_experts must be >= 0"):
        MXFP8GroupedExperts(128, 64, -1)
    with pytest.raises(TypeError, match="in_features must be an int"):
        MXFP8Linear(64.0, 64)
    with pytest.raises(TypeError, match="hidden_dim must be an int"):
        MXFP8SwiGLUMLP(64, True)
    np = pytest.importorskip("numpy")
    assert MXFP8Linear(np.int64(64), 32).in_features == 64  # (numpy ints are ints)


def test_from_module_refuses_what_it_would_drop():
    """``from_module`` takes over only the three weights: a bias, another parameter or mismatched shapes would be
    dropped or fail later, so they raise (ValueError naming the fix); non-Linear children and non-bf16/fp32
    weights too.  ``from cute_mxfp8 import *`` does not shadow torch's ``nn``."""
    class FF(nn.Module):
        def __init__(self, bias=False, up=128, extra=False):
            super().__init__()
            self.w1, self.w3 = nn.Linear(64, 128, bias=bias), nn.Linear(64, up, bias=False)
            self.w2 = nn.Linear(128, 64, bias=False)
            if extra:
                self.norm = nn.LayerNorm(128)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    assert MXFP8SwiGLUMLP.from_module(FF()).w1.weight.shape == (128, 64)
    with pytest.raises(ValueError, match="Linears have biases"):
        MXFP8SwiGLUMLP.from_module(FF(bias=True))
    with pytest.raises(ValueError, match=r"must be \(\.\.\., I, D\) / \(\.\.\., D, I\) / \(\.\.\., I, D\)"):
        MXFP8SwiGLUMLP.from_module(FF(up=96))
    with pytest.raises(ValueError, match=r"has parameters besides the Linears .*'norm.weight'"):
        MXFP8SwiGLUMLP.from_module(FF(extra=True))
    with pytest.raises(ValueError, match="weights in torch.float16"):
        MXFP8SwiGLUMLP.from_module(FF().half())
    with pytest.raises(TypeError, match=r"needs nn.Linear children.*its Linear children are \['0'\]: pass names="):
        MXFP8SwiGLUMLP.from_module(nn.Sequential(nn.Linear(64, 128)))
    hf = nn.Module()  # Hugging Face's LlamaMLP naming
    hf.gate_proj, hf.up_proj, hf.down_proj = nn.Linear(64, 128), nn.Linear(64, 128), nn.Linear(128, 64)
    with pytest.raises(TypeError, match=r'for Hugging Face naming pass names=\("gate_proj", "down_proj", "up_proj"\)'):
        MXFP8SwiGLUMLP.from_module(hf)
    with pytest.raises(ValueError, match="names must be three distinct"):
        MXFP8SwiGLUMLP(64, 128, names="abc")
    for bad, msg in ((("a.b", "c", "d"), "'a.b' is not a Python identifier"), (("", "c", "d"), "'' is not"),
                     (("names", "b", "c"), "'names' is taken by the module's own attribute"),
                     (("config", "b", "c"), "'config' is taken"), (("training", "b", "c"), "'training' is taken")):
        with pytest.raises(ValueError, match=msg):  # (torch's KeyError / TypeError at registration before)
            MXFP8SwiGLUMLP(64, 128, names=bad)
        with pytest.raises(ValueError, match=msg):
            MXFP8GroupedExperts(64, 128, 2, names=bad)
    with pytest.raises(TypeError, match="takes an nn.Linear, got Conv1d"):
        MXFP8Linear.from_linear(nn.Conv1d(64, 64, 1))
    with pytest.raises(ValueError, match="weights in torch.float16"):
        MXFP8Linear(64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="weights in torch.float16"):
        MXFP8Linear.from_linear(nn.Linear(64, 64).half())

    experts = nn.Module()
    for n, shape in (("w1", (2, 128, 64)), ("w2", (2, 64, 128)), ("w3", (2, 128, 64)), ("b1", (2, 128))):
        experts.register_parameter(n, nn.Parameter(torch.zeros(shape)))
    with pytest.raises(ValueError, match=r"besides the expert weights .*'b1'"):
        MXFP8GroupedExperts.from_module(experts)
    del experts.b1
    assert MXFP8GroupedExperts.from_module(experts).w2 is experts.w2
    experts.w3 = nn.Parameter(torch.zeros(2, 96, 64))
    with pytest.raises(ValueError, match=r"must be \(\.\.\., I, D\) / \(\.\.\., D, I\)"):
        MXFP8GroupedExperts.from_module(experts)
    del experts.w3
    experts.register_buffer("w3", torch.zeros(2, 128, 64))  # a buffer is not taken over: refused
    with pytest.raises(ValueError, match="needs 3-D parameters"):
        MXFP8GroupedExperts.from_module(experts)

    class Scaled(nn.Linear):  # its own forward: the swap would drop the scaling
        def forward(self, x):
            return 4 * super().forward(x)

    odd = FF()
    odd.w1 = Scaled(64, 128, bias=False)
    with pytest.raises(ValueError, match="overrides nn.Linear.forward"):
        MXFP8SwiGLUMLP.from_module(odd)
    with pytest.raises(ValueError, match="overrides nn.Linear.forward"):
        MXFP8Linear.from_linear(Scaled(64, 64))
    lora = FF()
    lora.w1.register_parameter("lora_A", nn.Parameter(torch.zeros(8, 64)))
    with pytest.raises(ValueError, match=r"besides weight and bias \(lora_A"):
        MXFP8SwiGLUMLP.from_module(lora)
    mixed = FF()
    mixed.w3.to(torch.bfloat16)
    with pytest.raises(ValueError, match="w1 .gate. is torch.float32 and w3 .up. torch.bfloat16"):
        MXFP8SwiGLUMLP.from_module(mixed)
    # convert_to_mxfp8: the mixed-dtype FFN's Linears one by one, the adapter Linear left plain, both reported
    model = nn.Sequential(mixed, lora.w1)
    report = convert_to_mxfp8(model)
    assert type(model[0]) is FF and isinstance(model[0].w1, MXFP8Linear) and isinstance(model[0].w3, MXFP8Linear)
    assert type(model[1]) is nn.Linear
    why = dict(report.skipped)
    assert "must share a dtype" in why["0"] and "lora_A" in why["1"]

    scope = {}
    exec("from cute_mxfp8 import *", scope)
    assert "nn" not in scope and scope["MXFP8Linear"] is MXFP8Linear


def test_module_constructors_refuse_bad_dtypes_and_negative_sizes_and_from_module_ignores_the_default_dtype():
    """Every MXFP8 module refuses weights that are not bf16 / fp32 when it is made (not at its first forward)
    and negative sizes with a ValueError naming them; the from_* constructors take the source's dtype, so a
    process whose default dtype is float64 still converts a bf16 model."""
    import torch.nn as nn

    from cute_mxfp8 import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP

    for make in (lambda dt: MXFP8Linear(64, 64, dtype=dt), lambda dt: MXFP8SwiGLUMLP(64, 96, dtype=dt),
                 lambda dt: MXFP8GroupedExperts(64, 96, 4, dtype=dt)):
        for dt in (torch.float16, torch.float64):
            with pytest.raises(ValueError, match=f"weights in {dt}"):
                make(dt)
    for make, name in ((lambda: MXFP8Linear(-32, 64), "in_features"), (lambda: MXFP8SwiGLUMLP(64, -32), "hidden_dim"),
                       (lambda: MXFP8GroupedExperts(-32, 64, 2), "dim")):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            make()

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = (nn.Linear(a, b, bias=False, dtype=torch.bfloat16)
                                         for a, b in ((64, 96), (96, 64), (64, 96)))

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        lin = nn.Linear(64, 32, dtype=torch.bfloat16)
        assert MXFP8Linear.from_linear(lin).weight is lin.weight
        ffn = FFN()
        assert MXFP8SwiGLUMLP.from_module(ffn).w1 is ffn.w1
        experts = nn.Module()
        for n, shape in (("w1", (2, 96, 64)), ("w2", (2, 64, 96)), ("w3", (2, 96, 64))):
            experts.register_parameter(n, nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)))
        assert MXFP8GroupedExperts.from_module(experts).w2 is experts.w2
    finally:
        torch.set_default_dtype(old)


def test_layer_dtype_is_checked_before_any_tensor_and_zero_width_experts_build():
    import torch.nn as nn

    from cute_mxfp8 import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP

    for dt in (torch.int32, torch.float8_e4m3fn):
        for make in (lambda: MXFP8Linear(64, 32, dtype=dt), lambda: MXFP8SwiGLUMLP(64, 32, dtype=dt),
                     lambda: MXFP8GroupedExperts(64, 32, 2, dtype=dt)):
            with pytest.raises(ValueError, match=f"weights in {dt}"):
                make()
    assert MXFP8GroupedExperts(0, 32, 2).w1.shape == (2, 32, 0) and MXFP8GroupedExperts(32, 0, 2).w2.shape == (2, 32, 0)
    lin = nn.Linear(64, 64)
    lin.bias = nn.Parameter(lin.bias.half())
    with pytest.raises(ValueError, match="float16"):  # convert_to_mxfp8 skips the same Linear
        MXFP8Linear.from_linear(lin)


@pytest.mark.parametrize("make", [lambda names: MXFP8SwiGLUMLP(64, 64, names=names),
                                  lambda names: MXFP8GroupedExperts(64, 64, 2, names=names)], ids=["mlp", "experts"])
def test_names_must_be_three_distinct_free_names(make):
    with pytest.raises(ValueError, match="three distinct"):
        make(("a", "a", "b"))
    with pytest.raises(ValueError, match="'forward' is taken by the module's own attribute"):
        make(("forward", "w2", "w3"))


@pytest.mark.parametrize("counts", [[-1, 3], torch.tensor([-1, 3])], ids=["ints", "tensor"])
def test_host_counts_refuse_minus_one_and_a_wrong_count_of_experts(counts):
    from cute_mxfp8.nn.modules import offsets_from_counts

    with pytest.raises(ValueError, match="must be >= 0"):
        offsets_from_counts(counts, 2, 10, "cpu")
    with pytest.raises(ValueError, match="must hold 3 integer counts"):
        offsets_from_counts([1, 2], 3, 10, "cpu")


def test_convert_keeps_buffers_and_attributes():
    """A converted module keeps its buffers (persistent or not, so the state dict and strict loading of an old
    checkpoint are unchanged) and plain attributes (framework flags, a user's tags); before, only parameters moved
    to the new module and a Linear's buffer vanished from the state dict."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    lin.register_buffer("mask", torch.rand(64))
    lin.register_buffer("scratch", torch.rand(3), persistent=False)
    lin.my_tag, lin._is_hf_initialized = "keep me", True
    ffn = FeedForward(64, 128)
    ffn.register_buffer("step", torch.tensor(7))
    experts = GroupedExperts(64, 128, 4)
    experts.register_buffer("tokens_seen", torch.arange(4))
    model = nn.Sequential(lin, ffn, experts)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = convert_to_mxfp8(model)
    assert [k for _, k in report.converted] == ["MXFP8Linear", "MXFP8SwiGLUMLP", "MXFP8GroupedExperts"], report
    sd = model.state_dict()
    assert list(sd) == list(before) and all(torch.equal(sd[k], before[k]) for k in before)
    assert "0.mask" in sd and "1.step" in sd and "2.tokens_seen" in sd and "0.scratch" not in sd
    assert torch.equal(model[0].scratch, lin.scratch) and model[0].my_tag == "keep me"
    assert model[0]._is_hf_initialized is True and model[1].step.item() == 7
    model.load_state_dict(before)  # strict
    fresh = nn.Sequential(nn.Linear(64, 64), FeedForward(64, 128), GroupedExperts(64, 128, 4))
    fresh[0].register_buffer("mask", torch.zeros(64))
    fresh[1].register_buffer("step", torch.tensor(0))
    fresh[2].register_buffer("tokens_seen", torch.zeros(4, dtype=torch.long))
    fresh.load_state_dict(model.state_dict())  # and back into the high-precision model


def test_convert_leaves_modules_with_hooks_and_does_not_run_them():
    """Hooks would be lost with the swapped module (and a fused MLP never calls its child Linears), so modules
    with forward / backward hooks or an instance-level forward stay in high precision, reported; the probe that
    checks an FFN's math does not run a hooked FFN (its hooks saw probe data before)."""
    calls = []
    hook = lambda mod, args, out: calls.append(type(mod).__name__)  # noqa: E731
    lin = nn.Linear(64, 64)
    lin.register_forward_hook(hook)
    pre = nn.Linear(64, 64)
    pre.register_forward_pre_hook(lambda mod, args: None)
    ffn = FeedForward(64, 128)
    ffn.register_forward_hook(hook)
    child = FeedForward(64, 128)  # a hook on one of its Linears: the fused MLP would never call it
    child.w1.register_full_backward_hook(lambda mod, gi, go: None)
    wrapped = nn.Linear(64, 64)
    wrapped.forward = functools.partial(nn.Linear.forward, wrapped)  # as accelerate's hooks do
    model = nn.Sequential(lin, pre, ffn, child, wrapped, nn.Linear(64, 64))
    report = convert_to_mxfp8(model)
    assert calls == []  # nothing ran during the conversion
    skipped = dict(report.skipped)
    assert "forward hooks" in skipped["0"] and "forward pre-hooks" in skipped["1"]
    assert "SwiGLU FFN not fused: FeedForward has forward hooks" in skipped["2"]
    assert "SwiGLU FFN not fused: its submodule 'w1' has backward hooks" in skipped["3"]  # (reported, not silent)
    assert "Linear has backward hooks" in skipped["3.w1"]
    assert "forward replaced on the instance" in skipped["4"]
    converted = dict(report.converted)
    assert converted == {"2.w1": "MXFP8Linear", "2.w2": "MXFP8Linear", "2.w3": "MXFP8Linear",
                         "3.w2": "MXFP8Linear", "3.w3": "MXFP8Linear", "5": "MXFP8Linear"}, converted
    assert type(model[0]) is nn.Linear and type(model[3].w1) is nn.Linear
    model(torch.randn(4, 64))
    assert calls == ["Linear", "FeedForward"]  # the hooks still fire on the real forward
    with pytest.raises(ValueError, match="has forward hooks"):
        MXFP8Linear.from_linear(lin)
    child = FeedForward(64, 128)
    child.w1.register_full_backward_hook(lambda mod, gi, go: None)
    with pytest.raises(ValueError, match="its submodule 'w1' has backward hooks"):
        MXFP8SwiGLUMLP.from_module(child)
    experts = GroupedExperts(64, 128, 4)
    experts.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(ValueError, match="has forward pre-hooks"):
        MXFP8GroupedExperts.from_module(experts)
    assert "grouped experts kept in high precision" in dict(convert_to_mxfp8(nn.Sequential(experts)).skipped)["0"]


def test_convert_converts_every_slot_of_a_shared_module_once():
    """A Linear held in two slots of one parent (``named_children`` lists it once) and one held by two parents
    become one MXFP8Linear in every slot, so the sharing survives and no slot stays in high precision silently."""
    lin = nn.Linear(64, 64)
    model = nn.Sequential(lin, nn.ReLU(), lin, nn.Sequential(lin))
    report = convert_to_mxfp8(model)
    assert dict(report.converted) == {"0": "MXFP8Linear", "2": "MXFP8Linear", "3.0": "MXFP8Linear"}, report
    assert type(model[0]) is MXFP8Linear and model[2] is model[0] and model[3][0] is model[0]
    assert model[0].weight is lin.weight and list(model.state_dict()) == ["0.weight", "0.bias", "2.weight",
                                                                         "2.bias", "3.0.weight", "3.0.bias"]
    x = torch.randn(4, 64)
    assert torch.equal(model(x), model[0](model[0](F.relu(model[0](x)))))


def test_convert_leaves_modules_whose_state_dict_the_swap_would_change():
    """State-dict / load hooks, a class keeping extra state (``get_extra_state``) and a buffer named like the MXFP8
    module's own attribute (``config``) would change or break the state dict: those modules stay, reported."""
    class Tagged(nn.Linear):  # keeps nn.Linear.forward, so it is a candidate by its forward
        def get_extra_state(self):
            return {"tag": 1}

        def set_extra_state(self, state):
            pass

    hooked = nn.Linear(64, 64)
    hooked.register_state_dict_post_hook(lambda mod, sd, prefix, local: None)
    loaded = nn.Linear(64, 64)
    loaded.register_load_state_dict_post_hook(lambda mod, keys: None)
    clash = nn.Linear(64, 64)
    clash.register_buffer("config", torch.zeros(1))
    model = nn.Sequential(hooked, loaded, Tagged(64, 64), clash, nn.Linear(64, 64))
    before = list(model.state_dict())
    report = convert_to_mxfp8(model)
    skipped = dict(report.skipped)
    assert "state-dict hooks" in skipped["0"] and "load-state-dict post-hooks" in skipped["1"]
    assert "overriding get_extra_state, set_extra_state" in skipped["2"]
    assert "buffers named ['config']" in skipped["3"] and dict(report.converted) == {"4": "MXFP8Linear"}
    assert list(model.state_dict()) == before  # "2._extra_state" among them


def test_convert_leaves_a_torch_compile_wrapped_module_and_asks_filter_fn_per_slot():
    """A child ``torch.compile`` wrapped runs the module it wraps (its forward is bound to it), so replacing that
    module would be reported but never run: it is skipped.  ``filter_fn`` is asked for every slot of a shared
    module: an excluded slot keeps the high-precision module (sharing the parameters), either order; a shared
    leaf left alone is reported for each slot."""
    ffn = torch.compile(FeedForward(64, 128), backend="eager")
    model = nn.Sequential(ffn, nn.Linear(64, 64))
    report = convert_to_mxfp8(model)
    assert "compiled by torch.compile" in dict(report.skipped)["0._orig_mod"]
    assert dict(report.converted) == {"1": "MXFP8Linear"} and type(model[0]._orig_mod) is FeedForward
    for first, second in (("trainable", "frozen"), ("frozen", "trainable")):
        lin = nn.Linear(64, 64)
        d = nn.ModuleDict({first: lin, second: lin})
        report = convert_to_mxfp8(d, filter_fn=lambda m, fqn: fqn != "frozen")
        assert dict(report.converted) == {"trainable": "MXFP8Linear"}, report
        assert "excluded by filter_fn" in dict(report.skipped)["frozen"]
        assert type(d["trainable"]) is MXFP8Linear and type(d["frozen"]) is nn.Linear
        assert d["trainable"].weight is d["frozen"].weight
    router = nn.Linear(64, 16)  # 16 outputs: left alone, in both slots
    report = convert_to_mxfp8(nn.Sequential(router, nn.Sequential(router)))
    assert set(dict(report.skipped)) == {"0", "1.0"} and not report.converted


def test_swiglu_mlp_refuses_children_whose_bias_hooks_or_forward_it_would_ignore():
    """The fused MLP reads its Linears' weights and never calls them: a bias, hook, own forward or wrapper put on
    a child after construction would be silently ignored, so the forward raises, naming the child and the fix."""
    torch.manual_seed(0)
    x = torch.randn(4, 64)

    class Scaled(nn.Linear):
        def forward(self, inp):
            return 10 * super().forward(inp)

    class CallZero(nn.Linear):  # its own __call__: the fused MLP would not run it either
        def __call__(self, inp):
            return 0 * super().__call__(inp)

    cases = [(lambda m: m.w1.register_forward_hook(lambda *a: None), ValueError, "'w1' has forward / backward hooks"),
             (lambda m: m.w3.register_forward_pre_hook(lambda mod, a: (a[0] * 0,)), ValueError, "'w3' has forward"),
             (lambda m: setattr(m, "w1", nn.Linear(64, 128)), ValueError, "'w1' has a bias"),
             (lambda m: setattr(m, "w3", Scaled(64, 128, bias=False)), ValueError, r"own forward \(Scaled\)"),
             (lambda m: setattr(m.w2, "forward", lambda inp: inp), ValueError, "forward set on the instance"),
             (lambda m: setattr(m, "w1", CallZero(64, 128, bias=False)), ValueError, r"own __call__ \(CallZero\)"),
             (lambda m: setattr(m, "w2", nn.Sequential(nn.Linear(128, 64, bias=False))), TypeError,
              r"'w2' \(Sequential\) is not an nn.Linear")]
    ref = MXFP8SwiGLUMLP(64, 128)
    want = ref(x)
    for setup, exc, msg in cases:
        m = copy.deepcopy(ref)
        setup(m)
        with pytest.raises(exc, match=msg):
            m(x)
    # what it does run: the Linears' weights, whatever Linear subclass keeps nn.Linear's forward
    sub = copy.deepcopy(ref)
    sub.w1 = type("FrameworkLinear", (nn.Linear,), {})(64, 128, bias=False)
    sub.w1.weight = ref.w1.weight
    assert torch.equal(sub(x), want)


def test_convert_keeps_ffns_and_experts_with_wider_forwards_or_eval_differences():
    """The MXFP8 modules take ``forward(x)`` / ``forward(x, num_tokens_per_expert)`` and compute the same in train
    and eval mode: an FFN with an extra argument or a ``self.training`` branch stays (its Linears convert one by
    one), and so do experts with an extra argument; ``*args`` / ``**kwargs`` alone do not stop the swap."""
    from cute_mxfp8 import convert_to_mxfp8

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(64, 128, bias=False), nn.Linear(64, 128, bias=False)
            self.w2 = nn.Linear(128, 64, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class WithScale(FFN):
        def forward(self, x, scale=None):
            return super().forward(x) * (1.0 if scale is None else scale)

    class HalfInEval(FFN):
        def forward(self, x):
            y = super().forward(x)
            return y if self.training else 0.5 * y

    class TakesKwargs(FFN):
        def forward(self, x, *args, **kwargs):
            return super().forward(x)

    class DoubleWithGrad(FFN):  # a grad-mode branch (the probe once ran under no_grad only)
        def forward(self, x):
            y = super().forward(x)
            return 2 * y if torch.is_grad_enabled() else y

    for cls, fused in ((FFN, True), (WithScale, False), (HalfInEval, False), (TakesKwargs, True),
                       (DoubleWithGrad, False)):
        model = nn.Sequential(cls())
        report = convert_to_mxfp8(model)
        assert isinstance(model[0], MXFP8SwiGLUMLP) is fused, (cls.__name__, report)
        if not fused:
            assert isinstance(model[0].w1, MXFP8Linear) and report.skipped[0][0] == "0", report
    assert "takes scale besides x" in dict(convert_to_mxfp8(nn.Sequential(WithScale())).skipped)["0"]

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = (nn.Parameter(torch.randn(2, 64, 32) * 0.1) for _ in range(2))
            self.w2 = nn.Parameter(torch.randn(2, 32, 64) * 0.1)

        def forward(self, x, num_tokens_per_expert, scores=None):
            out, start = [], 0
            for g, n in enumerate(num_tokens_per_expert.tolist()):
                xe = x[start:start + n]
                out.append(F.silu(xe @ self.w1[g].T) * (xe @ self.w3[g].T) @ self.w2[g].T)
                start += n
            return torch.cat(out)

    model = nn.Sequential(Experts())
    report = convert_to_mxfp8(model)
    assert type(model[0]) is Experts and "takes scores besides x, num_tokens_per_expert" in dict(report.skipped)["0"]


def test_convert_reports_an_ffn_left_unfused_by_hooks_on_one_of_its_linears():
    """A hook on one Linear of a SwiGLU FFN: the FFN is reported unfused (the fused MLP would never call that
    Linear), the hooked Linear stays, the other two convert."""
    from cute_mxfp8 import convert_to_mxfp8

    ffn = FeedForward(64, 128)
    ffn.w3.register_forward_hook(lambda *a: None)
    model = nn.Sequential(ffn)
    report = convert_to_mxfp8(model)
    reasons = dict(report.skipped)
    assert "SwiGLU FFN not fused: its submodule 'w3' has forward hooks" in reasons["0"]
    assert "never calls its Linears" in reasons["0"] and "convert before" not in reasons["0"]
    assert "0.w3" in reasons and sorted(f for f, _ in report.converted) == ["0.w1", "0.w2"]
    assert type(model[0].w3) is nn.Linear and isinstance(model[0].w1, MXFP8Linear)


def test_convert_probes_ffns_in_inference_mode_and_names_hooks_on_dropped_children():
    """convert_to_mxfp8 called under ``torch.inference_mode``: the probe's grad-mode run still runs (an FFN that
    checkpoints its forward is fused); a state-dict hook on a child the fused module drops keeps the FFN, and the
    reason says why."""
    from torch.utils.checkpoint import checkpoint

    from cute_mxfp8 import convert_to_mxfp8

    class Ckpt(FeedForward):
        def forward(self, x):
            return checkpoint(super().forward, x, use_reentrant=False)

    model = nn.Sequential(Ckpt(64, 128))
    with torch.inference_mode():
        report = convert_to_mxfp8(model)
    assert report.converted == [("0", "MXFP8SwiGLUMLP")], report
    ffn = FeedForward(64, 128)
    ffn.act = nn.SiLU()  # (parameter-free: the FFN keeps its SwiGLU shape)
    ffn.act._register_state_dict_hook(lambda mod, sd, prefix, meta: sd)
    reason = dict(convert_to_mxfp8(nn.Sequential(ffn)).skipped)["0"]
    assert "its submodule 'act' has state-dict hooks, which would be lost with it" in reason, reason


def test_convert_fuses_an_ffn_whose_linears_have_state_dict_hooks():
    """State-dict and load-state-dict hooks on an FFN's Linears do not block fusing: the fused MLP keeps the
    Linear objects, so those hooks still run (only call hooks, which it would skip, do)."""
    from cute_mxfp8 import convert_to_mxfp8

    ffn = FeedForward(64, 128)
    saved, loaded = [], []
    ffn.w1._register_state_dict_hook(lambda mod, sd, prefix, meta: saved.append(prefix))
    ffn.w2.register_load_state_dict_post_hook(lambda mod, keys: loaded.append(mod))
    model = nn.Sequential(ffn)
    want = model.state_dict()
    report = convert_to_mxfp8(model)
    assert report.converted == [("0", "MXFP8SwiGLUMLP")] and report.skipped == []
    assert model[0].w1 is ffn.w1 and list(model.state_dict()) == list(want)
    model.load_state_dict(want)
    assert saved == ["0.w1.", "0.w1."] and loaded == [ffn.w2]  # (the hooks ran on the fused module too)
