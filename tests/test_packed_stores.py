"""The tile casts' packed fp8 stores (``TileQuantKernel(packed_stores=True)``, ``ops.cute_kernels.PACKED_STORES``,
on unless ``CUTE_MXFP8_PACKED_STORES=0``): compiled without local memory and with fewer instructions on the CPU; on an SM90
GPU every cast writes the bytes of the default stores (which the other GPU tests hold against the reference)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cute_mxfp8 import ops

E4M3 = torch.float8_e4m3fn


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _sass_facts(fn):
    from cute_mxfp8.cli import sass_facts

    (res,) = sass_facts.cubin_resources(fn.__cubin__).values()
    ops_ = sass_facts.opcode_counts(sass_facts.disassemble(fn.__cubin__)) if sass_facts.find_nvdisasm() else None
    return res, ops_


# (name, compile function, its arguments after (direction, in_dtype, elem, scale_mode, blocked, arch, keep_ptx)):
# the builds nearest their register limits (the three dSwiGLU forms, the persistent forward) and two plain casts;
# `inspect` with the flag forced on built every variant without local memory (docs/sm90_gemm.md, thirtieth session)
_BUILDS = [
    ("grouped padded dSwiGLU", "swiglu", ("bwd", True, False, 128, "cast", "bfloat16", True, 0)),
    ("grouped unpadded dSwiGLU", "swiglu", ("bwd", True, False, 128, "cast", "bfloat16", False, 0)),
    ("dense dSwiGLU with emit_hp (32-blocks)", "swiglu", ("bwd", False, True, 32, "cast", "bfloat16", False, 0)),
    ("dense persistent SwiGLU", "swiglu", ("fwd", False, False, 128, "cast", "bfloat16", False, 132)),
    ("dense 32-block dual", "quant", ("dual", False, False, 32, "cast", False, False, False)),
    ("128 x 128-block W13 cast", "quant", ("dual", False, False, 128, "cast", False, True, True, True)),
]


@pytest.mark.parametrize("name,family,args", _BUILDS, ids=[b[0] for b in _BUILDS])
def test_packed_stores_compile_without_local_memory_and_with_fewer_instructions(name, family, args):
    """sm_90a: the packed build has no local memory, its registers within the default build's launch bounds, no
    more instructions than the default build and fewer byte permutes (``PRMT``: the DSL's vector fp8 conversion
    reassembles each word byte by byte)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")
    from cute_mxfp8.jit import compile_quant, compile_swiglu_quant

    def build(packed):
        if family == "swiglu":
            d, grouped, emit_hp, sb, phase, h13, pad, ctas = args
            return compile_swiglu_quant(d, "bfloat16", "e4m3", "rceil", True, "sm_90a", True, grouped, emit_hp, sb,
                                        phase, h13, pad, ctas, packed_stores=packed)
        d, grouped, batched, sb, phase, pad, b2d, keep, *gate_up = args
        return compile_quant(d, "bfloat16", "e4m3", "rceil", True, "sm_90a", True, grouped, batched, sb, phase, pad,
                             b2d, keep, *gate_up, packed_stores=packed)

    (res0, ops0), (res1, ops1) = _sass_facts(build(False)), _sass_facts(build(True))
    assert res1["local_frame"] == 0 and res1["regs"] <= max(res0["regs"], 128)
    if ops1 is not None:  # (nvdisasm: the test extra installs it)
        assert not any(op.startswith(("LDL", "STL")) for op in ops1)
        prmt = [sum(n for op, n in o.items() if op.startswith("PRMT")) for o in (ops0, ops1)]
        assert prmt[1] < prmt[0], prmt
        assert sum(ops1.values()) <= sum(ops0.values()) * 1.1  # (the full-block path duplicates the row stores)


