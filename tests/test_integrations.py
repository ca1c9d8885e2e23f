"""``convert_to_mxfp8`` and the integrations on the real client packages (tiny models, CPU reference backend; the
same code runs the kernels on a GPU): Hugging Face transformers 5.x (Llama MLP, Mixtral / Qwen3-MoE experts through
the experts-implementation registry) and torchtitan 0.3.0 modules.  Skipped when a package is not installed (the
``test`` extra installs both)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from compile_checks import assert_compile_matches_eager
from cute_mxfp8 import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP, convert_to_mxfp8


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# cpu: the reference backend, fp32.  cuda (the H200, `-m gpu`): the automatically chosen kernels, both models under
# bf16 autocast with fp32 weights, so the baseline is the usual bf16 mixed-precision run.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 with -m gpu)")])]


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")


# ---- Hugging Face transformers -------------------------------------------------------------------------------

def _llama(seed):
    tf = pytest.importorskip("transformers", minversion="5.0")
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return tf, tf.LlamaForCausalLM(cfg)


def _moe(kind: str, seed):
    tf = pytest.importorskip("transformers", minversion="5.0")
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "mixtral":
        return tf, tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=64, num_local_experts=4,
                                                         num_experts_per_tok=2, **common))
    return tf, tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=64, intermediate_size=128,
                                                       num_experts=4, num_experts_per_tok=2, **common))


def test_hf_llama_mlps_become_the_fused_mlp_and_checkpoints_interchange(seed, tmp_path):
    tf, model = _llama(seed)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = convert_to_mxfp8(model)
    assert report.skipped == [], str(report)
    mlps = [m for m in model.modules() if isinstance(m, MXFP8SwiGLUMLP)]
    assert len(mlps) == 2 and all(m.names == ("gate_proj", "down_proj", "up_proj") for m in mlps)
    assert sum(isinstance(m, MXFP8Linear) for m in model.modules()) == 9  # q, k, v, o per layer + lm_head
    assert list(model.state_dict()) == keys  # same keys, same tensors
    ids = torch.randint(0, 128, (2, 16))
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert abs(float(loss) - float(ref_loss)) < 0.02 * float(ref_loss)
    loss.backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    assert model.generate(ids[:1, :4], max_new_tokens=3, min_new_tokens=3, do_sample=False).shape == (1, 7)
    model.save_pretrained(tmp_path)
    back = tf.LlamaForCausalLM.from_pretrained(tmp_path)  # an unconverted model
    for (k, v), (k2, v2) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_moe_experts_run_the_mxfp8_grouped_mlp(kind, seed):
    """convert_to_mxfp8 points every experts module at the MXFP8 experts forward (parameters untouched); the
    registry route (``set_experts_implementation("cute_mxfp8")``) gives the same result; losses and gradients
    match the bf16 model's within MXFP8's error."""
    from cute_mxfp8.integrations import transformers as mx_hf

    tf, model = _moe(kind, seed)
    for p in model.parameters():  # HF leaves some expert weights at torch.empty: give them values
        if p.dim() == 3:
            nn.init.normal_(p, std=0.05)
    ref, routed = copy.deepcopy(model), copy.deepcopy(model)
    report = convert_to_mxfp8(model)
    experts = [f for f, k in report.converted if k == "MXFP8 experts forward (transformers)"]
    assert len(experts) == 2, str(report)
    ids = torch.randint(0, 128, (2, 16))
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert abs(float(loss) - float(ref_loss)) < 0.02 * float(ref_loss)
    loss.backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0
    # one experts module on the same tokens and routing (a whole model's routing flips under any rounding)
    e_mx, e_ref = model.model.layers[1].mlp.experts, ref.model.layers[1].mlp.experts
    hs = torch.randn(24, 64, requires_grad=True)
    top = torch.stack([torch.randperm(4)[:2] for _ in range(24)])
    w = torch.rand(24, 2)
    outs = []
    for ex in (e_mx, e_ref):
        for p in ex.parameters():
            p.grad = None
        hs.grad = None
        y = ex(hs, top, w)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), hs.grad.clone(), ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone()))
    for what, a, b in zip(("y", "dx", "d gate_up_proj", "d down_proj"), *outs):
        assert _rel_err(a, b) < 0.1, what  # MXFP8 operands in every GEMM: a few % each
    buf = io.BytesIO()  # a converted model pickles and loads back (the experts' forward is a partial)
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    experts_only = copy.deepcopy(routed)
    report = convert_to_mxfp8(experts_only, filter_fn=lambda m, fqn: fqn.endswith(".experts"))
    assert [f for f, _ in report.converted] == experts
    assert mx_hf.register() == "cute_mxfp8"
    routed.set_experts_implementation("cute_mxfp8")
    with torch.no_grad():
        assert torch.equal(routed(ids).logits, experts_only(ids).logits)


def test_hf_biased_mlp_is_reported_and_converted_per_linear(seed):
    tf = pytest.importorskip("transformers", minversion="5.0")
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               mlp_bias=True))
    report = convert_to_mxfp8(model)
    skipped = dict(report.skipped)
    assert "biased Linears" in skipped["model.layers.0.mlp"], str(report)
    assert dict(report.converted)["model.layers.0.mlp.gate_proj"] == "MXFP8Linear"


def test_hf_experts_layout_it_cannot_take_is_refused_by_name(seed):
    from cute_mxfp8.integrations.transformers import experts_layout_reason, mxfp8_experts_forward

    _, model = _moe("mixtral", seed)
    experts = model.model.layers[0].mlp.experts
    assert experts_layout_reason(experts) is None
    experts.has_bias = True
    assert "has_bias=True" in experts_layout_reason(experts)
    report = convert_to_mxfp8(model)
    assert any("has_bias=True" in why for _, why in report.skipped)  # reported, not silently left
    with pytest.raises(ValueError, match="experts_implementation='grouped_mm'"):
        mxfp8_experts_forward(experts, torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))


def test_hf_experts_offsets_are_vouched_for_so_the_casts_do_not_read_them(seed, monkeypatch):
    """The experts forward makes its group offsets on the device (searchsorted of the sorted expert ids: valid by
    construction) and marks them safe for its T * k rows, so the GPU backends' grouped casts take them without a
    host read (check_offsets skips them); the values are the per-expert ends of the sorted ids, and each expert's
    rows are its tokens in order."""
    from cute_mxfp8.integrations import transformers as mx_hf
    from cute_mxfp8.ops import group_meta

    _, model = _moe("mixtral", seed)
    experts = model.model.layers[0].mlp.experts
    seen = []
    real = mx_hf.mxfp8_swiglu_mlp_packed

    def spy(x, w13, w2, offs, config=None):
        assert w13 is experts.gate_up_proj and w2 is experts.down_proj  # the parameters themselves: no copies
        seen.append((x, offs, group_meta.safe_bound(offs)))
        return real(x, w13, w2, offs, config)

    monkeypatch.setattr(mx_hf, "mxfp8_swiglu_mlp_packed", spy)
    ids = torch.tensor([[3, 0], [1, 3], [0, 2], [3, 1], [2, 0]])  # 5 tokens, top-2 of 4 experts
    hidden = torch.randn(5, 64)
    mx_hf.mxfp8_experts_forward(experts, hidden, ids, torch.rand(5, 2))
    (x, offs, bound), = seen
    assert x.shape[0] == 10 and bound == 10
    # each expert's rows in token order (a stable sort): the colwise casts' token blocks are device-independent
    assert torch.equal(x, hidden[[0, 2, 4, 1, 3, 2, 4, 0, 1, 3]])
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 5, 7, 10]
    # the check the casts run passes without reading them: a read would raise here
    monkeypatch.setattr(group_meta, "validated_end", lambda *a: pytest.fail("offsets read back"))
    group_meta.check_offsets(offs, 10)


def test_hf_experts_compile_fullgraph_and_refuse_3d_hidden_states(seed):
    """The converted experts forward traces as one graph (its layout check probes no activation that is an
    nn.SiLU, and skips the data-dependent probe while compiling), bit-equal to eager; hidden states that are not
    (tokens, hidden) get a ValueError naming the layout."""
    from cute_mxfp8.integrations import transformers as mx_hf

    _, model = _moe("mixtral", seed)
    convert_to_mxfp8(model)
    experts = model.model.layers[0].mlp.experts
    assert type(experts.act_fn).__name__ == "SiLUActivation"  # taken by its type: no probe
    calls = []
    real_allclose = torch.allclose
    torch.allclose = lambda *a, **k: calls.append(1) or real_allclose(*a, **k)
    try:
        assert mx_hf.experts_layout_reason(experts) is None and not calls
    finally:
        torch.allclose = real_allclose
    h = torch.randn(8, 64)
    idx = torch.randint(0, 4, (8, 2))
    w = torch.rand(8, 2)
    eager = experts(h, idx, w)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, i, w: experts(h, i, w), fullgraph=True, backend="eager")(h, idx, w)
    assert torch.equal(compiled, eager)
    with pytest.raises(ValueError, match=r"hidden_states must be \(tokens, hidden\)"):
        experts(h.view(2, 4, 64), idx, w)


def test_hf_experts_with_dims_off_the_block_size_are_refused_by_the_layout_check(seed):
    """An experts module whose I is not a multiple of 32 fails the layout check (convert_to_mxfp8 reports it; the
    registry route's forward names the stock implementation to use instead)."""
    tf = pytest.importorskip("transformers", minversion="5.0")
    from cute_mxfp8.integrations.transformers import experts_layout_reason, mxfp8_experts_forward

    torch.manual_seed(seed)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=48,
                                                   num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2))
    experts = model.model.layers[0].mlp.experts
    assert "I=48 not a multiple of the MX block size 32" in experts_layout_reason(experts)
    with pytest.raises(ValueError, match="I=48 .*experts_implementation='grouped_mm'"):
        mxfp8_experts_forward(experts, torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))
    assert any("I=48" in why for _, why in convert_to_mxfp8(model).skipped)


