"""The command line: a tiny `train` run (dense and MoE) writes real results; `bench` runs and reports."""

from __future__ import annotations

import importlib.util
import json
import os
import math
import statistics

import pytest
import torch

from cute_mxfp8.cli.main import main

TINY = ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--dim", "64", "--hidden", "128", "--layers", "1",
        "--heads", "2", "--eval-batches", "1", "--no-progress", "--device", "cpu"]


@pytest.mark.parametrize("blocks", ["1x128", "128x128"])
def test_train_tiny_in_the_fast_mode(tmp_path, capsys, blocks):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--hopper-block-k", "128", "--hopper-weight-blocks", blocks, "--out",
                 str(out)]) == 0  # TINY's hidden is 128
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scale_block"] == 128 and summary["args"]["hopper_block_k"] == 128
    assert summary["args"]["hopper_weight_blocks"] == blocks
    assert all(math.isfinite(v) for v in summary["runs"]["mxfp8"]["train_losses"])
    assert f"Hopper fast mode (hopper_block_k=128, {blocks} weight blocks)" in capsys.readouterr().out


@pytest.mark.parametrize("moe", [False, True])
def test_train_tiny(tmp_path, capsys, moe):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--out", str(out), *(["--moe"] if moe else [])]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "loss.png").stat().st_size > 1000
    hp, mx = summary["runs"]["high_precision"], summary["runs"]["mxfp8"]
    assert summary["backend"] == "reference" and summary["device"] == "cpu"
    for run in (hp, mx):
        assert len(run["train_losses"]) == 4 and all(math.isfinite(v) for v in run["train_losses"])
        assert run["final_eval_loss"] < math.log(256) + 0.1 and run["tokens_per_s"] > 0
    # same init and batches: the first-step losses agree to within quantization noise
    assert abs(hp["train_losses"][0] - mx["train_losses"][0]) < 0.05
    converted = dict(summary["conversion"]["converted"])
    if moe:
        assert converted["layers.0.feed_forward.experts"] == "MXFP8GroupedExperts"
    else:
        assert converted["layers.0.feed_forward"] == "MXFP8SwiGLUMLP"
    assert converted["output"] == "MXFP8Linear" and converted["layers.0.attention.wq"] == "MXFP8Linear"
    if moe:  # the 4-way router is not a multiple of 32 and must stay high precision, with the reason
        assert any("not a multiple of the MX block size 32" in why for _, why in summary["conversion"]["skipped"])
    text = capsys.readouterr().out
    assert "eval loss gap" in text and "backend: reference" in text


def test_bench_cpu(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "gemm", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == {"mm", "mm_swiglu_quant", "mm_dswiglu_quant", "grouped_mm", "grouped_mm_wgrad"}
    kernels = [r for r in rows if not r["backend"].startswith("unfused")]  # the fused ops' baselines: GEMM + cast
    assert len(kernels) == 5 and len(rows) == 7
    assert all(r["backend"] == "reference" and r["ms"] > 0 and r["tflops"] > 0 for r in kernels)
    assert "sm100: not run (needs an SM100" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "nope"])


def test_bench_profile_takes_a_count_and_says_where_it_applies(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "mlp", "--profile", "-1"])
    assert "--profile: must be an integer >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "mlp", "--rounds", "0"])
    assert "--rounds: must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "quantize", "--rounds", "3", "--device", "cpu"]) == 0  # (the default value, given)
    assert "--rounds applies to the mlp group only; ignored for ['quantize']" in capsys.readouterr().out
    assert main(["bench", "quantize", "--profile", "2", "--device", "cpu"]) == 0
    assert "--profile applies to the mlp group only; ignored for ['quantize']" in capsys.readouterr().out


