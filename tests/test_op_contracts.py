"""Contracts every custom op keeps whatever its inputs look like (issue 11): the bytes do not change under
``torch.autocast``; every output has exactly the fake's (contiguous) strides for transposed and sliced inputs
(``opcheck`` included); M = 0 and E = 0 run; ``torch.export`` save / load reproduces the eager bytes.

Run on the CPU, and on CUDA with ``pytest -m gpu`` (where the sm90 kernels take the contiguous calls).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

from cute_mxfp8 import ops
from cute_mxfp8.ops import library as L

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2, torch.float8_e8m0fnu)
# opcheck's schema test compares inputs with allclose, which torch lacks for fp8 (see tests/test_ops.py)
FP8_INPUT_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")])]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in FP8 else t


def _outs(out) -> tuple:
    """An op's outputs as a tuple (one tensor, a tuple, or the list of ``quantize_gate_up``)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _same_bytes(a, b) -> None:
    a, b = _outs(a), _outs(b)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x.shape, x.dtype) == (y.shape, y.dtype), i
        # equal bytes (NaN payloads included): compare integer views
        xi = _u8(x).contiguous().view(torch.uint8 if x.element_size() == 1 else torch.int16 if x.element_size() == 2
                                      else torch.int32)
        yi = _u8(y).contiguous().view(xi.dtype)
        assert torch.equal(xi.cpu(), yi.cpu()), f"output {i} differs"


def _offs(vals, dev):
    return torch.tensor(vals, dtype=torch.int32, device=dev)


def _cases(dev: str, rng: torch.Generator, m: int = 200, e: int = 4):
    """(name, op, args) for every op, inputs drawn fresh; ``m`` tokens, ``e`` experts / token groups."""
    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(dtype).to(dev)

    offs = _offs(sorted(torch.randint(0, m + 1, (e,), generator=rng).tolist()), dev)
    x = rnd(m, 96, scale=4)
    w = rnd(e, 64, 96, dtype=torch.float32)
    a, a_s = ops.quantize_rowwise(rnd(m, 64))
    b, b_s = ops.quantize_rowwise(rnd(96, 64))
    ga, ga_s = ops.quantize_rowwise(rnd(m, 64), offs=offs)
    gb, gb_s = ops.quantize_rowwise(rnd(e, 96, 64))
    wa, wa_s = ops.quantize_colwise(rnd(m, 96), offs=offs)
    wb, wb_s = ops.quantize_colwise(rnd(m, 64), offs=offs)
    w13, w13_s, _, _ = ops.quantize_gate_up(rnd(128, 64), rnd(128, 64), gate_up_tile=64)
    w2, w2_s = ops.quantize_rowwise(rnd(64, 64))  # (I, K) with I = 64: h13 is (M, 128)
    h13 = rnd(m, 128, scale=3)
    return [
        ("quantize_rowwise", L._quantize_rowwise, (x, "rceil", E4M3, True, None, "")),
        ("quantize_rowwise_grouped", L._quantize_rowwise, (x, "floor", E5M2, True, offs, "")),
        ("quantize_rowwise_3d", L._quantize_rowwise, (w, "rceil", E4M3, True, None, "")),
        ("quantize_colwise", L._quantize_colwise, (x, "rceil", E4M3, False, None, "")),
        ("quantize_colwise_grouped", L._quantize_colwise, (x, "rceil", E4M3, True, offs, "")),
        ("quantize_colwise_3d", L._quantize_colwise, (w, "floor", E4M3, True, None, "")),
        ("quantize_dual", L._quantize_dual, (x, "rceil", E4M3, True, None, "")),
        ("quantize_dual_grouped", L._quantize_dual, (x, "rceil", E5M2, True, offs, "")),
        ("quantize_gate_up", L._quantize_gate_up, (w, w * 2, "rceil", E4M3, True, 32, "")),
        ("mm", L._mm, (a, a_s, b, b_s, torch.bfloat16, "")),
        ("mm_bias", L._mm, (a, a_s, b, b_s, torch.bfloat16, "", rnd(96, dtype=torch.float32))),
        ("grouped_mm", L._grouped_mm, (ga, ga_s, gb, gb_s, offs, torch.bfloat16, "")),
        ("grouped_mm_wgrad", L._grouped_mm_wgrad, (wa, wa_s, wb, wb_s, offs, torch.float32, "")),
        ("swiglu_quant", L._swiglu_quant, (h13, "rceil", E4M3, True, True, None, "")),
        ("swiglu_quant_grouped", L._swiglu_quant, (h13, "rceil", E4M3, False, True, offs, "")),
        ("dswiglu_quant", L._dswiglu_quant, (rnd(m, 64), h13, "floor", E5M2, True, True, None, "")),
        ("dswiglu_quant_grouped", L._dswiglu_quant, (rnd(m, 64), h13, "rceil", E4M3, True, False, offs, "")),
        ("mm_swiglu_quant", L._mm_swiglu_quant, (a, a_s, w13, w13_s, "rceil", E4M3, True, torch.bfloat16, "")),
        ("mm_dswiglu_quant", L._mm_dswiglu_quant, (a, a_s, w2, w2_s, h13, "rceil", E5M2, True, "")),
    ]


