"""`flashcuda bench` on the CPU lane: FLOP accounting, run records, plots, peers, parser, tables.

Everything here runs on synthetic numbers; the timing itself is exercised on the GPU machine.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys

import pytest
import torch

from flashcuda.bench import command, peers, record
from flashcuda.bench.ceilings import judge_rung
from flashcuda.bench.peers import Impl, discover, load_fa2, load_triton_tutorial
from flashcuda.bench.report import render_text, summary_table, sweep_table, verdict_lines
from flashcuda.bench.sweep import (
    SweepPoint,
    attention_flops,
    best_peer,
    grad_check,
    out_check,
    standard_points,
    visible_pairs,
)
from flashcuda.bench.timing import Timing, quantile, summarize, tflops

# ------------------------------------------------------------------------------------------------
# Synthetic record


def _timing(ms: float) -> dict:
    return Timing(ms, ms * 0.98, ms * 1.03, 50, "cuda_events").to_dict()


def _result(flops: float, tf: float | None, status: str = "ok") -> dict:
    if tf is None:
        return {"status": status, "error": "boom"} if status == "failed" else {"status": status}
    ms = flops / (tf * 1e12) * 1e3
    return {"status": "ok", "timing": _timing(ms), "tflops": tf, "first_call_ms": 1.0}


def synthetic_record(wrong_at: int | None = None) -> dict:
    rec = record.new_record("sweep", ["--quick"], {"dtype": "bf16", "fwd_only": False},
                            {"method": "cuda_events"}, environment=False)
    rec["gpu"] = {"name": "Fake H200", "sm_count": 132, "capability": "9.0"}
    rec["peers"] = {
        "flashcuda": {"status": "ok", "in_best": False, "label": "flashcuda"},
        "sdpa_flash": {"status": "ok", "in_best": True},
        "sdpa_cudnn": {"status": "ok", "in_best": True},
        "fa2": {"status": "absent", "detail": "ModuleNotFoundError: No module named 'flash_attn'"},
        "triton_tutorial": {"status": "ok", "in_best": False},
    }
    rec["ceilings"] = {"matmul_ref": "matmul_bf16", "results": {
        "matmul_bf16": {"status": "ok", "tflops": 780.0, "timing": _timing(1.41)},
        "copy": {"status": "ok", "gbps": 4200.0, "timing": _timing(1.0)}}}
    for i, p in enumerate(standard_points((1024, 4096), (64, 128))):
        entry = p.to_dict()
        ff, fb = p.flops("fwd"), p.flops("bwd")
        entry["results"] = {
            "flashcuda": {"fwd": _result(ff, 300.0), "bwd": _result(fb, 150.0)},
            "sdpa_flash": {"fwd": _result(ff, 300.0), "bwd": _result(fb, 200.0)},
            "sdpa_cudnn": {"fwd": _result(ff, 600.0), "bwd": _result(fb, 300.0)},
            "fa2": {"fwd": {"status": "absent"}, "bwd": {"status": "absent"}},
            "triton_tutorial": {"fwd": _result(ff, 900.0), "bwd": {"status": "skipped"}},
        }
        ok = i != wrong_at
        entry["check"] = {"reference": "sdpa_flash", "ok": ok,
                          "out": {"max_abs_diff": 0.004 if ok else 1.7, "ok": ok}}
        entry["seconds"] = 1.0
        rec["points"].append(entry)
    return rec


# ------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_non_causal():
    assert attention_flops(2, 3, 1024, 512, 64, False) == 4 * 2 * 3 * 1024 * 512 * 64


def test_flops_causal_is_half_and_backward_is_2_5x():
    full = attention_flops(4, 16, 2048, 2048, 128, False)
    causal = attention_flops(4, 16, 2048, 2048, 128, True)
    assert causal == full / 2
    assert attention_flops(4, 16, 2048, 2048, 128, True, "bwd") == 2.5 * causal
    with pytest.raises(ValueError):
        attention_flops(1, 1, 1, 1, 1, False, "sideways")


def test_causal_unequal_lengths_counts_bottom_right_pairs():
    # seqlen_q 2, seqlen_k 4: row 0 sees keys 0..2 (3), row 1 sees 0..3 (4).
    assert visible_pairs(2, 4, True) == 7
    # seqlen_q 4, seqlen_k 2: rows 0, 1 see nothing; row 2 sees 1, row 3 sees 2.
    assert visible_pairs(4, 2, True) == 3


def test_standard_sweep_matches_performance_md():
    pts = standard_points()
    assert len(pts) == 6 * 2 * 2
    for p in pts:
        assert p.batch * p.seqlen == 16384
        assert p.nheads * p.headdim == 2048
        assert p.dtype == "bf16"
    assert SweepPoint(16, 32, 1024, 64, False).flops("fwd") == 4 * 16 * 32 * 1024 * 1024 * 64
    # a head dim that does not divide the model dim gets the whole heads that fit (d192: 10)
    (p,) = standard_points((4096,), (192,), (False,))
    assert (p.batch, p.nheads, p.seqlen, p.headdim) == (4, 10, 4096, 192)
    with pytest.raises(ValueError):
        standard_points(headdims=(0,))
    with pytest.raises(ValueError):
        standard_points(headdims=(4096,))


def test_tflops_and_quantiles():
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(1.0, 0.0) is None
    assert quantile([1, 2, 3, 4, 5], 0.5) == 3
    assert quantile([0, 10], 0.1) == pytest.approx(1.0)
    t = summarize([float(x) for x in range(1, 102)], "cuda_events")
    assert (t.median_ms, t.p10_ms, t.p90_ms, t.n) == (51.0, 11.0, 91.0, 101)
    assert Timing.from_dict(t.to_dict()) == t


# ------------------------------------------------------------------------------------------------
# Correctness spot-check


def test_out_check_flags_wrong_and_nan():
    ref = torch.randn(2, 64, 4, 32).to(torch.bfloat16)
    assert out_check(ref.clone(), ref, "bf16")["ok"]
    bad = ref.clone()
    bad[1, 3, 2, 5] += 1.0
    res = out_check(bad, ref, "bf16")
    assert not res["ok"] and res["max_abs_diff"] >= 0.9
    nan = ref.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert not out_check(nan, ref, "bf16")["ok"]


def test_grad_check_is_relative():
    g = [torch.randn(8, 8) * 1e-3 for _ in range(3)]
    assert grad_check([x * 1.001 for x in g], g, "bf16")["ok"]
    assert not grad_check([g[0], g[1] * 2, g[2]], g, "bf16")["ok"]


# ------------------------------------------------------------------------------------------------
# Records


def test_record_roundtrip_and_required_keys(tmp_path):
    rec = synthetic_record()
    rec["points"][0]["results"]["sdpa_cudnn"]["fwd"]["tflops"] = float("nan")
    assert record.validate_record(rec) == []
    path = record.write_record(rec, tmp_path)
    assert path.name.startswith("sweep-") and path.suffix == ".json"
    text = path.read_text()
    json.loads(text)  # strict JSON: NaN became null
    assert "NaN" not in text
    back = record.load_record(path)
    assert back["points"][0]["results"]["sdpa_cudnn"]["fwd"]["tflops"] is None
    assert back["points"][1] == rec["points"][1]
    assert set(record.REQUIRED_KEYS) <= set(back)
    assert back["schema_version"] == record.SCHEMA_VERSION
    packed = tmp_path / "packed.json.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert record.load_record(packed) == back


def test_record_validation_names_the_problem(tmp_path):
    rec = synthetic_record()
    del rec["ceilings"]
    rec["points"][0]["results"]["flashcuda"]["fwd"]["timing"].pop("p90_ms")
    problems = record.validate_record(rec)
    assert any("ceilings" in p for p in problems)
    assert any("p90_ms" in p for p in problems)
    (tmp_path / "bad.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="ceilings"):
        record.load_record(tmp_path / "bad.json")
    assert record.validate_record([]) == ["record is not a JSON object"]


def test_commit_from_env_without_git(tmp_path):
    info = record.commit_info(tmp_path, {"FLASHCUDA_COMMIT": "abc1234", "FLASHCUDA_DIRTY": "1"})
    assert info == {"sha": "abc1234", "dirty": True, "source": "env"}
    assert record.commit_info(tmp_path, {}) == {"sha": "unknown", "dirty": None, "source": "unknown"}
    # `git rev-parse HEAD || echo unknown` in a tree without .git prints "HEAD\nunknown"
    bad = record.commit_info(tmp_path, {"FLASHCUDA_COMMIT": "HEAD\nunknown"})
    assert bad["sha"] == "unknown" and bad["source"] == "env"
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert record.commit_info(tmp_path, {"FLASHCUDA_COMMIT": f"HEAD\n{sha}"})["sha"] == sha


def test_commit_env_wins_over_git():
    """The GPU machine's copy may carry a stale .git: an explicit FLASHCUDA_COMMIT wins."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    info = record.commit_info(record.repo_root(), {"FLASHCUDA_COMMIT": sha})
    assert info["sha"] == sha and info["source"] == "env"


