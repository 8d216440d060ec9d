"""scripts/sm90_timeline.py's analysis on synthetic timelines (the GPU part runs on the device)."""

from __future__ import annotations

import numpy as np
import pytest

from . import script_module


@pytest.fixture(scope="module")
def tl():
    return script_module.load("sm90_timeline")


def _buffer(rows, grid, consumers, slots):
    """rows: (cta, consumer, slot, sm, tile, key_tiles, start, end[, q_ready, epilogue[, setup[,
    s0, first, drain]]]) -> the kernel's layout (q_ready / epilogue default to start + 100 / end -
    300, setup to 0, s0 / first to q_ready, drain to epilogue: word 1 is setup << 32 | key tiles,
    word 6 (s0 - q_ready) << 32 | (first - q_ready))."""
    buf = np.zeros((grid, consumers, slots, 8), dtype=np.uint64)
    for cta, c, s, sm, tile, tiles, start, end, *marks in rows:
        q_ready, epilogue = marks[:2] if marks else (start + 100, end - 300)
        setup = marks[2] if len(marks) > 2 else 0
        s0, first, drain = marks[3:6] if len(marks) > 3 else (q_ready, q_ready, epilogue)
        buf[cta, c, s] = ((sm << 32) | tile, (setup << 32) | tiles, start, q_ready, epilogue, end,
                          ((s0 - q_ready) << 32) | (first - q_ready), drain)
    return buf.reshape(-1)


def test_decode_skips_unused_slots_and_splits_the_first_two_words(tl):
    raw = _buffer([(0, 0, 0, 7, 5, 3, 100, 400, 150, 350, 20),
                   (1, 1, 1, 131, 2**31 + 1, 0, 50, 60, 50, 50)], 2, 2, 3)
    got = tl.decode(raw, 2, 2, 3)
    assert got == [
        {"cta": 0, "consumer": 0, "sm": 7, "tile": 5, "key_tiles": 3, "start_ns": 100,
         "q_try_ns": 120, "q_ready_ns": 150, "s0_ns": 150, "first_ns": 150, "drain_ns": 350,
         "epilogue_ns": 350, "end_ns": 400},
        {"cta": 1, "consumer": 1, "sm": 131, "tile": 2**31 + 1, "key_tiles": 0, "start_ns": 50,
         "q_try_ns": 50, "q_ready_ns": 50, "s0_ns": 50, "first_ns": 50, "drain_ns": 50,
         "epilogue_ns": 50, "end_ns": 60},
    ]


def test_summary_splits_a_work_tile_into_its_phases(tl):
    """Setup 120 ns, Q wait 180 ns, key tiles 400 + 1500 * tiles ns, epilogue 700 ns: the medians
    and the key-tile phase's fit give them back."""
    rows, t = [], 1000
    for i, tiles in enumerate([1, 2, 3, 4, 5, 6, 7]):
        q, e = t + 300, t + 300 + 400 + 1500 * tiles
        rows.append((0, 0, i, 0, i, tiles, t, e + 700, q, e, 120))
        t = e + 700 + 20
    s = tl.summarise(tl.decode(_buffer(rows, 1, 1, 8), 1, 1, 8))
    assert s["phases_median_us"]["setup"] == pytest.approx(0.12)
    assert s["phases_median_us"]["q_wait"] == pytest.approx(0.18)
    assert s["phases_median_us"]["epilogue"] == pytest.approx(0.7)
    assert s["phases_median_us"]["key_tiles"] == pytest.approx((400 + 1500 * 4) / 1e3)
    assert s["key_tiles_fit"]["fixed_us"] == pytest.approx(0.4, abs=1e-6)
    assert s["key_tiles_fit"]["per_key_tile_us"] == pytest.approx(1.5, abs=1e-9)
    assert "setup 0.12, Q wait 0.18, key tiles 6.40, epilogue 0.70" in tl.report(s)


def test_summary_splits_the_key_tile_phase(tl):
    """First S 250 ns after Q, the first tile's softmax 600 ns more, then 1100 ns per further key
    tile to the drain, whose last P V takes 300 ns: the medians give them back (over work tiles
    of 1..5 key tiles, so the middle one's other tiles take 2 x 1100 ns)."""
    rows, t = [], 1000
    for i, tiles in enumerate([1, 2, 3, 4, 5]):
        q = t + 300
        s0, first = q + 250, q + 850
        drain = first + 1100 * (tiles - 1)
        e = drain + 300
        rows.append((0, 0, i, 0, i, tiles, t, e + 700, q, e, 100, s0, first, drain))
        t = e + 700 + 20
    s = tl.summarise(tl.decode(_buffer(rows, 1, 1, 8), 1, 1, 8))
    ph = s["phases_median_us"]
    assert (ph["first_s"], ph["first_softmax"], ph["drain"]) == pytest.approx((0.25, 0.6, 0.3))
    assert ph["steps"] == pytest.approx(2.2)
    assert ("first S 0.25, first tile's softmax 0.60, other tiles 2.20, last P V 0.30"
            in tl.report(s))


def test_summary_recovers_a_linear_cost_and_the_tail(tl):
    """Durations 2000 + 500 * tiles ns on two CTAs: the fit gives 2 us + 0.5 us per key tile; the
    makespan and the tail follow from the end times."""
    rng = np.random.default_rng(3)
    rows, clock = [], {0: 1000, 1: 1000}
    for i, tiles in enumerate(rng.integers(1, 17, size=40).tolist()):
        cta = i % 2
        start = clock[cta]
        end = start + 2000 + 500 * tiles
        clock[cta] = end + 10
        rows.append((cta, 0, i // 2, cta, i, tiles, start, end))
    entries = tl.decode(_buffer(rows, 2, 1, 20), 2, 1, 20)
    s = tl.summarise(entries)
    assert s["work_tiles"] == 40 and s["ctas"] == 2
    assert s["fit"]["fixed_us"] == pytest.approx(2.0, abs=1e-6)
    assert s["fit"]["per_key_tile_us"] == pytest.approx(0.5, abs=1e-9)
    ends = sorted(clock[c] - 10 - 1000 for c in (0, 1))
    assert s["makespan_us"] == pytest.approx(ends[-1] / 1e3)
    assert s["tail_us"] == pytest.approx((ends[-1] - sum(ends) / 2) / 1e3)
    assert sum(v["count"] for v in s["by_key_tiles"].values()) == 40
    text = tl.report(s)
    assert "2.00 us per work tile + 0.500 us per key tile" in text


def test_summary_refuses_an_empty_timeline(tl):
    with pytest.raises(ValueError, match="no timeline entries"):
        tl.summarise([])


def test_words_match_the_kernel(tl):
    """The script reads as many words per entry as the .cu's Timeline writes."""
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "flashcuda" / "kernels" / "attention"
           / "flash_fwd_sm90.cu").read_text()
    assert int(re.search(r"constexpr int kTimelineWords = (\d+);", src).group(1)) == tl.WORDS
