"""The command line: a tiny `train` run (dense and MoE) writes real results; `bench` runs and reports."""

from __future__ import annotations

import json
import math

import pytest

from cute_mxfp8.cli.main import main

TINY = ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--dim", "64", "--hidden", "128", "--layers", "1",
        "--heads", "2", "--eval-batches", "1", "--no-progress", "--device", "cpu"]


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
    assert {r["op"] for r in rows} == {"mm", "grouped_mm", "grouped_mm_wgrad"}
    assert all(r["backend"] == "reference" and r["ms"] > 0 and r["tflops"] > 0 for r in rows)
    assert "need an SM100" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "nope"])
