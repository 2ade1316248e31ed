"""deltalens' per-user cache directory: DELTALENS_CACHE_DIR, else ~/.cache/deltalens.

It holds what is worth keeping between runs and safe to delete: GSM8K fetched from the hub (jsonl files)
and the generation rates measured on this machine (`deltalens.evaluation.cost`).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache directory (not created here: writers create it and tolerate failing to)."""
    env = os.environ.get("DELTALENS_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deltalens"