def test_bench_mlp_rounds_alternate_the_order_and_report_each_orders_ratio():
    """mlp_rows with a fake timer whose second step in a round is 20 % slower, whichever it is: the rounds alternate
    the order (bf16 first in even rounds), so the per-order medians are 1.2 and 1 / 1.2 and the overall median of an
    even count sits between them; one round has no MXFP8-first median."""
    from cute_mxfp8.cli.bench_mlp import mlp_rows

    calls = []

    def fake_time_ms(fn, device, budget_s):
        calls.append(budget_s)
        return 1.0 if len(calls) % 2 else 1.2  # the first timing of each round 1.0 ms, the second 1.2

    rows = mlp_rows(torch.device("cpu"), fake_time_ms, rounds=4)
    assert [r[0] for r in rows] == ["SwiGLU MLP", "grouped experts"] and len(calls) == 2 * 4 * 2
    assert all(b == 0.25 for b in calls)  # the time budget is split over the rounds
    for r in rows:
        assert r[9] == [1.0, 1.2, 1.0, 1.2] and r[10] == [1.2, 1.0, 1.2, 1.0]
        assert r[11] == pytest.approx(1.2) and r[12] == pytest.approx(1 / 1.2)
        assert r[4] == pytest.approx((1.2 + 1 / 1.2) / 2) and (r[7], r[8]) == (pytest.approx(1 / 1.2),
                                                                                pytest.approx(1.2))
    calls.clear()
    rows = mlp_rows(torch.device("cpu"), fake_time_ms, rounds=1)
    assert all(r[11] == pytest.approx(1.2) and r[12] is None for r in rows)
    with pytest.raises(ValueError, match="rounds must be an int >= 1"):
        mlp_rows(torch.device("cpu"), fake_time_ms, rounds=0)


def test_bench_mlp_warns_about_an_odd_round_count(capsys):
    from unittest import mock

    with mock.patch("cute_mxfp8.cli.bench_mlp.mlp_rows", return_value=[]) as rows:
        assert main(["bench", "mlp", "--device", "cpu", "--rounds", "3"]) == 0
    assert rows.call_args.kwargs["rounds"] == 3
    assert "--rounds 3 is odd: bf16 runs first in one round more than MXFP8" in capsys.readouterr().out
    with mock.patch("cute_mxfp8.cli.bench_mlp.mlp_rows", return_value=[]):
        assert main(["bench", "mlp", "--device", "cpu", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "--rounds 1 is odd: bf16 runs first in the only round" in out and "one round per step, bf16 first" in out
    with mock.patch("cute_mxfp8.cli.bench_mlp.mlp_rows", return_value=[]) as rows:
        assert main(["bench", "mlp", "--device", "cpu"]) == 0
    assert rows.call_args.kwargs["rounds"] == 4 and "is odd" not in capsys.readouterr().out


def test_bench_mlp_in_the_fast_mode_says_so_and_records_it(tmp_path, capsys):
    path = tmp_path / "mlp.json"
    assert main(["bench", "mlp", "--hopper-block-k", "128", "--device", "cpu", "--json", str(path), "--rounds",
                 "1"]) == 0
    out = json.loads(path.read_text())
    assert out["mlp_hopper_block_k"] == 128 and out["mlp_steps"] and out["mlp_steps"][0][3] > 0
    assert out["mlp_rounds"] == 1 and all(len(r[9]) == len(r[10]) == 1 for r in out["mlp_steps"])
    assert all(r[11] == r[4] and r[12] is None for r in out["mlp_steps"])  # one round: bf16 first only
    printed = capsys.readouterr().out
    assert f"{out['mlp_steps'][0][4]:.3f} / -" in printed
    # the grouped step too: torch._grouped_mm runs on the CPU (it was skipped as "needs CUDA")
    assert [r[0] for r in out["mlp_steps"]] == ["SwiGLU MLP", "grouped experts"]
    assert "Hopper fast mode: MXFP8Config(hopper_block_k=128, hopper_weight_blocks='1x128')" in printed
    assert out["mlp_hopper_weight_blocks"] == "1x128"
    path2 = tmp_path / "mlp2.json"
    assert main(["bench", "mlp", "--hopper-block-k", "128", "--hopper-weight-blocks", "128x128", "--device", "cpu",
                 "--json", str(path2)]) == 0
    out2 = json.loads(path2.read_text())
    assert out2["mlp_hopper_weight_blocks"] == "128x128" and out2["mlp_rounds"] == 4  # even: each order twice
    assert out2["mlp_step_fields"][4] == "mxfp8_over_bf16" and len(out2["mlp_step_fields"]) == 13
    for name, shape, b, q, ratio, _, _, lo, hi, b_rounds, q_rounds, r_b_first, r_q_first in out2["mlp_steps"]:
        # medians of 4 alternating rounds; the ratio is the median of the rounds' ratios, within their range
        assert len(b_rounds) == len(q_rounds) == 4 and all(t > 0 for t in b_rounds + q_rounds)
        assert b == statistics.median(b_rounds) and q == statistics.median(q_rounds)
        ratios = [qq / bb for bb, qq in zip(b_rounds, q_rounds)]
        assert ratio == statistics.median(ratios) and lo <= ratio <= hi
        assert r_b_first == statistics.median(ratios[0::2]) and r_q_first == statistics.median(ratios[1::2])
    assert "hopper_weight_blocks='128x128'" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs --hopper-block-k 128"):
        main(["bench", "mlp", "--hopper-weight-blocks", "128x128", "--device", "cpu"])
    path = tmp_path / "casts.json"
    assert main(["bench", "quantize", "swiglu", "--hopper-block-k", "128", "--device", "cpu", "--json",
                 str(path)]) == 0
    assert "scale_block=128 casts" in capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == {"quantize_rowwise", "quantize_colwise", "quantize_dual", "swiglu_quant",
                                       "dswiglu_quant"} and all(r["ms"] > 0 for r in rows)
    assert main(["bench", "gemm", "--hopper-block-k", "128", "--device", "cpu"]) == 0
    assert "--hopper-block-k does not apply to the gemm group" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "mlp", "--hopper-block-k", "64"])