# ---- torchtitan 0.3.0 ------------------------------------------------------------------------------------------

def test_torchtitan_modules_convert_with_their_names_and_init_hooks(rng):
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")  # torchtitan's MoE module imports it
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear, ScaledBiasRowwiseLinear
    from torchtitan.models.common.moe import GroupedExperts

    def lin(i, o):
        return Linear.Config(in_features=i, out_features=o)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.feed_forward = FeedForward(FeedForward.Config(w1=lin(64, 128), w2=lin(128, 64), w3=lin(64, 128)))
            self.experts = GroupedExperts(GroupedExperts.Config(dim=64, hidden_dim=128, num_experts=4))
            self.wo = Linear(lin(64, 64))
            self.rowwise = ScaledBiasRowwiseLinear(ScaledBiasRowwiseLinear.Config(in_features=64, out_features=64))

    block = Block()
    for p in block.experts.parameters():
        nn.init.normal_(p, std=0.05, generator=rng)
    block.wo._param_init = {"weight": nn.init.zeros_}
    ref = copy.deepcopy(block)
    keys = list(block.state_dict())
    report = convert_to_mxfp8(block)
    assert dict(report.converted) == {"feed_forward": "MXFP8SwiGLUMLP", "feed_forward.w1": "MXFP8SwiGLUMLP",
                                      "experts": "MXFP8GroupedExperts", "wo": "MXFP8Linear"} or \
        dict(report.converted) == {"feed_forward": "MXFP8SwiGLUMLP", "experts": "MXFP8GroupedExperts",
                                   "wo": "MXFP8Linear"}
    assert [f for f, _ in report.skipped] == ["rowwise"]  # its own forward (bias / TP degree): kept, said why
    assert isinstance(block.experts, MXFP8GroupedExperts) and block.experts.names == ("w1_EFD", "w2_EDF", "w3_EFD")
    assert type(block.feed_forward.w1) is Linear  # the framework's Linears stay, shared
    assert block.wo._param_init["weight"] is nn.init.zeros_
    assert list(block.state_dict()) == keys
    x = torch.randn(12, 64, generator=rng)
    assert _rel_err(block.feed_forward(x), ref.feed_forward(x)) < 0.1
    counts = torch.tensor([3, 0, 5, 4])
    assert _rel_err(block.experts(x, counts), ref.experts(x, counts)) < 0.1


