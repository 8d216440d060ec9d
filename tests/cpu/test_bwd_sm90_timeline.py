"""The sm90 backward's timeline variant (FC_TIMELINE) on the CPU lane: it compiles for sm_90a at
d64 and d128 with no spills, its clock reads are where the .cu puts them, its extra parameter
sits where the host packs it; the default kernels do not read the clock; the host never
dispatches it; and scripts/sm90_bwd_timeline.py's analysis on synthetic records (the GPU part runs
on the device: scripts/gpu_lane.sh timeline-bwd)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flashcuda.jit import compile_spec
from flashcuda.jit.runtime import pack_args
from flashcuda.jit.tensor_map import TensorMap
from flashcuda.ops import bwd_sm90
from flashcuda.ops.call import BwdCall

from . import script_module
from .sm90_compile import ARCH, assert_compiled_clean, dump, param_table

KERNEL = Path(bwd_sm90.__file__).resolve().parents[1] / "kernels" / bwd_sm90.SOURCE
# clock reads of the timeline build: entry, first TMA, producer done, K / V, first step, last
# step, exit (one site, both consumers), the dQ writer's end (the defaults have a writer warp);
# inside the step loop step 0's S^T and dS^T barrier, steps 0 / 1's ends (one site)
MARKS = 11


@pytest.fixture(autouse=True)
def _default_env(monkeypatch):
    for name in (bwd_sm90.ENABLE_ENV, bwd_sm90.WATCHDOG_ENV, bwd_sm90.DQ_ENV,
                 bwd_sm90.FENCE_ENV, bwd_sm90.DEFINES_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tl():
    return script_module.load("sm90_bwd_timeline")


def _timeline_configs():
    return [c for c in bwd_sm90.configs() if c.timeline]


# ---- config ------------------------------------------------------------------------------------

def test_timeline_variants_are_the_bf16_defaults_and_never_dispatched():
    tls = _timeline_configs()
    assert {c.head_dim for c in tls} == {64, 128}
    # the plain default's at both head dims, the causal default's (LPT_TAIL) where it differs,
    # and the last-wave split's pieces kernel (wave_split 2) at both
    assert {(c.head_dim, c.lpt_tail, c.wave_split) for c in tls} == {
        (64, 0, 0), (128, 0, 0), (64, 0, 2), (128, 0, 2)} | {
        (d, k, 0) for d, k in bwd_sm90.LPT_TAIL.items()}
    for cfg in tls:
        default = dataclasses.replace(bwd_sm90.select_config(torch.bfloat16, cfg.head_dim),
                                      lpt_tail=cfg.lpt_tail, wave_split=cfg.wave_split)
        assert not default.timeline  # select_config (dispatch's plan) never picks it
        assert cfg == dataclasses.replace(default, timeline=True)
        assert cfg.name == default.name + "_tl"
        assert dict(cfg.spec().defines) == {**dict(default.spec().defines), "FC_TIMELINE": "1"}
        assert cfg.smem_bytes == default.smem_bytes  # the records go to global memory only
    for cfg in bwd_sm90.configs():
        assert ("FC_TIMELINE" in dict(cfg.spec().defines)) == cfg.timeline


def test_timeline_layout_matches_the_kernel_and_the_script(tl):
    src = KERNEL.read_text()
    words = int(re.search(r"constexpr int kTimelineWords = (\d+);", src).group(1))
    assert words == bwd_sm90.TIMELINE_WORDS == tl.WORDS
    decl = re.search(r"constexpr int (kTlId = 0,[^;]*);", src).group(1)
    kernel = {name: int(v) for name, v in re.findall(r"kTl(\w+) = (\d+)", decl)}
    assert kernel == {"Id": 0, "Block": 1, "Entry": 2, "FirstTma": 3, "Produced": 4, "Kv": 5,
                      "First": 6, "Last": 7, "Exit": 8, "DqEnd": 10}
    assert bwd_sm90.TIMELINE_FIELDS == tl.FIELDS
    fields = bwd_sm90.TIMELINE_FIELDS
    assert (fields["id"], fields["block"], fields["entry"], fields["first_tma"],
            fields["produced"], fields["kv"], fields["first_step"], fields["last_step"],
            fields["exit0"], fields["exit1"], fields["dq_end"]) == (
        kernel["Id"], kernel["Block"], kernel["Entry"], kernel["FirstTma"], kernel["Produced"],
        kernel["Kv"], kernel["First"], kernel["Last"], kernel["Exit"], kernel["Exit"] + 1,
        kernel["DqEnd"])
    merged = int(re.search(r"constexpr int kTlMerged = (\d+);", src).group(1))
    assert fields["merged"] == merged and merged not in kernel.values()
    decl = re.search(r"constexpr int (kTlS0 = [^;]*);", src).group(1)
    steps = {name: int(v) for name, v in re.findall(r"kTl(\w+) = (\d+)", decl)}
    assert steps == {"S0": fields["s0"], "Bar0": fields["bar0"], "End0": fields["end0"],
                     "End1": fields["end1"]}
    used = [*kernel.values(), kernel["Exit"] + 1, merged, *steps.values()]
    assert sorted(used) == list(range(words)) == sorted(fields.values())


def test_timeline_shape_is_the_grid():
    cfg = _timeline_configs()[0]
    q = torch.zeros(3, 300, 8, cfg.head_dim, dtype=torch.bfloat16)
    k = torch.zeros(3, 513, 2, cfg.head_dim, dtype=torch.bfloat16)
    call = BwdCall(q, k, k, q, q, torch.zeros(3, 8, 300), q, k, k, 0.1, None, None,
                            False)
    assert cfg.grid(call) == (5, 2, 3)
    assert cfg.timeline_shape(call) == (3, 2, 5, bwd_sm90.TIMELINE_WORDS)


def test_run_timeline_refuses_what_the_family_refuses():
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)  # CPU tensors
    call = BwdCall(q, q, q, q, q, torch.zeros(1, 2, 64), q, q, q, 0.1, None, None,
                            False)
    with pytest.raises(NotImplementedError, match="cannot run"):
        bwd_sm90.run_timeline(call)


# ---- compile -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sass():
    """{config name: SASS} of the timeline variants and the dispatch defaults they mirror."""
    import tempfile

    cfgs = _timeline_configs()
    cfgs += [dataclasses.replace(c, timeline=False) for c in cfgs]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in cfgs:
            result = compile_spec(cfg.spec(), ARCH)
            assert_compiled_clean(result, cfg.name)  # no spills, stack or ptxas warnings
            assert not re.search(r"C75\d\d", result.log), result.log
            out[cfg.name] = dump(result.cubin, Path(tmp), "-sass")
    return out


@pytest.mark.parametrize("head_dim", [64, 128])
def test_timeline_variant_compiles_clean_and_reads_the_clock(sass, head_dim):
    cfg = next(c for c in _timeline_configs() if c.head_dim == head_dim)
    code = sass[cfg.name]
    assert not re.search(r"\b(LDL|STL)\b", code), "local memory"
    assert len(re.findall(r"SR_GLOBALTIMER", code)) == MARKS
    assert re.search(r"SR_(VIRTUAL)?SMID", code)
    # the same GEMMs as the default kernel
    default = sass[dataclasses.replace(cfg, timeline=False).name]
    assert code.count("HGMMA") == default.count("HGMMA")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_kernel_does_not_read_the_clock(sass, head_dim):
    cfg = bwd_sm90.select_config(torch.bfloat16, head_dim)
    code = sass[cfg.name]
    assert "GLOBALTIMER" not in code and "SMID" not in code


def test_timeline_parameter_follows_dv(tmp_path):
    """The extra pointer sits after dv (bwd_sm90.run passes it there; the scalar tail stays the
    PreparedLaunch's fixed part): the cubin's parameter table against pack_args' layout."""
    cfg = next(c for c in _timeline_configs() if c.head_dim == 128)
    table = param_table(compile_spec(cfg.spec(), ARCH).cubin, tmp_path)
    m = TensorMap(b"\0" * 128)
    i32, i64 = np.int32(0), np.int64(0)
    maps = (m,) * (5 if cfg.dq_tma else 4)
    args = (*maps, None, None, None, None, None, None, i64, i64, i64, i64, i64, i64, i32, i32,
            i32, i32, i32, np.float32(0), np.float32(0), i32, i32)
    _, offsets = pack_args("k", args)
    assert len(table) == len(args)
    base = table[0][0]
    assert [table[i][0] - base for i in range(len(args))] == list(offsets)


# ---- the script's analysis ---------------------------------------------------------------------

def _buffer(rows, ctas):
    """rows: dicts (cta, sm, steps, entry, kv, first_step, last_step, exit0, exit1, dq_end, ...)
    -> the kernel's buffer ([ctas][words] uint64)."""
    f = bwd_sm90.TIMELINE_FIELDS
    buf = np.zeros((ctas, bwd_sm90.TIMELINE_WORDS), dtype=np.uint64)
    for r in rows:
        w = buf[r["cta"]]
        w[f["id"]] = (r["sm"] << 32) | r["steps"]
        bx, by, bz = r.get("block", (r["cta"], 0, 0))
        w[f["block"]] = (bz << 48) | (by << 32) | bx
        for name in ("entry", "first_tma", "produced", "kv", "first_step", "last_step", "exit0",
                     "exit1", "dq_end", "s0", "bar0", "end0", "end1"):
            w[f[name]] = r.get(name, 0)
    return buf.reshape(-1)


def _synthetic(fixed_pre=3000, fill=1000, per_step=2400, epilogue=2000, drain=500, gap=700,
               step0=2400, step1=2400):
    """Two SMs, CTAs back to back on each with `gap` ns between them; steps 1..6: every phase
    known, the CTA span = fixed_pre + fill + step0 + step1 + (steps - 2) x per_step + epilogue
    + drain (step 0 alone in a one-step CTA); step 0's S^T lands 300 ns into it, its dS^T barrier
    1300 ns."""
    rows, clock = [], {0: 10_000, 1: 10_500}
    for cta, steps in enumerate([1, 2, 3, 4, 5, 6, 6, 5, 4, 3]):
        sm = cta % 2
        entry = clock[sm]
        kv = entry + fixed_pre
        first = kv + fill
        end0 = first + step0
        end1 = end0 + step1 if steps > 1 else 0
        last = end1 + (steps - 2) * per_step if steps > 1 else end0
        exit0 = last + epilogue
        end = exit0 + drain
        rows.append({"cta": cta, "sm": sm, "steps": steps, "block": (cta, 1, 2), "entry": entry,
                     "first_tma": entry + 100, "produced": first, "kv": kv,
                     "first_step": first, "last_step": last, "exit0": exit0,
                     "exit1": exit0 + 10, "dq_end": end, "s0": first + 300,
                     "bar0": first + 1300, "end0": end0, "end1": end1})
        clock[sm] = end + gap
    return rows


def test_decode_reads_every_word(tl):
    rows = _synthetic()
    got = tl.decode(_buffer(rows, 12))  # two more CTAs that never recorded: skipped
    assert len(got) == 10
    g = got[3]
    assert (g["cta"], g["sm"], g["steps"], g["block"]) == (3, 1, 4, [3, 1, 2])
    for name in ("entry", "first_tma", "kv", "first_step", "last_step", "exit0", "exit1",
                 "dq_end", "s0", "bar0", "end0", "end1"):
        assert g[name] == rows[3][name]
    assert g["end"] == rows[3]["dq_end"]


def test_decode_keeps_blocks_past_16_bits_in_x(tl):
    rows = [{"cta": 0, "sm": 131, "steps": 2**20, "block": (70000, 65535, 65535), "entry": 5,
             "kv": 6, "first_step": 7, "last_step": 8, "exit0": 9}]
    (g,) = tl.decode(_buffer(rows, 1))
    assert (g["sm"], g["steps"], g["block"], g["end"]) == (131, 2**20, [70000, 65535, 65535], 9)


def test_summary_recovers_the_phases_the_fixed_cost_and_the_gaps(tl):
    rows = _synthetic()
    s = tl.summarise(tl.decode(_buffer(rows, 10)), 10)
    assert (s["ctas"], s["sms"], s["waves"]) == (10, 2, 5.0)
    assert s["ctas_per_sm"] == {"min": 5, "max": 5}
    p = s["phases_us"]
    assert p["entry -> K/V arrival"]["median"] == pytest.approx(3.0)
    assert p["K/V arrival -> first step"]["median"] == pytest.approx(1.0)
    assert p["time per step (span / steps)"]["median"] == pytest.approx(2.4)
    assert p["time per step (span / steps)"]["p10"] == pytest.approx(2.4)
    assert p["last step -> exit (epilogue)"]["median"] == pytest.approx(2.0)
    assert p["exit -> CTA end"]["median"] == pytest.approx(0.5)
    assert s["per_step_us"] == pytest.approx(2.4)
    # fixed = 3 + 1 + 2 + 0.5 us, every CTA; the fit agrees
    assert s["fixed_per_cta_us"]["median"] == pytest.approx(6.5)
    assert s["fixed_per_cta_us"]["p90"] == pytest.approx(6.5)
    assert s["fit"]["fixed_us"] == pytest.approx(6.5)
    assert s["fit"]["per_step_us"] == pytest.approx(2.4)
    assert s["idle_gap_us"]["count"] == 8 and s["idle_gap_us"]["median"] == pytest.approx(0.7)
    assert s["overlapping_ctas"] == 0
    assert s["sm_first_entry_us"]["p90"] == pytest.approx(0.45)  # SM 1 started 0.5 us later
    text = tl.report(s)
    assert "10 CTAs (grid 10) on 2 SMs: 5.00 waves" in text
    assert "fixed cost per CTA (span - steps x 2.400 us): median 6.50 us" in text
    assert "fit: span = 6.50 us + 2.400 us per step" in text


def test_summary_splits_step_0_and_step_1_from_the_later_steps(tl):
    """A slow first step (a causal CTA's masked one) and step 1 apart from the steps after them:
    step 0 in its three parts, then each step after step 1 over the CTAs of 3 or more steps."""
    s = tl.summarise(tl.decode(_buffer(_synthetic(step0=3100, step1=2600), 10)), 10)
    p = s["phases_us"]
    assert p["step 0: issue -> S^T landed"]["median"] == pytest.approx(0.3)
    assert p["step 0: S^T landed -> dS^T barrier"]["median"] == pytest.approx(1.0)
    assert p["step 0: dS^T barrier -> done"]["median"] == pytest.approx(1.8)
    assert p["step 0 (first step -> its end)"]["median"] == pytest.approx(3.1)
    assert p["step 0 (first step -> its end)"]["count"] == 10
    assert p["step 1 (step 0's end -> its end)"]["median"] == pytest.approx(2.6)
    assert p["step 1 (step 0's end -> its end)"]["count"] == 9  # not the one-step CTA
    later = p["each step after step 1 ((last - step 1's end) / (steps - 2))"]
    assert later["count"] == 8 and later["median"] == pytest.approx(2.4)
    assert later["p10"] == pytest.approx(2.4) and later["p90"] == pytest.approx(2.4)
    text = tl.report(s)
    assert "step 0 (first step -> its end)" in text and "step 1 (step 0's end" in text


def test_summary_without_steps_or_slope(tl):
    """A CTA with no steps (a key block no query sees) counts in the span and the fixed cost but
    not in the step phases; one step count leaves the fit undefined (NaN, not printed)."""
    rows = [dict(r, steps=3, last_step=r["first_step"] + 3 * 2400,
                 exit0=r["first_step"] + 3 * 2400 + 2000)
            for r in _synthetic()[:4]]
    for r in rows:
        r["exit1"] = r["dq_end"] = r["exit0"]
    s = tl.summarise(tl.decode(_buffer(rows, 4)))
    assert s["fit"]["fixed_us"] != s["fit"]["fixed_us"]
    assert "fit:" not in tl.report(s)
    assert s["fixed_per_cta_us"]["median"] == pytest.approx(6.0)  # 3 + 1 + 2 us
    rows.append({"cta": 4, "sm": 0, "steps": 0, "entry": 100_000, "kv": 103_000,
                 "exit0": 104_000})
    s = tl.summarise(tl.decode(_buffer(rows, 5)))
    assert s["phases_us"]["time per step (span / steps)"]["count"] == 4
    assert s["phases_us"]["K/V arrival -> first step"]["count"] == 4
    assert s["phases_us"]["steps span (first -> last step)"]["count"] == 4
    assert s["phases_us"]["CTA span (entry -> end)"]["count"] == 5
    assert s["steps"]["min"] == 0


def test_summary_flags_overlapping_ctas_and_refuses_nothing(tl):
    rows = _synthetic()[:2]
    rows[1]["sm"] = 0
    rows[1].update({k: rows[1][k] - 600 for k in ("entry", "first_tma", "kv", "first_step")})
    s = tl.summarise(tl.decode(_buffer(rows, 2)))
    assert s["overlapping_ctas"] == 1 and "overlapped" in tl.report(s)
    with pytest.raises(ValueError, match="no timeline records"):
        tl.summarise([])


def test_plot_is_optional(tl, tmp_path):
    records = tl.decode(_buffer(_synthetic(), 10))
    made = tl.plot(records, tmp_path / "t.png", "synthetic")
    assert made == (tmp_path / "t.png").exists()
