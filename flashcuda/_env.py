"""Environment switches read on the hot path, for plan-cache keys.

Every call reads them again (tests and A/B runs change them within a process), so the read must
be cheap: os.environ.get encodes the name, looks it up and decodes the value (~0.7 us each, and
a call reads a dozen). `env_values` looks the pre-encoded names up in os.environ's own mapping
(the one os.environ's setters and deleters keep), falling back to os.environ.get where that
mapping is not available.
"""

from __future__ import annotations

import os

_data = getattr(os.environ, "_data", None)
_encode = getattr(os.environ, "encodekey", None)
_FAST = isinstance(_data, dict) and callable(_encode)


def env_names(*names: str) -> tuple:
    """The names, prepared for env_values."""
    return tuple(_encode(n) for n in names) if _FAST else names


def env_values(prepared: tuple) -> tuple:
    """The raw values (None when unset) of the names `env_names` prepared, in their order."""
    if _FAST:
        get = _data.get
        return tuple([get(n) for n in prepared])
    return tuple([os.environ.get(n) for n in prepared])


def flag(name: str, default: bool) -> bool:
    """A 0 / 1 switch: `default` when unset or empty; any other value is refused, naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw in ("1", "0"):
        return raw == "1"
    raise ValueError(f"{name}: expected 0, 1 or unset, got {raw!r}")


def switched_on(name: str) -> bool:
    """A family's on / off switch (FLASHCUDA_ENABLE_*): on unless set to 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def choice(name: str, default: int, allowed: tuple[int, ...]) -> int:
    """An integer knob: `default` when unset or empty, else one of `allowed` (ValueError naming
    the variable and the allowed values otherwise)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, allowed))}, got {raw!r}")
    return int(raw)
