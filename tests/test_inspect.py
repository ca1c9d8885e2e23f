"""``inspect``: CUBIN facts (registers, shared memory, local frame) and SASS instruction counts per kernel variant,
on the CPU; SASS assertions skip where nvdisasm (the ``sass`` extra) is missing."""

from __future__ import annotations

import json
import types

import pytest

from cute_mxfp8.cli import inspect_kernels as ik
from cute_mxfp8.cli import sass_facts
from cute_mxfp8.cli.main import main

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")

ROWWISE = {"direction": "rowwise", "in_dtype": "bfloat16", "elem": "e4m3", "scale_mode": "rceil", "blocked": False}
DUAL = {**ROWWISE, "direction": "dual", "blocked": True}
needs_sass = pytest.mark.skipif(sass_facts.find_nvdisasm() is None,
                                reason='nvdisasm not installed (pip install -e ".[sass]")')


def _family(direction: str) -> ik.Family:
    return next(f for f in ik.FAMILIES if f.kernel == f"quantize_{direction}")


def _compiled(args: dict, arch: str = "sm_100f"):
    return ik.compile_variant(arch, _family(args["direction"]), args)


def test_registry_covers_the_quantize_kernels_and_labels_variants():
    assert {f.kernel for f in ik.FAMILIES} >= {"quantize_rowwise", "quantize_colwise", "quantize_dual"}
    fam = _family("dual")
    assert len(fam.variants()) == 16 and fam.variants()[0] == {**DUAL, "in_dtype": "bfloat16", "elem": "e4m3",
                                                                "scale_mode": "floor", "blocked": False}
    assert fam.label(DUAL) == "bfloat16 e4m3 rceil blocked" and fam.label(ROWWISE) == "bfloat16 e4m3 rceil"


def test_cubin_facts_of_two_variants():
    row, _ = _compiled(ROWWISE)
    assert row["status"] == "ok" and row["kernels"] == 1 and 16 <= row["regs"] <= 128
    assert row["smem_static"] == 0 and row["smem_dynamic"] == 0 and row["local_frame"] == 0
    row, fn = _compiled(DUAL)
    assert row["status"] == "ok" and row["kernels"] == 1 and 16 <= row["regs"] <= 128
    assert row["smem_static"] == 0 and row["smem_dynamic"] == 0  # register tiles: no shared memory
    assert row["local_frame"] == 0 and row["local"] == 0 and row["cvt.satfinite"] > 0
    assert fn.launch_smem == (0,)


@needs_sass
def test_sass_counts_of_two_variants():
    row, fn = _compiled(ROWWISE)
    ik.add_sass(row, sass_facts.disassemble(fn.__cubin__))
    assert ik.finish(row)["status"] == "ok" and row["LDL/STL"] == 0
    assert row["F2FP.fp8"] > 0 and row["LDG.128"] > 0  # hardware fp8 conversion, 16-byte loads
    assert row["BAR"] == row["LDS"] == row["STS"] == row["UTCQMMA"] == 0
    assert sum(row["sass_opcodes"].values()) > 50 and "EXIT" in row["sass_opcodes"]
    row, fn = _compiled(DUAL, "sm_90a")
    ik.add_sass(row, sass_facts.disassemble(fn.__cubin__))
    assert row["LDL/STL"] == 0 and row["F2FP.fp8"] > 0 and row["LDG.64"] >= 8  # 8-byte bf16 vectors per row
    # shuffles instead of smem: 7 + 3 reductions, 8 + 4 broadcasts, and the packed stores' full-block copy of the
    # rowwise stores with their 8 broadcasts (tests/test_kernels_quantize.py counts the same in the PTX)
    assert row["BAR"] == row["LDS"] == row["STS"] == 0 and row["SHFL"] == 30


def test_loop_bodies_from_sass_text():
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
    .L_x_1:
        /*0010*/                   SHFL.BFLY PT, R2, R3, 0x1, 0x1f ;
        /*0020*/                   FMNMX R3, R2, R3, !PT ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/                   BRA `(.L_x_2) ;
    .L_x_2:
        /*0050*/                   EXIT ;
    """
    assert sass_facts.loop_bodies(sass) == [["SHFL.BFLY PT, R2, R3, 0x1, 0x1f", "FMNMX R3, R2, R3, !PT",
                                             "@P0 BRA `(.L_x_1)"]]  # the forward branch closes no loop


