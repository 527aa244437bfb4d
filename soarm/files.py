"""Atomic file writes: a reader (or a crash) never sees half a file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call write(tmp) on a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)               # left by a killed writer
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
