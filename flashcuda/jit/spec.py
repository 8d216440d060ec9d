"""What to compile: a kernel source file, its compile-time constants and its entry point.

A `KernelSpec` is pure data. Rendering it gives the exact text NVRTC sees; hashing that text, every
header it includes, the options, the target and the tool versions gives the cache key (DESIGN.md §6).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"

# Bump when the cache entry format or the rendering changes.
SCHEMA_VERSION = 1

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class KernelSpec:
    """One compiled specialisation.

    name:    readable specialisation name (logs, cache file names, CompileError), e.g.
             ``flash_fwd_sm80_bf16_d128_causal_bm128_bn64``.
    source:  path of the .cu file relative to ``flashcuda/kernels``.
    entry:   the ``extern "C"`` kernel to fetch from the module. Defaults to ``name``; a source
             whose entry is declared as ``FC_KERNEL_NAME`` gets the name substituted.
    defines: compile-time constants, rendered as ``#define KEY VALUE`` before the source.
    """

    name: str
    source: str
    entry: str = ""
    defines: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @staticmethod
    def make(
        name: str, source: str, entry: str = "", defines: Mapping[str, object] | None = None
    ) -> KernelSpec:
        items = tuple(sorted((str(k), _render_value(v)) for k, v in (defines or {}).items()))
        return KernelSpec(name=name, source=source, entry=entry or name, defines=items)

    @property
    def entry_name(self) -> str:
        return self.entry or self.name

    @property
    def source_path(self) -> Path:
        return KERNELS_DIR / self.source

    def render(self, source_text: str | None = None) -> str:
        """The exact program text handed to NVRTC (`source_text`: the source's text if not the
        file's, as the host emulator's tests of altered kernels pass)."""
        lines = [f"// flashcuda kernel {self.name}", f"#define FC_KERNEL_NAME {self.entry_name}"]
        lines += [f"#define {k} {v}" for k, v in self.defines]
        lines.append(f'#line 1 "{self.source}"')
        text = self.source_path.read_text() if source_text is None else source_text
        return "\n".join(lines) + "\n" + text

    def headers(self) -> list[Path]:
        """Every project header the source includes, transitively, in a stable order."""
        seen: dict[Path, None] = {}
        stack = [self.source_path]
        while stack:
            current = stack.pop()
            for rel in _INCLUDE.findall(current.read_text()):
                for base in (current.parent, KERNELS_DIR):
                    candidate = (base / rel).resolve()
                    if candidate.is_file():
                        if candidate not in seen:
                            seen[candidate] = None
                            stack.append(candidate)
                        break
        return sorted(seen)

    def key(self, arch: str, options: tuple[str, ...], tool_versions: str) -> str:
        """Content key: any change to what would be compiled, or by what, changes it."""
        h = hashlib.sha256()
        for part in (str(SCHEMA_VERSION), self.render(), arch, "\0".join(options), tool_versions):
            h.update(part.encode())
            h.update(b"\0")
        for header in self.headers():
            h.update(str(header.relative_to(KERNELS_DIR)).encode())
            h.update(b"\0")
            h.update(header.read_bytes())
        return h.hexdigest()


def _render_value(v: object) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return repr(v) + "f"
    return str(v)
