"""scripts/<name>.py imported as a module for its CPU tests (scripts/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, module_name: str | None = None):
    """scripts/<name>.py as a fresh module, registered in sys.modules under `module_name` (or
    `name`) while it runs (dataclasses look their module up by name); the caller may pop it."""
    spec = importlib.util.spec_from_file_location(module_name or name,
                                                  ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