def test_commit_from_git():
    info = record.commit_info()
    if info["source"] == "git":
        assert len(info["sha"]) == 40


# ------------------------------------------------------------------------------------------------
# Plots


def test_plot_sweep_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from flashcuda.bench.plot import plot_sweep

    path = plot_sweep(synthetic_record(wrong_at=2), tmp_path / "sweep.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert plot_sweep({"points": []}, tmp_path / "none.png") is None


def test_plot_ladder_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from flashcuda.bench.plot import plot_ladder

    ceil = synthetic_record()["ceilings"]
    rows = [{"name": "vector_add", "size": 1 << 28, "gbps": 3800.0},
            {"name": "matmul", "dtype": "bf16", "tflops": 400.0}]
    rec = {"ladder": {"rungs": [{**r, "_derived": judge_rung(r, ceil)} for r in rows]}}
    assert plot_ladder(rec, tmp_path / "ladder.png").read_bytes()[:4] == b"\x89PNG"


def test_judge_rung():
    ceil = {"matmul_ref": "matmul_bf16", "results": {
        "matmul_bf16": {"tflops": 800.0}, "matmul_fp32": {"tflops": 50.0}, "copy": {"gbps": 4000.0}}}
    r = judge_rung({"name": "scale", "bytes": 8e9, "median_ms": 2.0}, ceil)
    assert r["gbps"] == pytest.approx(4000.0) and r["pct"] == pytest.approx(100.0)
    r = judge_rung({"rung": "matmul", "dtype": "fp32", "tflops": 25.0}, ceil)
    assert r["matmul_ref"] == "matmul_fp32" and r["pct"] == pytest.approx(50.0)
    r = judge_rung({"kernel": "mystery"}, ceil)
    assert r["label"] == "mystery" and r["pct"] is None


# ------------------------------------------------------------------------------------------------
# Peers


def test_missing_peer_is_absent_with_the_import_error():
    def broken():
        raise ImportError("No module named 'flash_attn'")

    impls = discover(["fa2"], loaders={"flashcuda": lambda: Impl("flashcuda", "ok"), "fa2": broken})
    assert [i.name for i in impls] == ["flashcuda", "fa2"]
    assert impls[1].status == "absent"
    assert "flash_attn" in impls[1].detail and "ImportError" in impls[1].detail
    assert impls[1].status_dict()["status"] == "absent"


def test_real_loaders_never_fake(monkeypatch):
    monkeypatch.delenv("FLASHCUDA_TRITON_TUTORIAL", raising=False)
    tut = load_triton_tutorial()
    assert tut.status == "absent" and "FLASHCUDA_TRITON_TUTORIAL" in tut.detail
    fa2 = load_fa2()
    assert fa2.status in ("ok", "absent")
    if fa2.status == "absent":
        assert fa2.forward is None and fa2.detail
    with pytest.raises(ValueError, match="unknown implementation"):
        discover(["nope"])


def test_math_backend_skipped_when_scores_do_not_fit():
    math_impl = discover(["sdpa_math"])[1]
    assert math_impl.name == "sdpa_math"
    if math_impl.status == "ok":
        assert math_impl.skip_reason(1, 16, 16384, 16384) is not None  # 16 GiB of scores
        assert math_impl.skip_reason(16, 16, 1024, 1024) is None


def test_best_peer_excludes_flashcuda_and_flagged_peers():
    rec = synthetic_record()
    name, tf = best_peer(rec["points"][0], "fwd", rec["peers"])
    assert (name, tf) == ("sdpa_cudnn", 600.0)  # the Triton tutorial (900) never counts as best


# ------------------------------------------------------------------------------------------------
# Parser and CLI


def test_parser_defaults_and_quick():
    a = command.parse_args([])
    assert a.mode == "sweep" and a.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert a.headdims == [64, 128] and a.causals == [False, True] and a.dtype == "bf16"
    assert a.out == "bench-out" and a.print_summary and not a.fwd_only
    assert a.extras == list(command.EXTRAS)
    q = command.parse_args(["--quick"])
    assert q.seqlens == [1024, 4096] and q.headdims == [64, 128] and q.causals == [False, True]


def test_parser_selections():
    a = command.parse_args(["--seqlens", "1k,2k", "16K", "--headdims", "128", "--causal", "1",
                            "--dtype", "fp16", "--fwd-only", "--out", "x", "--peers",
                            "sdpa_cudnn,fa4", "--skip", "memory,long,decode", "--no-print-summary"])
    assert a.seqlens == [1024, 2048, 16384] and a.headdims == [128] and a.causals == [True]
    assert a.dtype == "fp16" and a.fwd_only and a.out == "x" and not a.print_summary
    assert a.peer_names == ["sdpa_cudnn", "fa4"] and a.extras == ["first-call", "serving"]
    assert command.parse_args(["--no-extras"]).extras == []
    assert command.parse_args(["--peers", "none"]).peer_names == []
    assert command.parse_args(["ladder", "--quick"]).mode == "ladder"
    assert command.parse_args(["show", "r.json"]).record == "r.json"


def test_run_config_records_the_kernel_switches(monkeypatch):
    for name in command.KERNEL_ENV:
        monkeypatch.delenv(name, raising=False)
    assert command.run_config(command.parse_args([]))["kernel_env"] == {}
    monkeypatch.setenv("FLASHCUDA_BWD_SM80_CONFIG", "d128=bm64_bn64_w4")
    cfg = command.run_config(command.parse_args(["--quick"]))
    assert cfg["kernel_env"] == {"FLASHCUDA_BWD_SM80_CONFIG": "d128=bm64_bn64_w4"}


@pytest.mark.parametrize("argv", [["--peers", "fa9"], ["--seqlens", "12x"], ["--causal", "2"],
                                  ["--skip", "naps"], ["show"], ["--dtype", "fp8"]])
def test_parser_rejects(argv):
    with pytest.raises(SystemExit):
        command.parse_args(argv)


def test_main_help_list_and_usage_errors(capsys):
    assert command.main(["--help"]) == 0
    assert command.main(["bench", "--list", "--quick", "--headdims", "64"]) == 0
    out = capsys.readouterr().out
    assert "1024" in out and "4096" in out
    assert command.main(["--peers", "fa9"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_gpu_says_so(capsys):
    assert command.main(["--quick", "--out", "unused"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out


def test_show_renders_a_saved_record(tmp_path, capsys, monkeypatch):
    path = record.write_record(synthetic_record(), tmp_path)
    assert command.main(["show", str(path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "summary" in out and f"record: {path}" in out
    wrong = record.write_record(synthetic_record(wrong_at=0), tmp_path, "wrong")
    assert command.main(["show", str(wrong), "--no-plot"]) == 1
    (tmp_path / "junk.json").write_text("{}")
    assert command.main(["show", str(tmp_path / "junk.json")]) == 1
    packed = tmp_path / "packed.json.gz"  # a gzipped record: its plot is packed.png
    packed.write_bytes(gzip.compress(path.read_bytes()))
    plotted = []
    monkeypatch.setattr(command, "_plots", lambda rec, png, console: plotted.append(png.name))
    assert command.main(["show", str(packed)]) == 0
    assert plotted == ["packed.png"]


# ------------------------------------------------------------------------------------------------
# Tables


def test_summary_table_rendering():
    rec = synthetic_record(wrong_at=1)
    text = render_text([summary_table(rec)], width=120)
    lines = [x for x in text.splitlines() if x.strip()]
    assert "Fake H200" in text and "780" in text
    # one row per point: flashcuda 300 fwd vs cuDNN 600 -> 0.50x; 150 bwd vs 300 -> 0.50x
    rows = [x for x in lines if x.strip().startswith(("64", "128"))]
    assert len(rows) == len(rec["points"])
    assert "0.50×" in rows[0] and "600 cudnn" in rows[0] and "ok" in rows[0]
    assert "WRONG" in rows[1] and "0.50×" not in rows[1]
    assert max(len(x) for x in lines) <= 100  # compact: the main session sees the tail


def test_sweep_table_and_verdict():
    rec = synthetic_record(wrong_at=0)
    text = render_text([sweep_table(rec)], width=250)
    assert "SDPA cuDNN" in text and "Triton tut" in text and "wrong" in text
    assert "38%" in text  # 300 of 780 TFLOP/s
    lines = verdict_lines(rec, "x.json")
    assert any("7/8 ok, 1 wrong" in x for x in lines) and lines[-1] == "record: x.json"
    assert any("min 0.50×" in x for x in lines)


def test_small_numbers_stay_readable():
    from flashcuda.bench.report import fmt_ratio, fmt_tf

    assert (fmt_tf(1.23), fmt_tf(0.456), fmt_tf(456.7), fmt_tf(None)) == ("1.2", "0.46", "457", "–")
    assert (fmt_ratio(0.004), fmt_ratio(1.234)) == ("0.004×", "1.23×")


def test_no_nan_in_ratio_of_missing_numbers():
    rec = synthetic_record()
    rec["points"][0]["results"]["flashcuda"]["fwd"] = {"status": "failed", "error": "boom"}
    text = render_text([summary_table(rec)], width=120)
    assert "FAILED" in text and "nan" not in text.lower()
    assert not math.isnan(0.0)


def test_bench_sites_are_added_with_their_pth_files(tmp_path, monkeypatch):
    """FLASHCUDA_BENCH_SITE: a `pip --target` directory becomes importable and its .pth runs."""
    target, extra = tmp_path / "site", tmp_path / "from-pth"
    target.mkdir()
    extra.mkdir()
    (target / "fc_probe_pkg.py").write_text("VALUE = 7\n")
    (target / "probe.pth").write_text(f"{extra}\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(peers.SITE_ENV, f"{target}{os.pathsep}{tmp_path / 'missing'}")
    assert peers.add_bench_sites() == [str(target)]
    assert str(extra) in sys.path  # the .pth line was processed
    import fc_probe_pkg  # noqa: PLC0415 (importable only now)

    assert fc_probe_pkg.VALUE == 7
    assert peers.add_bench_sites() == []  # idempotent
    sys.modules.pop("fc_probe_pkg", None)


def test_host_time_is_none_without_a_gpu():
    """The host-time diagnostic never fails a run: on a machine without CUDA it records null."""
    from flashcuda.bench.timing import host_time_us

    calls = []
    assert host_time_us(lambda: calls.append(1)) is None


def test_summary_marks_host_bound_points():
    """A point whose recorded host time per call reaches 80% of its measured time gets a mark
    and the table a caption saying what it means; host_us null or small: no mark."""
    from flashcuda.bench.report import HOST_MARK, host_bound

    rec = synthetic_record()
    first, second = rec["points"][0], rec["points"][1]
    fwd = first["results"]["flashcuda"]["fwd"]
    fwd["host_us"] = fwd["timing"]["median_ms"] * 1e3 * 0.9
    second["results"]["flashcuda"]["fwd"]["host_us"] = None
    second["results"]["flashcuda"]["bwd"]["host_us"] = 1.0
    assert host_bound(first, "flashcuda", "fwd")
    assert not host_bound(second, "flashcuda", "fwd") and not host_bound(second, "flashcuda", "bwd")
    text = render_text([summary_table(rec)], width=140)
    assert text.count(HOST_MARK) == 2 and "host-bound" in text  # one cell and the caption
    plain = render_text([summary_table(synthetic_record())], width=140)
    assert HOST_MARK not in plain and "host-bound" not in plain


def test_summary_marks_unsteady_timings():
    """A timing whose p90 reaches SPREAD_LIMIT times its p10 gets its own mark and caption line
    (the median of such a spread is no figure to compare); steady timings: no mark."""
    from flashcuda.bench.report import SPREAD_LIMIT, SPREAD_MARK, unsteady

    rec = synthetic_record()
    bwd = rec["points"][0]["results"]["flashcuda"]["bwd"]["timing"]
    bwd["p10_ms"], bwd["p90_ms"] = 0.37, 0.37 * SPREAD_LIMIT * 1.01
    assert unsteady(rec["points"][0], "flashcuda", "bwd")
    assert not unsteady(rec["points"][0], "flashcuda", "fwd")
    assert not unsteady({"results": {}}, "flashcuda", "bwd")  # no timing: no mark
    text = render_text([summary_table(rec)], width=140)
    assert text.count(SPREAD_MARK) == 2 and "unsteady" in text  # one cell and the caption
    plain = render_text([summary_table(synthetic_record())], width=140)
    assert SPREAD_MARK not in plain and "unsteady" not in plain


def test_exposure_summary_splits_calls_by_when_the_gpu_reached_them():
    """A timed call is exposed exactly when the GPU reached its start event before the host had
    finished enqueueing it; the medians are those of each class (host clock in seconds)."""
    from flashcuda.bench.timing import exposure_summary

    ms = [0.15, 0.30, 0.16, 0.31, 0.15]
    gpu_start = [1.000, 1.001, 1.010, 1.003, 1.020]
    host_done = [0.990, 1.002, 1.000, 1.004, 1.010]  # calls 1 and 3: the GPU got there first
    host_us = [80.0, 300.0, 90.0, 280.0, 85.0]
    ex = exposure_summary(ms, gpu_start, host_done, host_us)
    assert (ex["calls"], ex["exposed"]) == (5, 2)
    assert ex["exposed_median_ms"] == pytest.approx(0.305)
    assert ex["ahead_median_ms"] == pytest.approx(0.15)
    assert ex["host_median_us"] == 90.0
    none = exposure_summary(ms[:1], [2.0], [1.0], [50.0])  # queued ahead: no exposed median
    assert none["exposed"] == 0 and none["exposed_median_ms"] is None
    with pytest.raises(ValueError):  # lengths must agree
        exposure_summary(ms, gpu_start[:4], host_done, host_us)


def test_summary_captions_the_exposure_of_unsteady_timings():
    """An unsteady timing that the sweep re-ran with host timestamps gets a caption line with the
    exposed count; without the record's `exposure` the caption has only the ‡ line."""
    from flashcuda.bench.report import SPREAD_LIMIT

    rec = synthetic_record()
    bwd = rec["points"][0]["results"]["flashcuda"]["bwd"]
    bwd["timing"]["p10_ms"], bwd["timing"]["p90_ms"] = 0.37, 0.37 * SPREAD_LIMIT * 1.01
    plain = render_text([summary_table(rec)], width=160)
    assert "host-exposed" not in plain
    bwd["exposure"] = {"calls": 191, "exposed": 112, "exposed_median_ms": 0.556,
                       "ahead_median_ms": 0.443, "host_median_us": 457.4, "host_p90_us": 659.6}
    text = render_text([summary_table(rec)], width=160)
    assert "112 of 191 calls host-exposed" in text and "556 µs" in text and "443 µs" in text


def test_serving_table_shows_graph_replay_and_its_failure():
    """The serving extra's CUDA-graph column: a replay p50 where capture worked, "failed" plus the
    error line where it did not, empty for records written before the column existed."""
    from flashcuda.bench.report import extras_tables

    row = {"status": "ok", "n": 200, "wall_p50_ms": 0.15, "wall_p90_ms": 0.16, "wall_p99_ms": 0.2,
           "gpu_p50_ms": 0.13, "gpu_p90_ms": 0.14, "gpu_p99_ms": 0.18}
    rec = synthetic_record()
    rec["extras"] = {"serving": {"shape": {"batch": 1, "nheads": 32, "seqlen": 2048,
                                           "headdim": 128, "causal": True},
                                 "impls": {"flashcuda": {**row, "graph_p50_ms": 0.0741},
                                           "sdpa_cudnn": {**row, "graph_error": "RuntimeError: x"},
                                           "sdpa_flash": dict(row)}}}
    text = render_text(extras_tables(rec), width=160)
    assert "graph p50" in text and "0.074" in text
    assert "failed" in text and "serving sdpa_cudnn, CUDA graph: RuntimeError: x" in text


def test_decode_table_shows_ms_bandwidth_and_failures():
    """The decode extra's table: median ms with the KV cache's GB/s per impl and cache length,
    WRONG where the float64 check failed, a failed peer with its error line."""
    from flashcuda.bench.report import extras_tables

    def ok(ms, gbps, good=True):
        return {"status": "ok", "timing": {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "n": 9,
                                           "method": "events"},
                "gbps": gbps, "check": {"ok": good}}

    rec = synthetic_record()
    rec["extras"] = {"decode": {
        "shape": {"batches": [8], "nheads": 32, "nheads_kv": 8, "headdim": 128,
                  "cache_seqlens": [1024, 4096]},
        "points": [
            {"batch": 8, "cache_seqlen": 1024, "kv_bytes": 2 ** 25,
             "impls": {"flashcuda_kvcache": ok(0.0123, 2728), "flashcuda": ok(0.0456, 736),
                       "sdpa_cudnn": {"status": "failed", "error": "RuntimeError: no gqa"}}},
            {"batch": 8, "cache_seqlen": 4096, "kv_bytes": 2 ** 27,
             "impls": {"flashcuda_kvcache": ok(0.0321, 4181, good=False),
                       "flashcuda": ok(0.1, 1342)}}]}}
    text = render_text(extras_tables(rec), width=200)
    assert "Decode (32 query heads over 8 KV heads, d128" in text
    assert "0.012 (2728)" in text and "0.046 (736)" in text and "0.032 (4181) WRONG" in text
    assert "decode 8 x 1024 sdpa_cudnn: RuntimeError: no gqa" in text
    assert "fc kvcache" in text and "fc flash_attn_func" in text


def test_decode_extra_runs_the_packaged_entry_points():
    """measure_decode on CPU tensors (the portable path) with a stand-in timer: both flashcuda
    entry points run, match the float64 check on entry 0, and get a bandwidth; a peer that
    cannot run there is recorded as failed, not dropped."""
    from flashcuda.bench import extras, peers
    from flashcuda.bench.timing import Timing

    def timer(fn):
        fn()
        return Timing(0.5, 0.4, 0.6, 3, "stand-in")

    impls = peers.discover(["sdpa_flash"])
    shape = {"batches": [1, 2], "nheads": 4, "nheads_kv": 2, "headdim": 16,
             "cache_seqlens": [7, 40]}
    rec = extras.measure_decode(impls, timer, "fp32", shape=shape, device="cpu")
    assert [(p["batch"], p["cache_seqlen"]) for p in rec["points"]] == [(1, 7), (1, 40), (2, 7),
                                                                         (2, 40)]
    for p in rec["points"]:
        for name in ("flashcuda_kvcache", "flashcuda", "flashcuda_plain"):
            r = p["impls"][name]
            assert r["status"] == "ok" and r["check"]["ok"], r
            assert r["gbps"] == pytest.approx(p["kv_bytes"] / 0.5e-3 / 1e9)
        assert p["kv_bytes"] == 2 * p["batch"] * p["cache_seqlen"] * 2 * 16 * 4
        assert set(p["impls"]) == {"flashcuda_kvcache", "flashcuda", "flashcuda_plain",
                                   "sdpa_flash"}


def test_decode_paged_arm_reads_the_same_cache(monkeypatch):
    """The paged arms' pool: the block table finds each entry's rows in the shuffled pages, so
    flash_attn_with_kvcache over the pool (SPANS_ON_DEVICE inside spans_on_device, as it was
    after) gives the contiguous cache's answer."""
    import torch

    import flashcuda
    from flashcuda import kvcache
    from flashcuda.bench import extras

    k, v = torch.randn(2, 128, 2, 16), torch.randn(2, 128, 2, 16)
    pk, pv, table = extras.paged_pool(k, v, 64)
    assert pk.shape == (4, 64, 2, 16) and table.dtype == torch.int32
    assert sorted(table.flatten().tolist()) == [0, 1, 2, 3] and table.tolist() != [[0, 1], [2, 3]]
    assert torch.equal(pk[table.long()].flatten(1, 2), k)
    assert torch.equal(pv[table.long()].flatten(1, 2), v)
    q = torch.randn(2, 1, 4, 16)
    lens = torch.full((2,), 128, dtype=torch.int32)
    monkeypatch.setattr(kvcache, "SPANS_ON_DEVICE", False)
    with extras.spans_on_device():
        assert kvcache.SPANS_ON_DEVICE
        paged = flashcuda.flash_attn_with_kvcache(q, pk, pv, cache_seqlens=lens, block_table=table)
    assert not kvcache.SPANS_ON_DEVICE
    plain = flashcuda.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    assert torch.allclose(paged, plain, atol=1e-6)


def test_decode_control_turns_the_decoding_path_off(monkeypatch):
    """The decode extra's control arm (decode_off) runs the call as it is: one kernel call with
    the query heads unpacked; afterwards packing is on again."""
    import torch

    import flashcuda
    from flashcuda.bench import extras
    from flashcuda.ops import attention as attention_ops
    from flashcuda.ops import decode

    shapes = []
    real = attention_ops._fwd_impl
    monkeypatch.setattr(attention_ops, "_fwd_impl",
                        lambda q, *rest: shapes.append(tuple(q.shape)) or real(q, *rest))
    q, k = torch.randn(2, 1, 8, 16), torch.randn(2, 40, 2, 16)
    with extras.decode_off():
        flashcuda.flash_attn_func(q, k, k)
    flashcuda.flash_attn_func(q, k, k)
    assert shapes == [(2, 1, 8, 16), (2, 4, 2, 16)] and decode.PACK_GQA


def test_plot_decode_writes_png(tmp_path):
    """The decode extra's figure: one panel per batch; none without the extra."""
    from flashcuda.bench.plot import plot_decode

    def ok(gbps, good=True):
        return {"status": "ok", "gbps": gbps, "check": {"ok": good},
                "timing": {"median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "n": 3, "method": "x"}}

    rec = synthetic_record()
    rec["extras"] = {"decode": {"dtype": "bf16", "shape": {"nheads": 32, "nheads_kv": 8,
                                                           "headdim": 128},
                                "points": [{"batch": b, "cache_seqlen": n, "kv_bytes": 1,
                                            "impls": {"flashcuda_kvcache": ok(n / 10, n != 4096),
                                                      "flashcuda": ok(n / 20),
                                                      "sdpa_flash": {"status": "failed"}}}
                                           for b in (1, 8) for n in (1024, 4096, 16384)]}}
    path = plot_decode(rec, tmp_path / "d.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert plot_decode(synthetic_record(), tmp_path / "none.png") is None


def test_graph_replay_captures_once_then_replays(monkeypatch):
    """The decode extra's graph arm: the step is captured at the first call only (timing.capture,
    stubbed here: no GPU), every call replays and returns the captured output."""
    from flashcuda.bench import extras

    captured, replays = [], []

    class Graph:
        def replay(self):
            replays.append(1)

    def capture(fn, warmup=3):
        captured.append(warmup)
        return Graph(), fn()

    monkeypatch.setattr(extras, "capture", capture)
    steps = []
    fn = extras.graph_replay(lambda: steps.append(1) or "out")
    assert [fn() for _ in range(3)] == ["out"] * 3
    assert captured == [1] and len(steps) == 1 and len(replays) == 3
