"""The `flashcuda` logger: silent by default (NullHandler), level from FLASHCUDA_LOG_LEVEL."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("flashcuda")
logger.addHandler(logging.NullHandler())

_level = os.environ.get("FLASHCUDA_LOG_LEVEL")
if _level:
    logger.setLevel(_level.upper())
    if not any(isinstance(h, logging.StreamHandler) for h in logger.handlers):
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("[flashcuda %(levelname)s] %(message)s"))
        logger.addHandler(_handler)

_said_once: set[str] = set()


def log_once(level: int, message: str) -> None:
    """Log `message` the first time it is seen in this process."""
    if message not in _said_once:
        _said_once.add(message)
        logger.log(level, message)