CASE_NAMES = [c[0] for c in _cases("cpu", torch.Generator().manual_seed(0), m=40, e=2)]


def _case(name, dev, rng, **kw):
    return next(c for c in _cases(dev, rng, **kw) if c[0] == name)


def _relayout(t, how: str):
    """The same values in another memory layout: ``transposed`` (last two dims swapped in memory) or ``sliced``
    (every other element of a buffer twice as wide).  Offsets stay as they are."""
    if not isinstance(t, torch.Tensor) or t.dtype == torch.int32:
        return t
    if how == "transposed" and t.dim() >= 2:
        out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        _u8(wide)[..., ::2] = _u8(t)
        out = wide[..., ::2]
    assert torch.equal(_u8(out), _u8(t)) and (t.numel() <= 1 or not out.is_contiguous())
    return out


def _fake_outputs(op, args):
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


def _checks(args):
    return FP8_INPUT_CHECKS if any(isinstance(a, torch.Tensor) and a.dtype in FP8 for a in args) else None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("how", ["transposed", "sliced"])
def test_outputs_have_the_fake_strides_for_any_input_layout(name, how, device, rng):
    _, op, args = _case(name, device, rng)
    want = op(*args)
    moved = tuple(_relayout(a, how) for a in args)
    got = op(*moved)
    _same_bytes(got, want)
    fake = _fake_outputs(op, moved)
    for r, f in zip(_outs(got), _outs(fake)):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()) and r.is_contiguous()
    checks = _checks(moved)
    opcheck(op, moved, **({"test_utils": checks} if checks else {}))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_fake_and_real_refuse_an_unknown_backend_alike(name, rng):
    """A misspelt backend fails when a program is traced (the fake checks the name), with the real op's error."""
    from cute_mxfp8.ops.backends import BackendUnavailableError

    _, op, args = _case(name, "cpu", rng, m=40, e=2)
    at = args.index("")  # every case passes backend "" (automatic)
    bad = (*args[:at], "nope", *args[at + 1:])
    for run in (lambda: op(*bad), lambda: _fake_outputs(op, bad)):
        with pytest.raises(BackendUnavailableError, match="unknown cute_mxfp8 backend 'nope'"):
            run()


def test_fake_and_real_name_the_same_fault_first():
    """A GEMM call with two faults (fp8 data viewed as uint8, scale_block 64) names the same one in both."""
    a, s = ops.quantize_rowwise(torch.randn(64, 64))
    for args in ((a.view(torch.uint8), s, a, s, torch.float32, "", None, 64, False),):
        for run in (lambda: L._mm(*args), lambda: _fake_outputs(L._mm, args)):
            with pytest.raises(ValueError, match="scale_block must be 32"):
                run()
    offs = torch.tensor([64], dtype=torch.int32)
    c, cs = ops.quantize_colwise(torch.randn(64, 64), offs=offs)
    args = (c.view(torch.uint8), cs, c, cs, offs, torch.float32, "", 64, False)
    for run in (lambda: L._grouped_mm_wgrad(*args), lambda: _fake_outputs(L._grouped_mm_wgrad, args)):
        with pytest.raises(ValueError, match="scale_block must be 32"):
            run()


