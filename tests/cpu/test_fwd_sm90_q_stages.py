"""FC_Q_STAGES=2 in flash_fwd_sm90.cu (session 14; the default since session 17 where the second
Q tile fits, FLASHCUDA_SM90_FWD_Q_STAGES=1 the A/B variant with one): two Q buffers, so a work
tile's Q (and the K / V the producer issues behind it) load while the previous work tile's last
key tiles run."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashcuda.ops import fwd_sm90

from .sm90_compile import FWD_DISPATCH_CASES as CASES
from .sm90_compile import clean_sass


@pytest.mark.parametrize("head_dim,windowed,seqlen", CASES)
def test_two_buffers_by_default_where_they_fit(monkeypatch, head_dim, windowed, seqlen):
    monkeypatch.setenv(fwd_sm90.Q_STAGES_ENV, "1")
    one = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    assert one.q_stages == 1 and "FC_Q_STAGES" not in dict(one.spec().defines)
    monkeypatch.delenv(fwd_sm90.Q_STAGES_ENV)
    two = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    bare = dataclasses.replace(one, o_tma=False)  # (O's staging tiles come after, where they fit)
    fits = bare.smem_bytes + one.q_bytes + 2 * fwd_sm90.BARRIER_BYTES <= fwd_sm90.SMEM_OPTIN
    # d128's masked-V kernels (causal / window) carry a clean V tile per consumer: no room
    assert fits == (not (head_dim == 128 and one.masked_v))
    if not fits:
        assert two == one
        return
    assert two == dataclasses.replace(one, q_stages=2) and "_q2" in two.name
    assert two.smem_bytes == one.smem_bytes + one.q_bytes + 2 * fwd_sm90.BARRIER_BYTES
    assert dict(two.spec().defines)["FC_Q_STAGES"] == "2"
    assert {one.name, two.name} <= {c.name for c in fwd_sm90.configs()}


@pytest.mark.parametrize("head_dim,windowed,seqlen", [c for c in CASES if c[:2] != (128, True)])
def test_two_q_buffers_build_clean(monkeypatch, head_dim, windowed, seqlen, tmp_path):
    """The .cu's layout agrees with the host's (a static_assert on the byte count), no spills,
    and the same TMA loads per work tile and key tile as the one-buffer kernel."""
    monkeypatch.delenv(fwd_sm90.Q_STAGES_ENV, raising=False)
    two = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    monkeypatch.setenv(fwd_sm90.Q_STAGES_ENV, "1")
    one = fwd_sm90.select_config(torch.bfloat16, head_dim, windowed, seqlen)
    loads = lambda sass: len(re.findall(r"UTMALDG", sass))  # noqa: E731
    assert loads(clean_sass(two, tmp_path)) == loads(clean_sass(one, tmp_path))


def test_q_stages_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(fwd_sm90.Q_STAGES_ENV, "3")
    with pytest.raises(ValueError, match=fwd_sm90.Q_STAGES_ENV):
        fwd_sm90.select_config(torch.bfloat16, 64)
    with pytest.raises(ValueError, match="q_stages"):
        fwd_sm90.Sm90FwdConfig(torch.bfloat16, 64, q_stages=3)