def test_torchtitan_overrides_build_meta_init_and_match_the_stock_math(rng):
    """The @override factories on a real llama3 debug model config: every FeedForward replaced, the model passes
    torchtitan's Module protocol check, builds on the meta device and initializes with init_states (param_init
    kept); the MXFP8 FFN / experts equal the stock ones within MXFP8 error on the same weights, same state dict."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.llama3 import llama3_configs

    from cute_mxfp8.integrations import torchtitan as mx_tt

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    log = apply_overrides(OverrideConfig(imports=["cute_mxfp8.integrations.torchtitan.mxfp8_feed_forward"]), cfg)
    with torch.device("meta"):
        model = cfg.build()
    ffns = [m for m in model.modules() if isinstance(m, mx_tt.MXFP8FeedForward)]
    assert len(ffns) == len(log) == len(model.layers) > 0
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.init_states()
    assert all(bool(p.isfinite().all()) for p in model.parameters())  # param_init reached the MXFP8 FFNs
    ffn = ffns[0]
    stock = llama3_configs["debugmodel"](attn_backend="flex").layers[0].feed_forward.build()
    stock.load_state_dict(ffn.state_dict())
    x = torch.randn(2, 8, ffn.w1.in_features, generator=rng)
    assert _rel_err(ffn(x), stock(x)) < 0.1

    gcfg = GroupedExperts.Config(dim=64, hidden_dim=128, num_experts=4)
    experts = mx_tt.mxfp8_grouped_experts(gcfg).build()
    assert isinstance(experts, mx_tt.MXFP8GroupedExperts) and isinstance(experts, GroupedExperts)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.05, generator=rng)
    ref = gcfg.build()
    ref.load_state_dict(experts.state_dict())
    x2, counts = torch.randn(12, 64, generator=rng), torch.tensor([3, 0, 5, 4])
    y = experts(x2, counts)
    assert _rel_err(y, ref(x2, counts)) < 0.1
    y.sum().backward()
    assert experts.w2_EDF.grad is not None and bool(experts.w2_EDF.grad.abs().sum() > 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_hf_models_train_20_steps_like_the_unconverted_model(kind, device, seed):
    """20 AdamW steps on the same batches: the converted model's losses track the unconverted one's (every step
    within 2 %) and both learn (final loss below the first)."""
    tf, model = _llama(seed) if kind == "llama" else _moe("mixtral", seed)
    for p in model.parameters():
        if p.dim() == 3:
            nn.init.normal_(p, std=0.05)
    model.to(device)
    ref = copy.deepcopy(model)
    report = convert_to_mxfp8(model)
    assert report.converted and not report.skipped
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 128, (4, 32), generator=gen).to(device) for _ in range(4)]
    _train_side_by_side((ref, model), [batches[step % 4] for step in range(20)],
                        lambda m, ids: m(ids, labels=ids).loss, 1e-3, device)


def _train_side_by_side(models, batches, loss_of, lr, device):
    """AdamW on the same batches for the reference and the converted model: every step's loss within 2 % of the
    reference's, and the converted model learns (final loss at least 0.5 below its first)."""
    losses = []
    for m in models:
        opt = torch.optim.AdamW(m.parameters(), lr=lr)
        run = []
        for ids in batches:
            with _autocast(device):
                loss = loss_of(m, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss))
        losses.append(run)
    for step, (a, b) in enumerate(zip(*losses)):
        assert abs(b - a) <= 0.02 * a, (step, a, b)
    assert losses[1][-1] < losses[1][0] - 0.5