def test_packed_stores_flag_is_a_bool_and_the_ops_switch_reads_the_environment(monkeypatch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")
    from cute_mxfp8.kernels.quantize_tile import TileQuantKernel

    with pytest.raises(TypeError, match="packed_stores must be a bool"):
        TileQuantKernel("e4m3", "rceil", True, True, True, packed_stores=1)
    from cute_mxfp8.ops import cute_kernels

    from cute_mxfp8.env import env_flag

    assert cute_kernels.PACKED_STORES is env_flag("CUTE_MXFP8_PACKED_STORES", True)  # (on by default)
    code = "from cute_mxfp8.ops import cute_kernels as c; print(c.PACKED_STORES)"
    for value, want in (("1", "True"), ("0", "False")):
        env = {**os.environ, "CUTE_MXFP8_PACKED_STORES": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == want, out.stderr[-500:]
    for value, want in (("ON", True), (" yes ", True), ("off", False), ("", False)):
        monkeypatch.setenv("CUTE_MXFP8_PACKED_STORES", value)
        assert env_flag("CUTE_MXFP8_PACKED_STORES", False) is want
    monkeypatch.setenv("CUTE_MXFP8_PACKED_STORES", "yess")  # a typo is an error, not a silent off
    with pytest.raises(ValueError, match="CUTE_MXFP8_PACKED_STORES='yess': set it to 1 \\(on\\) or 0 \\(off\\)"):
        env_flag("CUTE_MXFP8_PACKED_STORES", False)


def _casts(rng):
    """Every cast the sm90 backend runs on the tile kernels, on ragged bf16 data with outliers and token groups
    that end inside 32-row blocks (rows past the last group too)."""
    m, k, i = 1000, 384, 256
    x = (torch.randn(m, k, generator=rng) * 3).to(torch.bfloat16)
    x[5] *= 1000
    w = torch.randn(3, 256, k, generator=rng).to(torch.bfloat16)
    h13 = (torch.randn(m, 2 * i, generator=rng) * 3).to(torch.bfloat16)
    dh = torch.randn(m, i, generator=rng).to(torch.bfloat16)
    x, w, h13, dh = (t.cuda() for t in (x, w, h13, dh))
    offs = torch.tensor([m // 5, m // 5 + 1, m // 2, m - 3], dtype=torch.int32, device="cuda")
    outs = [ops.quantize_dual(x), ops.quantize_dual(x, blocked=False), ops.quantize_colwise(x),
            ops.quantize_rowwise(w), ops.quantize_dual(x, offs=offs), ops.quantize_colwise(x, offs=offs)]
    for align in (0, 128):
        outs.append(ops.quantize_dual(x, offs=offs, scale_block=128, token_align=align))
    outs += [ops.quantize_dual(x, scale_block=128), ops.quantize_rowwise(x, scale_block=128, offs=offs),
             ops.quantize_dual(w, scale_block=128, blocks_2d=True),
             ops.quantize_gate_up(w, w.flip(0), scale_block=128, blocks_2d=True)]
    for sb in (32, 128):
        for kw in (dict(), dict(emit_hp=True), dict(offs=offs), dict(offs=offs, token_align=128 if sb == 128 else 0),
                   dict(offs=offs, emit_hp=True)):
            outs += [ops.swiglu_quant(h13, scale_block=sb, **kw), ops.dswiglu_quant(dh, h13, scale_block=sb, **kw)]
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs an SM90 GPU (H100/H200)")
def test_packed_stores_write_the_bytes_of_the_default_stores(monkeypatch):
    from cute_mxfp8.ops import backends, cute_kernels

    got = {}
    for packed in (False, True):
        monkeypatch.setattr(cute_kernels, "PACKED_STORES", packed)
        backends.PLANS.clear()  # (a launch plan holds the kernel it was made with)
        got[packed] = _casts(torch.Generator().manual_seed(0))
    for n, (a, b) in enumerate(zip(got[False], got[True])):
        for j, (u, v) in enumerate(zip(a, b)):
            assert u.shape == v.shape and u.dtype == v.dtype, (n, j)
            assert torch.equal(_u8(u).cpu(), _u8(v).cpu()), f"cast {n} output {j}: bytes differ"
