"""scripts/soak.py without a GPU: the shape sampler, the warm-up's coverage, the memory rule, the
run record and the exit status (the loop itself runs on the portable path, `--device cpu`)."""

from __future__ import annotations

import json
import random
import sys

import pytest

from . import script_module


@pytest.fixture(scope="module")
def soak():
    yield script_module.load("soak", "soak_script")
    sys.modules.pop("soak_script", None)


def test_sampler_ranges_and_mix(soak):
    rng = random.Random(1)
    shapes = [soak.sample_shape(rng) for _ in range(4000)]
    for s in shapes:
        assert 1 <= s.b <= 4 and 1 <= s.sq <= 2100 and 1 <= s.sk <= 2100
        assert s.h % s.hkv == 0 and s.h <= soak.MAX_HEADS and s.h // s.hkv in (1, 2, 4, 8)
        assert s.d in soak.HEAD_DIMS and s.dtype in soak.DTYPES
        assert all(w >= -1 for w in s.window) and (not s.deterministic or s.backward)
        assert s.layout in ("contig", "bhsd")
    n = len(shapes)

    def frac(pred):
        return sum(map(pred, shapes)) / n

    assert 0.17 < frac(lambda s: s.backward) < 0.23
    assert 0.45 < frac(lambda s: s.sm90) < 0.55
    assert frac(lambda s: s.sq != s.sk) > 0.5  # ragged against each other
    assert frac(lambda s: s.sq % 64 in (63, 0, 1)) > 0.25  # tile edges
    assert frac(lambda s: s.sq <= 16) > 0.1 and max(s.sq for s in shapes) > 2000
    assert {s.mask for s in shapes} == set(soak.MASKS)
    assert {s.h // s.hkv for s in shapes} == {1, 2, 4, 8} and {s.b for s in shapes} == {1, 2, 3, 4}
    assert 0.15 < frac(lambda s: s.layout == "bhsd") < 0.25
    again = random.Random(1)
    assert [soak.sample_shape(again) for _ in range(50)] == shapes[:50]  # seeded
    assert not any(soak.sample_shape(rng, sm90_p=0.0).sm90 for _ in range(100))


def test_warmup_loads_every_kernel_and_the_largest_shape(soak):
    warm = soak.warmup_shapes(2100, (False, True))
    seen = {(s.dtype, s.d, s.deterministic, s.sm90) for s in warm if s.backward}
    assert seen >= {(dt, d, det, sm90) for dt in soak.DTYPES for d in soak.HEAD_DIMS
                    for det in (False, True) for sm90 in (False, True)}
    rng = random.Random(2)
    biggest = max(warm, key=lambda s: s.b * s.h * s.sq * s.sk * s.d)
    assert biggest.backward and not biggest.deterministic
    for s in (soak.sample_shape(rng) for _ in range(2000)):
        assert s.b * s.h * s.sq * s.sk <= biggest.b * biggest.h * biggest.sq * biggest.sk
        assert s.b * s.sk * s.hkv * s.d <= biggest.b * biggest.sk * biggest.hkv * biggest.d


def test_memory_rule(soak):
    gib, mib = soak.GIB, 1 << 20
    warm = {"allocated": 1000, "reserved": 4 * gib, "max_reserved": 8 * gib, "max_allocated": 0}
    verdict = soak.memory_verdict
    assert verdict(warm, None, dict(warm))[0] and verdict(warm, dict(warm), dict(warm))[0]
    assert verdict(warm, None, {**warm, "max_reserved": 11 * gib})[0]  # 1.25 x 8 + 1
    stepped = {**warm, "allocated": 1000 + 32 * mib}  # a workspace touched once, then steady
    assert verdict(warm, stepped, dict(stepped))[0]
    ok, why = verdict(warm, stepped, {**stepped, "allocated": 1000 + 32 * mib + 512})
    assert not ok and "over the second half" in why  # a ramp
    ok, why = verdict(warm, None, {**warm, "allocated": 1512})
    assert not ok and "allocated 1000 -> 1512" in why  # no half-way snapshot: the warm-up's
    big = {**warm, "allocated": 1000 + 65 * mib}
    ok, why = verdict(warm, big, dict(big))
    assert not ok and "since the warm-up" in why
    ok, why = verdict(warm, warm, {**warm, "max_reserved": 11 * gib + 1})
    assert not ok and "max reserved" in why
    assert verdict(None, None, None) == (True, "not measured (no CUDA device)")


@pytest.fixture
def short_warmup(soak, monkeypatch):
    """Two warm-up calls instead of all (these tests are about the run's bookkeeping)."""
    real = soak.warmup_shapes
    monkeypatch.setattr(soak, "warmup_shapes", lambda *a: real(*a)[:2])


def _args(tmp_path, *extra):
    return ["--device", "cpu", "--calls", "6", "--max-seqlen", "12", "--check-every", "2",
            "--out", str(tmp_path), *extra]


def test_a_run_writes_a_record_and_passes(soak, tmp_path, capsys):
    assert soak.main(_args(tmp_path)) == 0
    (path,) = tmp_path.glob("soak-*.json")
    record = json.loads(path.read_text())
    assert record["kind"] == "soak" and record["status"] == "pass"
    assert record["counts"]["calls"] == 6 and record["counts"]["checked"] == 3
    assert record["counts"]["by_family"] == {"portable": 6 + record["counts"]["backward"]}
    assert record["config"]["warmup_calls"] > 0 and record["failure_count"] == 0
    assert set(record["worst"]) == set(soak.QUANTITIES)  # the warm-up checks the backward too
    assert {"prebuild", "warmup", "soak", "total"} <= set(record["seconds"])
    assert record["memory"]["verdict"].startswith("not measured")
    out = capsys.readouterr().out
    assert "[soak]" in out and out.strip().splitlines()[-1].startswith("soak: PASS  6/6 calls")
    lane = script_module.load("lane_summary")
    summary = lane.soak_summary(record, path.name)
    assert summary["status"] == "pass" and summary["calls"] == 6
    assert summary["line"].startswith("soak: PASS 6/6 calls") and "not measured" in summary["line"]


def test_a_failed_check_fails_the_run(soak, tmp_path, monkeypatch, capsys, short_warmup):
    real = soak.check_call

    def one_bad(shape, *args, **kwargs):
        result = real(shape, *args, **kwargs)
        result["out"] = (float("inf"), result["out"][1])  # as a NaN output would give
        return result

    monkeypatch.setattr(soak, "check_call", one_bad)
    assert soak.main(_args(tmp_path)) == 1
    record = json.loads(next(tmp_path.glob("soak-*.json")).read_text())  # strict JSON: inf -> null
    assert record["status"] == "fail" and record["failure_count"] > 0
    assert record["worst"]["out"]["ratio"] is None
    assert "out: error inf" in record["failures"][0]["what"]
    assert "soak: FAIL" in capsys.readouterr().out


def test_an_exception_is_recorded_and_the_soak_goes_on(soak, tmp_path, monkeypatch,
                                                      short_warmup):
    real = soak.make_inputs
    calls = []
    third = 2 + 3  # after the two warm-up calls, the soak's third

    def sometimes(shape, device, g):
        calls.append(shape)
        if len(calls) == third:
            raise RuntimeError("boom")
        return real(shape, device, g)

    monkeypatch.setattr(soak, "make_inputs", sometimes)
    assert soak.main(_args(tmp_path, "--check-every", "0")) == 1
    record = json.loads(next(tmp_path.glob("soak-*.json")).read_text())
    assert record["counts"]["calls"] == 5 and record["failure_count"] == 1
    assert "RuntimeError: boom" in record["failures"][0]["what"]


def test_time_budget_makes_the_run_incomplete(soak, tmp_path, short_warmup):
    assert soak.main(_args(tmp_path, "--max-seconds", "1e-9")) == 3
    record = json.loads(next(tmp_path.glob("soak-*.json")).read_text())
    assert record["status"] == "incomplete" and record["counts"]["calls"] == 0