def test_bench_mlp_peak_starts_each_step_without_gradients(monkeypatch):
    """``bench mlp``'s peak memory: x's and the weights' gradients left by an earlier step are cleared before the
    baseline is read (one freed inside the step would hide its size; one accumulated into would hide the new
    gradient), so the bf16 and MXFP8 steps both count the gradients they make."""
    from cute_mxfp8.cli import bench_mlp

    w = torch.nn.Parameter(torch.ones(4, 4))
    x = torch.ones(2, 4, requires_grad=True)
    (x @ w).sum().backward()  # gradients from an earlier step
    seen = {}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated",
                        lambda dev=None: seen.setdefault("grads at base", (x.grad, w.grad)) and 100)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: 100 + 3 * 2**20)
    peak = bench_mlp._peak_mib(lambda t: t @ w, x, torch.ones(2, 4), torch.device("cuda"), [w])
    assert seen["grads at base"] == (None, None) and peak == 3.0
    assert torch.equal(w.grad, torch.full((4, 4), 2.0))  # the measured step's own gradient, not accumulated


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.profiler's kernel times)")
def test_bench_mlp_kernel_breakdown_ranks_the_step_kernels():
    from cute_mxfp8.cli.bench_mlp import kernel_breakdown

    a = torch.randn(2048, 2048, device="cuda")
    rows = kernel_breakdown(lambda: (a @ a).relu_(), torch.device("cuda"), top=5, steps=4)
    assert 2 <= len(rows) <= 5 and rows[0][1] == 1.0  # the GEMM: one launch per step, the most time
    assert all(r[2] > 0 for r in rows) and [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    assert 50 < rows[0][3] <= 100 and sum(r[3] for r in rows) <= 100.01


def _train_args(tmp_path, *extra):
    return ["train", *TINY, "--out", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("extra, message", [
    (["--dim", "80"], "argument --dim: must be a positive multiple of 32"),
    (["--hidden", "100"], "argument --hidden: must be a positive multiple of 32"),
    (["--dim", "0"], "argument --dim: must be a positive multiple of 32"),
    (["--seq-len", "0"], "argument --seq-len: must be a positive integer"),
    (["--seq-len", "1000000"], "argument --seq-len: must be <"),
    (["--batch-size", "0"], "argument --batch-size: must be a positive integer"),
    (["--steps", "0"], "argument --steps: must be a positive integer"),
    (["--steps", "-3"], "argument --steps: must be a positive integer"),
    (["--heads", "0"], "argument --heads: must be a positive integer"),
    (["--heads", "3", "--dim", "128"], "--dim 128 is not divisible by --heads 3"),
    (["--heads", "64", "--dim", "64"], "must be even for RoPE"),
    (["--layers", "0"], "argument --layers: must be a positive integer"),
    (["--device", "bogus"], "argument --device: invalid device 'bogus'"),
    (["--device", "meta"], "argument --device: unsupported device type 'meta'"),
    (["--experts", "0"], "argument --experts: must be a positive integer"),
    (["--moe", "--top-k", "5"], "argument --top-k: must be in [1, --experts 4]"),
    (["--top-k", "0"], "argument --top-k: must be a positive integer"),
    (["--lr", "0"], "argument --lr: must be a finite number > 0"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0"),
    (["--eval-batches", "0"], "argument --eval-batches: must be a positive integer"),
    (["--eval-every", "0"], "argument --eval-every: must be a positive integer"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    (["--steps", "10", "--warmup", "500"], "argument --warmup: must be <= --steps 10"),
    (["--steps", "10", "--warmup", "11"], "argument --warmup: must be <= --steps 10"),
    (["--hopper-block-k", "128", "--hidden", "96"], "argument --hopper-block-k: 128 needs --hidden to be a multiple of 128"),
    (["--hopper-weight-blocks", "128x128"], "argument --hopper-weight-blocks: 128x128 needs --hopper-block-k 128"),
])  # fmt: skip
def test_train_rejects_bad_args(tmp_path, capsys, extra, message):
    """Bad values are argparse errors (usage line, exit status 2) before anything runs, not tracebacks or NaNs."""
    with pytest.raises(SystemExit) as exc:
        main(_train_args(tmp_path, *extra))
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "usage:" in captured.err and "train: error:" in captured.err
    assert captured.out == "" and not (tmp_path / "run").exists()


def test_train_rejects_cuda_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(_train_args(tmp_path, "--device", "cuda:1"))
    assert exc.value.code == 2 and "'cuda:1' requested but CUDA is not available" in capsys.readouterr().err


def test_train_reports_every_bad_arg(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(_train_args(tmp_path, "--seq-len", "0", "--batch-size", "0", "--steps", "0"))
    err = capsys.readouterr().err
    assert all(f"argument {flag}: must be a positive integer, got 0" in err
               for flag in ("--seq-len", "--batch-size", "--steps"))  # fmt: skip


def test_run_validates_namespace(tmp_path):
    """train.run called without the parser (programmatic use) checks the same rules and exits with the message."""
    from cute_mxfp8.cli import train
    from cute_mxfp8.cli.main import build_parser

    args = build_parser().parse_args(_train_args(tmp_path))
    args.heads = 0
    with pytest.raises(SystemExit, match="argument --heads: must be a positive integer"):
        train.run(args)
    assert train.validate_args(build_parser().parse_args(_train_args(tmp_path))) is None


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_train_out_not_a_directory(tmp_path, capsys, where):
    """--out naming an existing file (or a path below one) fails at once, naming the path, before training."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile if where == "file" else afile / "sub"
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--out", str(out)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert str(afile) in captured.err and "is not a directory" in captured.err and "step" not in captured.out
    assert afile.read_text() == "keep me"


def test_train_creates_out_before_training(tmp_path, monkeypatch):
    from cute_mxfp8.cli import train

    out = tmp_path / "a" / "b"
    seen = []
    real_step = train._train_step

    def step(*a, **k):
        seen.append(out.is_dir())
        return real_step(*a, **k)

    monkeypatch.setattr(train, "_train_step", step)
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    assert seen and all(seen) and (out / "summary.json").exists()


def test_train_warns_when_nothing_converted(tmp_path, capsys, monkeypatch):
    """If the converter replaces nothing, the 'mxfp8' run is the high-precision one: say so, and do not judge."""
    import functools

    import cute_mxfp8.nn

    convert_nothing = functools.partial(cute_mxfp8.nn.convert_to_mxfp8, filter_fn=lambda module, fqn: False)
    monkeypatch.setattr(cute_mxfp8.nn, "convert_to_mxfp8", convert_nothing)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "converted 0 module(s)" in text
    # printed after the conversion report and again under the results
    assert text.count("WARNING: the converter replaced no module with an MXFP8 one") == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mxfp8_layers"] == 0 and summary["within_tolerance"] is None
    assert summary["conversion"]["converted"] == []


def test_train_summary_counts_mxfp8_layers(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mxfp8_layers"] == len(summary["conversion"]["converted"]) > 0
    assert summary["within_tolerance"] in (True, False)


def _strict_json(text: str):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def test_train_summary_is_strict_json(tmp_path, monkeypatch):
    """Non-finite numbers (here a NaN eval loss) are written as null, never as bare NaN / Infinity."""
    from cute_mxfp8.cli import train

    monkeypatch.setattr(train, "_evaluate", lambda model, batches, amp: float("nan"))
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    summary = _strict_json((out / "summary.json").read_text())
    assert summary["runs"]["mxfp8"]["final_eval_loss"] is None and summary["eval_gap_pct"] is None
    assert summary["within_tolerance"] is False
    assert all(math.isfinite(v) for v in summary["runs"]["high_precision"]["train_losses"])
    nested = {"a": [1.0, float("inf"), (float("-inf"), 2)], "b": "x"}
    assert train._json_safe(nested) == {"a": [1.0, None, [None, 2]], "b": "x"}


def test_train_logs_final_step(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "3", "--log-every", "2", "--out", str(tmp_path / "run")]) == 0
    logged = [line.split("|")[0].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert logged == ["step 1/3", "step 2/3", "step 3/3"]


def test_train_log_every_zero_logs_nothing(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "2", "--log-every", "0", "--out", str(tmp_path / "run")]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("argv0, prog", [
    ("/usr/local/bin/cute-mxfp8", "cute-mxfp8"),
    ("/site-packages/cute_mxfp8/__main__.py", "python -m cute_mxfp8"),
    ("", "python -m cute_mxfp8"),
    ("-c", "python -m cute_mxfp8"),
])  # fmt: skip
def test_prog_name(monkeypatch, capsys, argv0, prog):
    from cute_mxfp8.cli.main import build_parser, default_prog

    assert default_prog(argv0) == prog
    monkeypatch.setattr("sys.argv", [argv0])
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {prog} ")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert capsys.readouterr().out.startswith(f"usage: {prog} train ")
    assert build_parser(prog="x").prog == "x"


@pytest.mark.parametrize("sub", ["train", "bench", "inspect"])
def test_every_subcommand_prints_its_help(capsys, sub):
    """argparse expands ``%`` in help strings: a bare one (``60 %``) crashed ``inspect --help`` with ValueError."""
    with pytest.raises(SystemExit) as exc:
        main([sub, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and f" {sub} " in out.splitlines()[0] and "--help" in out
    if sub == "inspect":
        assert "(about 60 %;" in out


def test_module_help_prog():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "cute_mxfp8", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("usage: python -m cute_mxfp8 ")


INSPECT_SHARDS = 8  # the CI's compile check in 8 tests, so that pytest-xdist's workers share its ~15 CPU minutes


def _inspect_kinds(kernels):
    """The registry's kernel names by what their SASS must show: (casts, 128-block amax passes, GEMMs, one-launch
    128-block casts, resident SwiGLU casts)."""
    casts = [k for k in kernels if not k.startswith("gemm_") and not k.endswith("_amax")]
    amax = [k for k in kernels if k.endswith("_amax")]  # the fast mode's 128-block amax passes: no stores
    gemms = [k for k in kernels if k.startswith("gemm_")]
    one_launch = [k for k in casts if k.startswith("quantize_") and k.endswith("_fast_mode")]
    resident = [k for k in casts if k.startswith("swiglu_quant_") and "_cast" in k]
    return casts, amax, gemms, one_launch, resident


def test_inspect_pairwise_list_holds_every_family_and_its_shards_partition_it():
    """What ``inspect --pairwise`` compiles for sm_90a (267 of the 453 variants: every family, each pair of
    argument values at least once), and that ``--shard K/N`` splits it into N disjoint parts covering it."""
    from cute_mxfp8.cli import inspect_kernels as ik

    todo = ik.variants("sm_90a", pairwise=True)
    kernels = [f.kernel for f, _ in todo]
    assert len(todo) >= 96 and set(kernels) == {f.kernel for f in ik.FAMILIES if "sm_90a" in f.archs}
    casts, amax, gemms, one_launch, resident = _inspect_kinds(kernels)
    # of the 94 GEMM variants ((promote + dequant dense, 2d-3d, 2d-2d) x 4 A x B dtypes x 2 outs + 8 fused + fast
    # mode (n_tile 128, 192; 2d-3d, 2d-2d) x 8 + the fast mode in 2 clusters + the fast 2d-2d build with
    # split_halves x 2 + 128 x 128 B blocks: dense split M x 8, 2d-3d split M x 2, dense split N x 1, TMA-stored
    # split M dense x 4 and 2d-3d x 1; the split-tail builds x 2; the TMA-stored split-N 2d-2d builds, plain and
    # split_halves, x 4 each), the pairwise subset: 5 of each family of 8 (6 of gemm_sm90's 16), all of the smaller
    # ones
    assert len(gemms) == 71
    assert len(amax) == 4  # the SwiGLU kernels' (fwd, bwd) x modes
    # + the blocks_2d weight casts: dual x 4, rowwise 2-D / 3-D, colwise; + the kept-run builds the ops run for bf16
    # (plain and blocks_2d: dual x 2, rowwise 2-D / 3-D, colwise) and with token groups (padded dual x 2, unpadded
    # dual, rowwise, padded colwise x 2); + W13's cast from w1 and w3 (dual, rowwise, colwise x 2 x 2)
    assert len(one_launch) == 24 + 7 + 2 * 5 + 6 + 3 * 4
    assert len(resident) == 2 * 6 + 2 * 5  # (+ the persistent forward: 2 families x 5 pairwise variants)
    shards = [ik.variants("sm_90a", pairwise=True, shard=(k, INSPECT_SHARDS)) for k in range(INSPECT_SHARDS)]
    assert sorted(i for part in shards for i in (todo.index(v) for v in part)) == list(range(len(todo)))
    assert all(len(part) in (len(todo) // INSPECT_SHARDS, -(-len(todo) // INSPECT_SHARDS)) for part in shards)
    with pytest.raises(ValueError, match="0 <= k < n"):
        ik.variants("sm_90a", shard=(3, 3))


@pytest.mark.parametrize("shard", range(INSPECT_SHARDS))
def test_inspect_compiles_every_variant_without_gpu(tmp_path, capsys, shard):
    """``inspect --pairwise --shard K/8`` in this process: every variant of the shard compiles for sm_90a without
    local memory, with the instructions its kind must have (``inspect`` without --pairwise builds all 453)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")
    from cute_mxfp8.cli import inspect_kernels as ik

    path = tmp_path / "inspect.json"
    assert main(["inspect", "--arch", "sm_90a", "--pairwise", "--jobs", "1", "--shard", f"{shard}/{INSPECT_SHARDS}",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    rows = data["rows"]
    todo = ik.variants("sm_90a", pairwise=True, shard=(shard, INSPECT_SHARDS))
    n = len(todo)
    assert f"arch sm_90a (shard {shard}/{INSPECT_SHARDS}): {n}/{n} variants compiled" in capsys.readouterr().out
    assert data["shard"] == [shard, INSPECT_SHARDS] and data["pairwise"] is True and len(rows) == len(todo) > 0
    assert [(r["kernel"], r["variant"]) for r in rows] == [(f.kernel, f.label(a)) for f, a in todo]
    assert all(r["status"] == "ok" and r["local"] == 0 for r in rows)
    casts, amax, gemm_kernels, one_launch, resident = (set(k) for k in _inspect_kinds([r["kernel"] for r in rows]))
    assert all(r["cvt.satfinite"] > 0 for r in rows if r["kernel"] in casts)
    assert all(r["cvt.satfinite"] == 0 for r in rows if r["kernel"] in amax)
    # register tiles and shuffles, no shared-memory staging; the one-launch 128-block casts meet once (row amaxes),
    # with groups also twice per unrolled run of a tail CTA (rows past offs[-1])
    from cute_mxfp8.kernels.quantize_tile import BLOCK, RUN, TAIL_ROWS

    tail_bars = 2 * (TAIL_ROWS // (RUN * BLOCK))
    assert all(r["bar.sync"] == 1 + (tail_bars if "grouped" in r["kernel"] else 0) for r in rows
               if r["kernel"] in one_launch)
    # the SwiGLU kernels' resident one launch meets once (the amax parts in shared memory; its tail CTAs store zeros
    # without meeting); every other cast never
    assert all(r["bar.sync"] == 1 for r in rows if r["kernel"] in resident)
    assert all(r["bar.sync"] == 0 for r in rows
               if r["kernel"] in casts and r["kernel"] not in one_launch and r["kernel"] not in resident)
    # every SM90 GEMM sets its warpgroups' register budgets, and ptxas kept them (a dropped one fails the row)
    gemms = [r for r in rows if r["kernel"] in gemm_kernels]
    assert all(r["setmaxnreg"] == 2 for r in gemms) and all(r.get("USETMAXREG", 2) == 2 for r in gemms)


def test_inspect_fails_a_variant_whose_setmaxnreg_ptxas_dropped():
    from cute_mxfp8.cli.inspect_kernels import finish

    assert finish({"status": "ok", "setmaxnreg": 2, "USETMAXREG": 0})["status"] == "setmaxnreg dropped by ptxas (C7508)"
    assert finish({"status": "ok", "setmaxnreg": 2, "USETMAXREG": 2})["status"] == "ok"
    assert finish({"status": "ok", "setmaxnreg": 2})["status"] == "ok"  # no nvdisasm: no SASS count to hold it to
    assert finish({"status": "ok", "setmaxnreg": 0, "USETMAXREG": 0})["status"] == "ok"


def test_bench_plot_draws_a_png_and_names_what_it_needs(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra")
    from cute_mxfp8.cli import bench_plot

    result = {"device": "cuda", "rows": [
        {"op": "mm", "backend": "sm90", "shape": "8192x8192x8192", "tflops": 472.0},
        {"op": "mm", "backend": "cuBLAS bf16 mm", "shape": "8192x8192x8192", "tflops": 678.0},
        {"op": "grouped_mm_wgrad", "backend": "sm90", "shape": "65536x7168x2048 G=8", "tflops": 326.0},
        {"op": "quantize_rowwise", "backend": "sm90", "shape": "x", "tflops": None}],
        "mlp_steps": [["SwiGLU MLP", "M=8192 D=2048 I=8192", 3.5, 4.1, 1.17, 900, 800]]}
    src = tmp_path / "r.json"
    src.write_text(__import__("json").dumps(result))
    assert bench_plot.main([str(src), str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to draw"):
        bench_plot.plot({"rows": [], "mlp_steps": []}, str(tmp_path / "d.png"))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        bench_plot.plot(result, str(tmp_path / "e.png"))


def test_bench_plot_without_a_drawable_group_is_refused_before_timing(tmp_path, monkeypatch):
    """``bench quantize --plot`` has nothing to draw (the chart shows the gemm and mlp groups): refused before any
    op is timed, naming the fix, instead of a traceback after the run."""
    from cute_mxfp8.cli import bench

    monkeypatch.setattr(bench, "_time_ms", lambda *a, **k: pytest.fail("timed before refusing"))
    for groups in (["quantize"], ["swiglu"], ["quantize", "swiglu"]):
        with pytest.raises(SystemExit, match="add gemm or mlp"):
            main(["bench", *groups, "--device", "cpu", "--plot", str(tmp_path / "x.png")])


def test_bench_refuses_a_missing_plot_directory_and_an_absent_cuda_before_timing(tmp_path, monkeypatch):
    from cute_mxfp8.cli import bench

    monkeypatch.setattr(bench, "_time_ms", lambda *a, **k: pytest.fail("timed before refusing"))
    with pytest.raises(SystemExit, match="its directory does not exist"):
        main(["bench", "gemm", "--device", "cpu", "--plot", str(tmp_path / "nope" / "x.png")])
    with pytest.raises(SystemExit, match="--json .* its directory does not exist"):
        main(["bench", "gemm", "--device", "cpu", "--json", str(tmp_path / "nope" / "x.json")])
    with pytest.raises(SystemExit, match="--json .* is a directory"):
        main(["bench", "gemm", "--device", "cpu", "--json", str(tmp_path)])
    if os.geteuid() != 0:  # (root writes anywhere: the permission checks cannot fail for it)
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        with pytest.raises(SystemExit, match="--json .* its directory .* is not writable"):
            main(["bench", "gemm", "--device", "cpu", "--json", str(locked / "x.json")])
        locked.chmod(0o700)
    from cute_mxfp8.cli.checks import output_file_problem

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a read-only file system answers
    assert output_file_problem("--json", str(tmp_path / "new.json")).endswith(f"its directory {tmp_path} is not "
                                                                               f"writable")
    (tmp_path / "old.json").write_text("{}")
    assert output_file_problem("--json", str(tmp_path / "old.json")).endswith("the file exists and is not writable")
    monkeypatch.undo()
    monkeypatch.setattr(bench, "_time_ms", lambda *a, **k: pytest.fail("timed before refusing"))
    with pytest.raises(SystemExit, match="invalid device ''"):
        main(["bench", "gemm", "--device", ""])
    if importlib.util.find_spec("matplotlib") is not None:  # (the test extra has it)
        for name, msg in (("x.foo", r"writes no \.foo files; name it \.png"), ("x", "has no file suffix"),
                          (".png", "has no file suffix"), ("", "is a directory")):
            with pytest.raises(SystemExit, match=msg):  # (matplotlib would write x.png, .png.png, <dir>.png)
                main(["bench", "gemm", "--device", "cpu", "--plot", str(tmp_path / name) + ("/" if not name else "")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="sees no CUDA GPU"):
        main(["bench", "gemm", "--device", "cuda"])
    # devices train refuses, bench refused too late (a traceback for tpu, meaningless timings on meta)
    for bad, msg in (("tpu", "invalid device 'tpu'"), ("meta", "unsupported device type 'meta'"),
                     ("cuda:1", "CUDA is not available")):
        with pytest.raises(SystemExit, match=msg):
            main(["bench", "gemm", "--device", bad])


def test_bench_plot_command_reports_bad_files_without_a_traceback(tmp_path, capsys):
    """``python -m cute_mxfp8.cli.bench_plot RESULT.json OUT.png``: a missing JSON, one with nothing to draw and
    an unwritable output are one line on stderr and exit status 2 (they were tracebacks)."""
    pytest.importorskip("matplotlib")
    from cute_mxfp8.cli import bench_plot

    assert bench_plot.main([str(tmp_path / "missing.json"), str(tmp_path / "x.png")]) == 2
    assert "missing.json: [Errno 2] No such file" in capsys.readouterr().err
    (tmp_path / "q.json").write_text(json.dumps({"results": []}))
    assert bench_plot.main([str(tmp_path / "q.json"), str(tmp_path / "x.png")]) == 2
    assert "nothing to draw" in capsys.readouterr().err
    assert bench_plot.main([str(tmp_path / "q.json"), str(tmp_path / "nope" / "x.png")]) == 2
    assert "its directory does not exist" in capsys.readouterr().err
    assert bench_plot.main(["only-one"]) == 2 and capsys.readouterr().err.startswith("usage: ")
    for bad in ([1, 2], {"results": [{"group": "gemm"}]}, {"results": 5}):  # not what bench --json writes
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        assert bench_plot.main([str(tmp_path / "bad.json"), str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("bench_plot: ") and ("not a `bench --json` result" in err or "nothing to draw" in err)
    (tmp_path / "f.txt").write_text("")
    assert bench_plot.main([str(tmp_path / "q.json"), str(tmp_path / "f.txt" / "x.png")]) == 2
    assert "f.txt is a file, not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--json and --plot name one file"):
        main(["bench", "gemm", "--device", "cpu", "--json", str(tmp_path / "o.png"), "--plot",
              str(tmp_path / "o.png")])


def test_train_refuses_moe_flags_without_moe_and_reprs_show_the_layers(capsys):
    """``--experts`` / ``--top-k`` set the routed MoE FFN: without ``--moe`` they were silently ignored."""
    from cute_mxfp8 import MXFP8SwiGLUMLP
    from cute_mxfp8.cli import train
    from cute_mxfp8.cli.main import build_parser
    from cute_mxfp8.nn import MXFP8GroupedExperts

    for extra in (["--top-k", "1"], ["--experts", "3"]):
        with pytest.raises(SystemExit):
            main(["train", *extra])
        assert f"argument {extra[0]}: sets the routed MoE FFN, which only --moe builds" in capsys.readouterr().err
    args = build_parser().parse_args(["train", "--moe"])
    assert train.validate_args(args) is None and train.validate_args(args) is None  # (run() checks again)
    assert (train._moe_value(args, "experts"), train._moe_value(args, "top_k")) == (4, 2)  # the defaults
    args = build_parser().parse_args(["train", "--moe", "--experts", "3", "--top-k", "3"])
    assert train.validate_args(args) is None
    assert (train._moe_value(args, "experts"), train._moe_value(args, "top_k")) == (3, 3)
    assert repr(MXFP8GroupedExperts(64, 128, 3)).startswith(
        "MXFP8GroupedExperts(num_experts=3, dim=64, hidden_dim=128, dtype=torch.float32, validate_counts=False, "
        "config=MXFP8Config(")
    assert "config=MXFP8Config(scale_mode='rceil'" in repr(MXFP8SwiGLUMLP(64, 128))