def test_opcode_counts_and_spills_from_sass_text():
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
        /*0010*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/               @P1 LDG.E.128 R8, desc[UR4][R2.64+0x10] ;
        /*0030*/                   F2FP.SATFINITE.E5M2.F32.PACK_AB_MERGE_C R0, R5, R4, RZ ;
        /*0040*/                   STL.64 [R1], R4 ;
        /*0050*/              @!PT LDS RZ, [RZ] ;
        /*0060*/                   UTCQMMA.2CTA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11] ;
        /*0070*/                   STG.E.U8 desc[UR4][R6.64], R0 ;
        /*0078*/                   QGMMA.64x96x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        /*0080*/                   EXIT ;
    """
    ops = sass_facts.opcode_counts(sass)  # (lower-case modifiers kept: the WGMMA's shape)
    assert ops == {"LDC": 1, "LDG.E.128": 2, "F2FP.SATFINITE.E5M2.F32.PACK_AB_MERGE_C": 1, "STL.64": 1, "LDS": 1,
                   "UTCQMMA.2CTA": 1, "STG.E.U8": 1, "QGMMA.64x96x32.F32.E4M3.E4M3": 1, "EXIT": 1}
    row = {"status": "ok"}
    ik.add_sass(row, sass)
    assert (row["LDG.128"], row["F2FP.fp8"], row["UTCQMMA"], row["STG.narrow"], row["LDS"]) == (2, 1, 1, 1, 1)
    assert row["LDL/STL"] == 1 and ik.finish(row)["status"] == "local memory (spills)"


def test_cubin_parser_rejects_other_files():
    with pytest.raises(ValueError, match="not a little-endian ELF64"):
        sass_facts.cubin_resources(b"//\n.version 8.8\n")


def _broken(*args, **kwargs):
    raise RuntimeError("no such kernel")


def _spilling(*args, keep_ptx):
    real = ik.jit.compile_quant(*ROWWISE.values(), "sm_90a", keep_ptx=True)
    return types.SimpleNamespace(__ptx__=real.__ptx__ + "\n\tld.local.u32 %r1, [%rd1];", __cubin__=real.__cubin__,
                                 launch_smem=(0,))


def test_cli_exit_status_json_and_the_sass_hint(tmp_path, capsys, monkeypatch):
    ok = ik.Family("quantize_rowwise", ik.jit.compile_quant, {k: [v] for k, v in ROWWISE.items()})
    monkeypatch.setattr(ik, "FAMILIES", [ok])
    monkeypatch.setattr(sass_facts, "find_nvdisasm", lambda: None)  # as without the sass extra
    path = tmp_path / "inspect.json"
    assert main(["inspect", "--arch", "sm_90a", "--json", str(path), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "1/1 variants compiled" in out and ik.SASS_HINT in out and "cvt.satfinite" in out
    data = json.loads(path.read_text())
    assert data["sass"] is False and data["rows"][0]["regs"] > 0 and data["rows"][0]["in_dtype"] == "bfloat16"

    monkeypatch.setattr(ik, "FAMILIES", [ok, ik.Family("broken", _broken, {"x": [1]}),
                                         ik.Family("spilling", _spilling, {"x": [1]})])
    with pytest.raises(SystemExit) as exit_:  # a compile error or local memory fails the run (2 processes)
        main(["inspect", "--arch", "sm_90a", "--jobs", "2"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "1/3 variants compiled" in out and "error: RuntimeError: no such kernel" in out
    assert "local memory (spills)" in out


def test_cli_refuses_a_missing_json_directory_and_bad_jobs_before_compiling(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ik, "inspect_all", lambda *a, **k: pytest.fail("compiled before refusing"))
    with pytest.raises(SystemExit, match="--json .* its directory does not exist"):
        main(["inspect", "--arch", "sm_90a", "--json", str(tmp_path / "nope" / "x.json")])
    with pytest.raises(SystemExit, match="--json .* is a directory"):
        main(["inspect", "--arch", "sm_90a", "--json", str(tmp_path)])
    for jobs in ("0", "-3", "two"):
        with pytest.raises(SystemExit):
            main(["inspect", "--arch", "sm_90a", "--jobs", jobs])
        assert "--jobs: must be an integer >= 1" in capsys.readouterr().err  # (-3 said ">= 0")
    for shard in ("3/3", "-1/2", "a/b", "2", "1/0"):
        with pytest.raises(SystemExit):
            main(["inspect", "--arch", "sm_90a", f"--shard={shard}"])
        assert "--shard: must be K/N with integers 0 <= K < N" in capsys.readouterr().err
    n = len(ik.variants("sm_90a", pairwise=True))
    with pytest.raises(SystemExit, match=f"--shard {n}/{n + 5} is empty: the list holds {n} variants"):
        main(["inspect", "--arch", "sm_90a", "--pairwise", "--shard", f"{n}/{n + 5}"])  # (a silent 0/0 before)
    for bad in ((1, 2.0), (True, 2), (2, 2)):
        with pytest.raises(ValueError, match="needs ints with 0 <= k < n"):
            ik.variants("sm_90a", shard=bad)


def test_pairwise_variants_cover_every_pair_of_argument_values():
    import itertools

    fam = ik.Family("toy", lambda *a, **k: None, {"a": [1, 2], "b": ["x", "y", "z"], "c": [False, True], "d": [0]})
    full, some = fam.variants(), fam.pairwise_variants()
    assert len(full) == 12 and len(some) < len(full) and all(v in full for v in some)
    assert some == [v for v in full if v in some] and some == fam.pairwise_variants()  # registry order, fixed
    for p, q in itertools.combinations("abc", 2):
        assert {(v[p], v[q]) for v in some} == set(itertools.product(fam.axes[p], fam.axes[q]))
    one = ik.Family("one", lambda *a, **k: None, {"a": [1]})
    assert one.pairwise_variants() == one.variants() == [{"a": 1}]
    real = {f.kernel: f for f in ik.FAMILIES}["gemm_sm90"]  # 2 x 2 x 2 x 2
    assert 4 <= len(real.pairwise_variants()) < len(real.variants()) == 16
