"""The masked-V checks shared by the sm80 and sm90 forward tests (FLASHCUDA_SM80_FWD_MASKED_V,
FLASHCUDA_SM90_FWD_MASKED_V): causal 256 x 256, two heads, non-finite values in V of key 200
(and 201) of head 1 in the columns `cols`."""

from __future__ import annotations

import torch

VALUES = ["nan", "inf", "-inf", "inf,-inf"]


def poison(v: torch.Tensor, value: str, cols: list[int]) -> torch.Tensor:
    """A copy of v with `value` in key 200 of head 1, columns `cols` ("inf,-inf": +Inf in key
    200 and -Inf in key 201)."""
    vn = v.clone()
    if value == "inf,-inf":
        vn[0, 200, 1, cols] = float("inf")
        vn[0, 201, 1, cols] = float("-inf")
    else:
        vn[0, 200, 1, cols] = float(value)
    return vn


def assert_reaches_only_its_rows(out, lse, clean, clean_lse, value: str, cols: list[int]) -> None:
    """Rows 0..199 of head 1 (they do not see key 200, yet share its tile) and all of head 0
    equal the clean run's bit for bit; rows that see the key get what IEEE gives (NaN; +Inf /
    -Inf in `cols` and the clean values elsewhere; NaN where +Inf and -Inf meet, from row 201)."""
    assert torch.equal(lse, clean_lse), "lse does not involve V"
    assert torch.equal(out[0, :, 0], clean[0, :, 0]), "the other head changed"
    assert torch.equal(out[0, :200, 1], clean[0, :200, 1]), "a row that does not see key 200 changed"
    seen = out[0, 200:, 1]  # (56, D)
    other = [c for c in range(out.shape[-1]) if c not in cols]
    assert seen[:, other].isfinite().all(), "a column without a non-finite value went non-finite"
    assert torch.equal(seen[:, other], clean[0, 200:, 1][:, other]), "finite columns changed"
    if value == "nan":
        assert seen[:, cols].isnan().all()
    elif value in ("inf", "-inf"):
        assert (seen[:, cols] == float(value)).all()
    else:
        assert (seen[0, cols] == float("inf")).all(), "row 200 sees only the +Inf key"
        assert seen[1:, cols].isnan().all(), "rows 201.. see +Inf and -Inf: NaN"
