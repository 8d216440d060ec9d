"""Content-keyed disk cache of cubins (DESIGN.md §6).

Layout: ``<dir>/<name>-<key[:20]>.cubin`` (raw cubin, so cuobjdump works on it) and, written last as
the commit marker, ``<same>.json`` holding the full key, the cubin's sha256 and length. An entry is
used only when both files are ours, the json parses, its key matches and the cubin's hash matches:
anything else (torn write, truncation, foreign owner) is a miss and gets rebuilt.

Writers hold an fcntl lock on ``<same>.lock`` (released by the kernel if the process dies, so a
killed compile never blocks the next one) and publish with temp file + os.replace.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from .._log import log_once, logger

LOCK_TIMEOUT_S = 300.0


class CacheError(RuntimeError):
    """The cache directory is unsafe to load code from."""


def cache_dir() -> Path:
    """The per-user cache directory (FLASHCUDA_CACHE_DIR overrides), created 0700."""
    env = os.environ.get("FLASHCUDA_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashcuda"


def check_dir(path: Path) -> bool:
    """Create `path` 0700 if missing; refuse it if another user owns it or others can write it.

    Returns False when it cannot be created or written (read-only file system...): the caller then
    keeps cubins in memory only. Raises CacheError when loading code from it would be unsafe.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        log_once(logging.WARNING, f"cache directory {path} cannot be created ({exc}); "
                 "compiled kernels are kept in memory only")
        return False
    st = path.stat()
    if st.st_uid != os.getuid():
        raise CacheError(
            f"cache directory {path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
            "flashcuda loads code from it, so it refuses. Set FLASHCUDA_CACHE_DIR to a directory of yours."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"cache directory {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"flashcuda loads code from it, so it refuses. Run `chmod 700 {path}` or set FLASHCUDA_CACHE_DIR."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        log_once(logging.WARNING, f"cache directory {path} is not writable; "
                 "compiled kernels are kept in memory only")
        return False
    return True


class DiskCache:
    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir()
        self._memory: dict[str, bytes] = {}
        self.writable = check_dir(self.path)

    def _stem(self, name: str, key: str) -> Path:
        return self.path / f"{name}-{key[:20]}"

    def load(self, name: str, key: str) -> bytes | None:
        """The cached cubin, or None on any kind of miss (never raises for a bad entry)."""
        if key in self._memory:
            return self._memory[key]
        stem = self._stem(name, key)
        try:
            meta_path, cubin_path = stem.with_suffix(".json"), stem.with_suffix(".cubin")
            for p in (meta_path, cubin_path):
                if p.stat().st_uid != os.getuid():
                    logger.warning("cache entry %s is not owned by you; ignoring it", p)
                    return None
            meta = json.loads(meta_path.read_text())
            data = cubin_path.read_bytes()
            if (
                meta.get("key") != key
                or meta.get("size") != len(data)
                or meta.get("sha256") != hashlib.sha256(data).hexdigest()
            ):
                logger.info("cache entry %s is stale or damaged; rebuilding", stem.name)
                return None
        except (OSError, ValueError, AttributeError):
            return None
        self._memory[key] = data
        return data

    @contextmanager
    def locked(self, name: str, key: str):
        """Hold the entry's lock (with a timeout; after it, proceed unlocked: writes are atomic)."""
        if not self.writable:
            yield
            return
        lock_path = self._stem(name, key).with_suffix(".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield
            return
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        break
                    if time.monotonic() > deadline:
                        logger.warning("waited %.0fs for %s; compiling without it", LOCK_TIMEOUT_S, lock_path)
                        break
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def store(self, name: str, key: str, cubin: bytes) -> None:
        self._memory[key] = cubin
        if not self.writable:
            return
        stem = self._stem(name, key)
        meta = {"key": key, "name": name, "size": len(cubin), "sha256": hashlib.sha256(cubin).hexdigest()}
        try:
            _atomic_write(stem.with_suffix(".cubin"), cubin)
            _atomic_write(stem.with_suffix(".json"), json.dumps(meta).encode())
        except OSError as exc:
            log_once(logging.WARNING, f"cannot write to cache directory {self.path} ({exc}); "
                     "compiled kernels are kept in memory only")
            self.writable = False

    def get_or_build(self, name: str, key: str, build: Callable[[], bytes]) -> tuple[bytes, bool]:
        """(cubin, hit): try-load -> lock -> re-check -> build -> atomic write."""
        data = self.load(name, key)
        if data is not None:
            return data, True
        with self.locked(name, key):
            data = self.load(name, key)
            if data is not None:
                return data, True
            data = build()
            self.store(name, key, data)
        return data, False

    def entries(self) -> int:
        try:
            return sum(1 for _ in self.path.glob("*.json"))
        except OSError:
            return 0


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