def _titan_tiny(kind: str, converters=None):
    """A torchtitan 0.3.0 model config from its own registry, trimmed for the CPU: 2 layers, SDPA attention (flex
    attention has no CPU backward), MoE experts 128 wide (64 experts, top 8: odd-sized and empty groups)."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.moe import GroupedExperts

    if kind == "llama3":
        from torchtitan.models.llama3 import model_registry
        spec = model_registry("debugmodel", attn_backend="flex", converters=converters)
    else:
        from torchtitan.models.qwen3 import model_registry
        spec = model_registry("debugmodel_moe", attn_backend="flex", converters=converters)
    cfg = spec.model
    cfg.layers = cfg.layers[:2]
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    for _, experts, _, _ in cfg.traverse(GroupedExperts.Config):
        experts.hidden_dim = 128
    return cfg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama3", "qwen3_moe"])
def test_torchtitan_models_train_20_steps_and_checkpoints_interchange(kind, device, seed, tmp_path):
    """torchtitan's model converter (MXFP8Converter in the model registry's ``converters``): the llama3 and
    Qwen3-MoE debug models convert every FFN / experts block, build on the meta device, initialize with
    init_states, keep the stock state dict; 20 AdamW steps track the stock model's losses (every step within 2 %);
    a DCP checkpoint of the trained MXFP8 model loads into the stock model and back, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.nn.functional import cross_entropy

    from cute_mxfp8.integrations import torchtitan as mx_tt

    conv = mx_tt.MXFP8Converter.Config()
    cfg = _titan_tiny(kind, converters=[conv])
    stock_cfg = _titan_tiny(kind)
    with torch.device("meta"):
        model = cfg.build()
    mx_types = (mx_tt.MXFP8FeedForward, mx_tt.MXFP8GroupedExperts)
    assert sum(isinstance(m, mx_types) for m in model.modules()) == 2  # one FFN / experts per layer
    model.verify_module_protocol()
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_states(buffer_device=torch.device(device))
    with torch.device(device):
        ref = stock_cfg.build()
    assert not any(isinstance(m, mx_types) for m in ref.modules())
    assert list(ref.state_dict()) == list(model.state_dict())
    ref.load_state_dict(model.state_dict())

    # A learnable stream over 64 of the 2048 tokens, a fresh batch each step (no memorizing): t[i+1] = t[i] + 1..4
    # mod 64.
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(20):
        ids = torch.empty(2, 65, dtype=torch.long)
        ids[:, 0] = torch.randint(0, 64, (2,), generator=gen)
        jumps = torch.randint(1, 5, (2, 64), generator=gen)
        for i in range(64):
            ids[:, i + 1] = (ids[:, i] + jumps[:, i]) % 64
        batches.append(ids.to(device))
    # lr 3e-4: at 1e-3 the MoE model's routing turns chaotic while the loss falls fast, and bf16 autocast drifts
    # from fp32 as far as MXFP8 does (1-25 % on 4 seeds; 0.01-0.02 % for both at 3e-4).
    _train_side_by_side((ref, model), batches, lambda m, ids: cross_entropy(
        m(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()), 3e-4, device)

    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "mx"))
    with torch.device(device):
        fresh, back = stock_cfg.build(), cfg.build()
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "mx"))
    fresh.load_state_dict(sd)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    dcp.save(fresh.state_dict(), checkpoint_id=str(tmp_path / "stock"))
    sd = back.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "stock"))
    back.load_state_dict(sd)
    ids = batches[0][:, :-1]
    with torch.no_grad(), _autocast(device):
        assert torch.equal(back(ids), model(ids))
        assert _rel_err(model(ids), fresh(ids)) < 0.1


