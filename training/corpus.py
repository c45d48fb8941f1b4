"""Real code text on every machine: the Python standard library's sources, split by file.

The split is by a stable hash of each file's path, so the held-out files (never trained on)
are the same on every machine and run.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # not the standard library


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative posix paths of the standard library's ``*.py`` files, sorted."""
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        rel = Path(directory).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def name_hash(name: str) -> int:
    """A stable 64-bit hash of a file name (the same on every machine and run)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def split_files(names: list[str], held_out_percent: int) -> tuple[list[str], list[str]]:
    """(train, held-out) file names, split by name hash and each ordered by it."""
    ordered = sorted(names, key=lambda n: (name_hash(n) // 100, n))
    held = [n for n in ordered if name_hash(n) % 100 < held_out_percent]
    train = [n for n in ordered if name_hash(n) % 100 >= held_out_percent]
    return train, held


def read_texts(root: Path, names: list[str], cap_chars: int) -> list[str]:
    """The named files' texts in order until ``cap_chars`` characters in total."""
    texts, total = [], 0
    for name in names:
        if total >= cap_chars:
            break
        text = (root / name).read_text(encoding="utf-8", errors="ignore")[: cap_chars - total]
        if text.strip():
            texts.append(text)
            total += len(text)
    return texts
