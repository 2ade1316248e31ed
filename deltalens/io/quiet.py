"""Keep transformers' own per-load progress bars ("Loading weights", "Writing model shards") off our
terminal: deltalens draws its own progress bars for long work, and one bar per checkpoint load or save
(dozens in a sparsification sweep) buries them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off for the duration of the block (restored afterwards)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