def test_torchtitan_converter_narrows_by_name_and_kind():
    pytest.importorskip("torchtitan")
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.qwen3 import model_registry as qwen3_registry

    from cute_mxfp8 import MXFP8Config
    from cute_mxfp8.integrations import torchtitan as mx_tt

    conv = mx_tt.MXFP8Converter(mx_tt.MXFP8Converter.Config(fqns=["layers.1."],
                                                            mxfp8=MXFP8Config(scale_mode="floor")))
    cfg = conv.convert(model_registry("debugmodel").model)
    kinds = [type(layer.feed_forward).__qualname__ for layer in cfg.layers]
    assert kinds[1] == "MXFP8FeedForward.Config" and kinds.count("MXFP8FeedForward.Config") == 1
    assert conv.converted == ["layers.1.feed_forward"]
    assert cfg.layers[1].feed_forward.mxfp8.scale_mode == "floor"
    ffn = cfg.layers[1].feed_forward.build()
    assert ffn.mxfp8_config.scale_mode == "floor"
    only_ffn = mx_tt.MXFP8Converter(mx_tt.MXFP8Converter.Config(experts=False))
    moe = only_ffn.convert(qwen3_registry("debugmodel_moe").model)
    assert only_ffn.converted == []  # the MoE model's FFNs are experts blocks: nothing of the kind asked for
    assert not any(isinstance(c, mx_tt.MXFP8GroupedExperts.Config)
                   for _, c, _, _ in moe.traverse(mx_tt.MXFP8GroupedExperts.Config))
    # a lone string matched character by character (every FFN converted): refused, as are other wrong types
    for bad, msg in (({"fqns": "layers.1."}, r"fqns must be a list of str .* write \['layers.1.'\]"),
                     ({"fqns": [1]}, "fqns must be a list of str"), ({"fqns": None}, "fqns must be a list of str"),
                     ({"fqns": (f for f in ["a"])}, "fqns must be a list of str"),
                     ({"experts": 1}, "experts must be a bool"),
                     ({"mxfp8": "floor"}, "mxfp8 must be a cute_mxfp8.MXFP8Config or None")):
        with pytest.raises(TypeError, match=msg):
            mx_tt.MXFP8Converter(mx_tt.MXFP8Converter.Config(**bad))


