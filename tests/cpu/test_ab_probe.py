"""scripts/ab_probe.py (the same-process A/B of kernel variants) on the CPU: its arguments, the
rotated arm order, and the per-round ratio statistics on synthetic times (the GPU part runs on
the device: gpu_lane.sh ab-probe)."""

from __future__ import annotations

import statistics

import pytest

from . import script_module


@pytest.fixture(scope="module")
def probe():
    return script_module.load("ab_probe")


def test_arms_parse_with_several_variables_and_the_defaults(probe):
    assert probe.parse_arm("def:") == ("def", {})
    assert probe.parse_arm("mb:FLASHCUDA_SM90_FWD_DEFINES=FC_MASK_BITS=0;X=1") == (
        "mb", {"FLASHCUDA_SM90_FWD_DEFINES": "FC_MASK_BITS=0", "X": "1"})
    for bad in ("nolabel", ":X=1", "a:X", "a:=1"):
        with pytest.raises(ValueError):
            probe.parse_arm(bad)


def test_shapes_parse(probe):
    assert probe.parse_shape("32,512,16,64") == (32, 512, 16, 64)
    assert probe.parse_shape("16,1024,32,128,8") == (16, 1024, 32, 128, 8)  # GQA: 8 K / V heads
    for bad in ("32,512,16", "32,512,16,0", "a,b,c,d", "16,1024,32,128,5", "1,2,3,4,5,6"):
        with pytest.raises(ValueError):
            probe.parse_shape(bad)


def test_every_arm_leads_equally_often(probe):
    n, rounds = 3, 12
    orders = [probe.rotation(n, r) for r in range(rounds)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert [sum(o[0] == a for o in orders) for a in range(n)] == [rounds // n] * n


def test_ratios_are_per_round_and_the_base_is_one(probe):
    base = [1.0, 1.1, 0.9, 1.05, 0.95]
    faster = [t / 1.04 for t in base]  # 4% faster in every round, whatever the drift
    rows = probe.summarise({"def": base, "new": faster}, work=2e9)
    assert rows[0]["ratio"] == pytest.approx(1.0) and rows[0]["p10"] == pytest.approx(1.0)
    assert rows[1]["ratio"] == pytest.approx(1.04)
    assert rows[1]["p10"] == pytest.approx(1.04) and rows[1]["p90"] == pytest.approx(1.04)
    assert rows[1]["ms"] == pytest.approx(statistics.median(faster))
    assert rows[0]["tflops"] == pytest.approx(2e9 / statistics.median(base) / 1e9)
    assert "*" in probe.format_rows("t", rows).splitlines()[2]  # beyond the noise
    assert "*" not in probe.format_rows("t", rows).splitlines()[1]


def test_a_noisy_arm_does_not_read_as_beyond_the_noise(probe):
    base = [1.0] * 10
    noisy = [0.97, 1.03] * 5
    rows = probe.summarise({"def": base, "new": noisy}, work=1e9)
    assert rows[1]["p10"] < 1.0 < rows[1]["p90"]
    assert "*" not in probe.format_rows("t", rows).splitlines()[2]
    with pytest.raises(ValueError, match="rounds"):
        probe.summarise({"def": base, "new": noisy[:3]}, work=1e9)


def test_env_is_restored_after_an_arm(probe, monkeypatch):
    import os

    monkeypatch.setenv("FC_PROBE_KEEP", "old")
    monkeypatch.delenv("FC_PROBE_NEW", raising=False)
    seen = probe._with_env({"FC_PROBE_KEEP": "arm", "FC_PROBE_NEW": "1"},
                           lambda: (os.environ["FC_PROBE_KEEP"], os.environ["FC_PROBE_NEW"]))
    assert seen == ("arm", "1")
    assert os.environ["FC_PROBE_KEEP"] == "old" and "FC_PROBE_NEW" not in os.environ


def test_a_peer_arm_runs_the_peer_and_an_absent_one_is_named(probe, monkeypatch):
    import torch

    from flashcuda.bench import peers

    fwd = probe.load_peers(["sdpa_math"])["sdpa_math"]
    q, k, v = (torch.randn(1, 5, 2, 8, dtype=torch.float64) for _ in range(3))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 8 ** -0.5
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    torch.testing.assert_close(fwd(q, k, v, True), want)

    def absent():
        return peers._absent("fa4", ImportError("no flash_attn here"))

    monkeypatch.setitem(peers.LOADERS, "fa4", absent)
    with pytest.raises(SystemExit, match="--peer fa4: ImportError: no flash_attn here"):
        probe.load_peers(["fa4"])


def test_gqa_shapes_with_a_peer_are_refused_before_any_run(probe, capsys):
    with pytest.raises(SystemExit):
        probe.main(["--arm", "a:", "--arm", "b:X=1", "--peer", "sdpa_cudnn",
                    "--shapes", "16,1024,32,128,8"])
    assert "GQA" in capsys.readouterr().err


def test_no_peer_loads_none(probe):
    assert probe.load_peers([]) == {}


def test_a_peer_runs_inside_its_context(probe, monkeypatch):
    """SDPA's peers pin their backend with a context manager: the arm must enter it."""
    import contextlib

    from flashcuda.bench import peers

    entered = []

    @contextlib.contextmanager
    def pinned():
        entered.append("in")
        yield

    def fake():
        return peers.Impl("fa4", "ok", "fake", lambda q, k, v, causal, scale: q * scale,
                          context=pinned)

    monkeypatch.setitem(peers.LOADERS, "fa4", fake)
    import torch

    fwd = probe.load_peers(["fa4"])["fa4"]
    q = torch.full((1, 2, 1, 4), 3.0)
    torch.testing.assert_close(fwd(q, q, q, False), q * 0.5)  # scale 4 ** -0.5
    assert entered == ["in"]