def test_flags_the_schema_would_coerce_are_refused_before_it():
    """``split_halves=1`` and ``token_align=False`` are refused by the wrappers in eager AND compiled calls (the
    dispatcher's schema would turn them into True / 0 and run)."""
    offs = torch.tensor([20, 64], dtype=torch.int32)
    a, s = ops.quantize_colwise(torch.randn(64, 256), offs=offs)
    x, h13 = torch.randn(64, 256), torch.randn(64, 256)
    calls = [(TypeError, "split_halves must be a bool", lambda: ops.grouped_mm_wgrad(a, s, a, s, offs, split_halves=1))]
    for fn in (ops.quantize_colwise, ops.quantize_dual, ops.swiglu_quant):
        calls.append((TypeError, "token_align must be an int .*got False", lambda fn=fn: fn(x, token_align=False)))
    calls.append((TypeError, "token_align must be an int .*got 1.0",
                  lambda: ops.dswiglu_quant(x[:, :128], h13, token_align=1.0)))
    for err, msg, call in calls:
        with pytest.raises(err, match=msg):
            call()
        with pytest.raises(Exception, match=msg):  # (dynamo reports the wrapper's error as its own type)
            torch.compile(call, fullgraph=True, backend="eager")()


def test_swiglu_hp_of_a_transposed_h13_is_contiguous():
    """The issue's example: ``h`` came back with stride (1, 64), failing opcheck and ``h.view(-1)``."""
    h = ops.swiglu_quant(torch.randn(128, 64).t(), emit_hp=True)[4]
    assert h.shape == (64, 64) and h.stride() == (64, 1)
    h.view(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_changes_no_byte_of_any_op(device, rng):
    """Each op under bf16 autocast, through the dispatcher and the eager wrappers, equals the call without it."""
    for name, op, args in _cases(device, rng):
        want = op(*args)
        with torch.autocast(device, dtype=torch.bfloat16):
            _same_bytes(op(*args), want)
    # the eager wrappers, which skip the dispatcher; the example: 3-D scales blocked under autocast
    x = torch.randn(2, 64, 96, generator=rng).to(device)
    h13, dh = torch.randn(70, 128, generator=rng).to(device), torch.randn(70, 64, generator=rng).to(device)
    offs = _offs([20, 60], device)
    calls = [lambda: ops.quantize_rowwise(x), lambda: ops.quantize_colwise(x), lambda: ops.quantize_dual(x),
             lambda: ops.quantize_dual(h13, offs=offs), lambda: ops.swiglu_quant(h13, offs=offs, emit_hp=True),
             lambda: ops.dswiglu_quant(dh, h13, emit_hp=True)]
    want = [f() for f in calls]
    with torch.autocast(device, dtype=torch.bfloat16):
        for f, w in zip(calls, want):
            _same_bytes(f(), w)
        from cute_mxfp8 import formats as F
        s = F.quantize_mxfp8(x, dim=-1)[1]
        assert torch.equal(_u8(F.from_blocked_scales(F.to_blocked_scales(s), 64, 3)), _u8(s))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,e", [(0, 3), (50, 0), (0, 0)])
def test_empty_tokens_and_experts_through_every_op(device, m, e, rng):
    """M = 0 tokens and E = 0 experts / token groups: every op returns the fake's shapes, and the values of
    the non-empty outputs are what the definitions give (GEMMs over no groups or no rows are zero)."""
    for name, op, args in _cases(device, rng, m=m, e=e):
        out = op(*args)
        fake = _fake_outputs(op, args)
        for r, f in zip(_outs(out), _outs(fake)):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), name
        if name in ("grouped_mm", "grouped_mm_wgrad"):  # no groups, or groups of no rows: zero
            assert torch.all(out == 0), name