@pytest.mark.slow
def test_torchtitan_mxfp8_modules_compile_fullgraph(rng):
    """torch.compile(fullgraph=True) of the converter's FeedForward and GroupedExperts: one graph each (the MXFP8
    custom ops have exact fake impls), forward and gradients equal to eager."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts

    from cute_mxfp8.integrations import torchtitan as mx_tt

    def lin(i, o):
        return Linear.Config(in_features=i, out_features=o)

    ffn = mx_tt.mxfp8_feed_forward(FeedForward.Config(w1=lin(64, 128), w2=lin(128, 64), w3=lin(64, 128))).build()
    experts = mx_tt.mxfp8_grouped_experts(GroupedExperts.Config(dim=64, hidden_dim=128, num_experts=4)).build()
    for p in [*ffn.parameters(), *experts.parameters()]:
        nn.init.normal_(p, std=0.05, generator=rng)
    counts = torch.tensor([3, 0, 5, 4])
    assert_compile_matches_eager(ffn, (torch.randn(2, 6, 64, generator=rng),))
    assert_compile_matches_eager(experts, (torch.randn(12, 64, generator=rng), counts))


@pytest.mark.parametrize("kind", ["llama3", "qwen3_moe"])
def test_convert_on_the_meta_device_keeps_what_init_states_must_initialize(kind):
    """``convert_to_mxfp8`` on a torchtitan model still on the meta device: init_states runs only on torchtitan's
    own Module classes, so an MXFP8Linear or MXFP8GroupedExperts in place of a torchtitan Linear / experts module
    would keep to_empty's garbage.  Those stay, reported with the fix; the SwiGLU FFNs convert (their Linears keep
    their class and initialize).  After init_states every parameter is set; converting then takes the Linears and
    experts too."""
    from cute_mxfp8 import convert_to_mxfp8

    cfg = _titan_tiny(kind)
    with torch.device("meta"):
        model = cfg.build()
    report = convert_to_mxfp8(model)
    kinds = {k for _, k in report.converted}
    assert kinds == ({"MXFP8SwiGLUMLP"} if kind == "llama3" else set()), report
    meta_skips = [fqn for fqn, why in report.skipped if "convert after init_states" in why]
    assert any(f.endswith("attention.wo") for f in meta_skips) and any(f == "lm_head" for f in meta_skips)
    reasons = dict(report.skipped)
    assert "MXFP8Converter" not in reasons["lm_head"] and "quantize_weights_" in reasons["lm_head"]
    if kind == "qwen3_moe":
        experts = [f for f in meta_skips if f.endswith("experts")]
        assert experts and all("MXFP8Converter" in reasons[f] for f in experts), meta_skips
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # what init_states leaves alone stays NaN
    torch.manual_seed(0)
    model.init_states(buffer_device=torch.device("cpu"))
    assert [n for n, p in model.named_parameters() if p.isnan().any()] == []
    after = convert_to_mxfp8(model)
    done = {k for _, k in after.converted}
    assert "MXFP8Linear" in done and (kind == "llama3" or "MXFP8GroupedExperts" in done), after
    assert not any("convert after init_states" in why for _, why in after.skipped)


def test_convert_of_a_partly_materialized_meta_model_keeps_the_torchtitan_linears():
    """A torchtitan model with one layer materialized and the rest on meta: ``to_empty`` on the model empties the
    materialized layer too, so its Linears must stay torchtitan modules for init_states to reach them."""
    from cute_mxfp8 import convert_to_mxfp8

    with torch.device("meta"):
        model = _titan_tiny("llama3").build()
    model.layers["0"].to_empty(device="cpu")
    report = convert_to_mxfp8(model)
    assert any(f.startswith("layers.0.attention") and "convert after init_states" in why for f, why in report.skipped)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_states(buffer_device=torch.device("cpu"))
    assert [n for n, p in model.named_parameters() if p.isnan().any()] == []
