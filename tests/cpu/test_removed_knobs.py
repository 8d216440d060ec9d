"""The kernel knobs taken out of the sm90 sources (session 39: A/B experiments that measured as
noise or losses, docs/perf-notes.md) are refused by each family's defines variable, naming the
knob, instead of compiling the default kernel under another name; knobs the sources still have
pass; and no refused name is still a knob of the sources it would reach (the lists cannot
drift onto a live knob)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flashcuda.ops import bwd_sm90, bwd_sm90_wide, fwd_sm90
from flashcuda.ops.call import BwdCall

KERNELS = Path(fwd_sm90.__file__).resolve().parent.parent / "kernels"


def _knobs(*sources: str) -> set[str]:
    """The FC_* names the sources (and the headers they include from kernels/) define with a
    default (`#ifndef FC_X`)."""
    seen, todo, out = set(), list(sources), set()
    while todo:
        rel = todo.pop()
        if rel in seen or not (KERNELS / rel).exists():
            continue
        seen.add(rel)
        text = (KERNELS / rel).read_text()
        out |= set(re.findall(r"^#ifndef (FC_[A-Z0-9_]+)", text, re.M))
        todo += re.findall(r'^#include "([^"]+)"', text, re.M)
    return out


def _wide_call(d: int = 256) -> BwdCall:
    q = torch.empty(1, 70, 2, d, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 70, dtype=torch.float32)
    return BwdCall(q, q, q, q, q, lse, q, q, q, d ** -0.5, None, None, False)


FAMILIES = [  # (module, its defines variable, a kept knob, its config call, its sources)
    (bwd_sm90, "FC_PROBS_EMU", lambda: bwd_sm90.select_config(torch.bfloat16, 64),
     ("attention/flash_bwd_sm90.cu",)),
    (fwd_sm90, "FC_EXP_SPLIT", lambda: fwd_sm90.select_config(torch.bfloat16, 128, False, 4096),
     ("attention/flash_fwd_sm90.cu", "attention/flash_fwd_sm90_fused.cu")),
    (bwd_sm90_wide, "FC_LPT_TAIL", lambda: bwd_sm90_wide.config_for(_wide_call()),
     ("attention/flash_bwd_sm90_wide.cu", "attention/flash_bwd_sm90_keys.cu")),
]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f[0].__name__.rsplit(".", 1)[-1])
def test_removed_knobs_are_refused_and_gone_from_the_sources(monkeypatch, family):
    module, kept, select, sources = family
    assert module.REMOVED_DEFINES and len(set(module.REMOVED_DEFINES)) == len(module.REMOVED_DEFINES)
    live = _knobs(*sources)
    assert kept in live
    assert not set(module.REMOVED_DEFINES) & live, set(module.REMOVED_DEFINES) & live
    for name in module.REMOVED_DEFINES:
        monkeypatch.setenv(module.DEFINES_ENV, f"{kept}=1+{name}=1")
        with pytest.raises(ValueError, match=f"{module.DEFINES_ENV}: {name} is no longer"):
            select()
    monkeypatch.setenv(module.DEFINES_ENV, f"{kept}=1")
    assert (kept, 1) in select().defines