class _AllOps(torch.nn.Module):
    def forward(self, x, w1, w3, h13, dh, offs):
        xr, xr_s, xc, xc_s = ops.quantize_dual(x, offs=offs)
        r, r_s = ops.quantize_rowwise(x)
        c, c_s = ops.quantize_colwise(x, blocked=False)
        w13, w13_s, w13c, w13c_s = ops.quantize_gate_up(w1, w3, gate_up_tile=64)
        we, we_s = ops.quantize_rowwise(torch.stack([w1, w3]))
        y = ops.mm(r, r_s, w13, w13_s)
        gy = ops.grouped_mm(xr, xr_s, we, we_s, offs)
        wg = ops.grouped_mm_wgrad(xc, xc_s, xc, xc_s, offs)
        sw = ops.swiglu_quant(h13, emit_hp=True)
        dsw = ops.dswiglu_quant(dh, h13, offs=offs, emit_hp=True)
        f1 = ops.mm_swiglu_quant(r, r_s, w13, w13_s, gate_up_tile=64, emit_hp=True)
        w1r, w1r_s = ops.quantize_rowwise(w1)  # (I, D) K-major along D: the b of (M, D) x (I, D)^T
        f3 = ops.mm_dswiglu_quant(r, r_s, w1r, w1r_s, h13, gate_up_tile=64)
        return (c, c_s, w13c, w13c_s, y, gy, wg, *sw, *dsw, *f1, *f3)


def _serializes_e8m0() -> bool:
    from torch._export.serde import serialize

    return torch.float8_e8m0fnu in getattr(serialize, "_TORCH_TO_SERIALIZE_DTYPE", {})


@pytest.mark.skipif(not _serializes_e8m0(), reason=f"torch {torch.__version__}'s export serializer has no "
                    "float8_e8m0fnu (torch 2.13 has it, 2.11 does not)")
def test_torch_export_save_load_reproduces_eager(rng):
    m, d, i = 70, 64, 128
    offs = torch.tensor([10, 10, 60], dtype=torch.int32)
    args = (torch.randn(m, d, generator=rng), torch.randn(i, d, generator=rng), torch.randn(i, d, generator=rng),
            torch.randn(m, 2 * i, generator=rng), torch.randn(m, i, generator=rng), offs[:2])
    model = _AllOps()
    want = model(*args)
    exported = torch.export.export(model, args)
    buf = io.BytesIO()
    torch.export.save(exported, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    names = {n.target.name() for n in loaded.graph.nodes if n.op == "call_function" and hasattr(n.target, "name")}
    assert {f"cute_mxfp8::{o}" for o in ("quantize_dual", "mm", "grouped_mm", "grouped_mm_wgrad", "swiglu_quant",
                                          "dswiglu_quant", "mm_swiglu_quant", "mm_dswiglu_quant",
                                          "quantize_gate_up")} <= {n.split(".")[0] for n in names}
    _same_bytes(tuple(loaded.module()(*args)), tuple(want))
    fresh = (torch.randn(m, d, generator=rng), *args[1:])  # the program is not specialized to the traced values
    _same_bytes(tuple(loaded.module()(*fresh)), tuple(model(*fresh)))


@pytest.mark.parametrize("shape", [(), (0,), (1,), (5,), (2, 1, 3), (1, 1), (3, 0, 2), (0, 1, 4), (8, 1, 64), (2, 3, 4)])
def test_outputs_take_the_strides_of_torch_empty(shape):
    """Every op output leaves the library with torch.empty(shape)'s strides (what the fakes declare); the host-side
    stride helper agrees with torch on empty and size-1 dims, and a tensor with other strides is copied."""
    assert L._contiguous_strides(torch.Size(shape)) == torch.empty(shape).stride()
    t = torch.randn(tuple(reversed(shape))).permute(tuple(reversed(range(len(shape)))))  # reversed strides
    assert t.shape == shape
    out = L._as_declared(t)
    assert out.stride() == torch.empty(shape).stride() and torch.equal(out, t)


def test_register_backend_refuses_what_is_not_a_backend():
    from cute_mxfp8.ops import backends as B

    before = B.registered_backends()
    for bad in ("sm90", None, B.Backend("", 1, lambda d: None)):
        with pytest.raises(TypeError, match="Backend with a non-empty str name"):
            ops.register_backend(bad)
    assert B.registered_backends() == before


def _meta(*ts):
    return tuple(t.to("meta") for t in ts)


def _operands():
    a, a_s = ops.quantize_rowwise(torch.randn(64, 64))
    b, b_s = ops.quantize_rowwise(torch.randn(96, 64))
    b13, b13_s = ops.quantize_rowwise(torch.randn(192, 64))  # I = 96: not a multiple of the gate/up tile 64
    return a, a_s, b, b_s, b13, b13_s


M = "meta"
I32 = torch.int32
BAD_CALLS = [  # (what, call, the message): every check of the ops' shared shape rules (ops/shapes.py)
    ("offs on another device", lambda o: ops.quantize_rowwise(
        torch.randn(64, 64), offs=torch.tensor([10, 64], dtype=I32, device=M), backend="reference"),
     "offs is on meta but the data is on cpu"),
    ("offs on another device (SwiGLU)", lambda o: ops.swiglu_quant(
        torch.randn(64, 64), offs=torch.tensor([10, 64], dtype=I32, device=M), backend="reference"),
     "offs is on meta but the data is on cpu"),
    ("blocks_2d without scale_block 128", lambda o: ops.quantize_rowwise(torch.empty(64, 64, device=M), blocks_2d=True),
     "needs scale_block=128"),
    ("blocks_2d colwise", lambda o: ops.quantize_colwise(torch.empty(64, 64, device=M), blocks_2d=True),
     "needs scale_block=128"),
    ("K not a multiple of 32", lambda o: ops.quantize_rowwise(torch.empty(64, 48, device=M)),
     "= 48 must be a multiple of the MX block size 32"),
    ("2-D offs", lambda o: ops.swiglu_quant(torch.randn(64, 64), offs=torch.tensor([[10, 64]], dtype=I32),
                                            backend="reference"), "offs must be a 1-D"),
    ("2-D offs (fake)", lambda o: ops.quantize_rowwise(torch.empty(64, 64, device=M),
                                                       offs=torch.tensor([[10, 64]], dtype=I32, device=M)),
     "offs must be a 1-D"),
    ("short scales (fake)", lambda o: ops.mm(*_meta(o[0], o[1][:-4], o[2], o[3])),
     r"a_scales has shape \(508,\), expected \(512,\)"),
    ("offs with 3-D weights", lambda o: ops.quantize_rowwise(torch.randn(2, 64, 64), offs=torch.tensor([10, 64],
                                                                                                       dtype=I32),
                                                             backend="reference"), "3-D \\(E, N, K\\) weights take none"),
    ("offs with 3-D weights (fake)", lambda o: ops.quantize_rowwise(
        torch.empty(2, 64, 64, device=M), offs=torch.tensor([10, 64], dtype=I32, device=M)),
     "3-D \\(E, N, K\\) weights take none"),
    ("bias length", lambda o: ops.mm(*o[:4], bias=torch.randn(64), backend="reference"),
     r"bias has shape \(64,\), expected \(96,\)"),
    ("bias length (fake)", lambda o: ops.mm(*_meta(*o[:4]), bias=torch.randn(64, device=M)),
     r"bias has shape \(64,\), expected \(96,\)"),
    ("odd h13 (fake)", lambda o: ops.swiglu_quant(torch.empty(64, 65, device=M)), "gate and up halves"),
    ("W13 not in whole gate/up tiles (fake)", lambda o: ops.mm_swiglu_quant(*_meta(o[0], o[1], o[4], o[5]),
                                                                            gate_up_tile=64),
     "multiple of the gate/up tile 64"),
    ("I not in whole gate/up tiles (fake)", lambda o: ops.mm_dswiglu_quant(*_meta(*o[:4]),
                                                                           torch.empty(64, 192, device=M),
                                                                           gate_up_tile=64),
     "I = 96 must be a multiple of the gate/up tile 64"),
]


@pytest.mark.parametrize("what, call, match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_every_shape_rule_refuses_by_name_on_real_and_meta_tensors(what, call, match):
    """The shape rules the fakes share with the real ops (meta tensors run the fakes, which is what torch.compile
    traces): each refuses its bad input with the ValueError naming the fix, not a result or another error."""
    with pytest.raises(ValueError, match=match):
        call(_operands())
