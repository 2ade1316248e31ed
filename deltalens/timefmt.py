"""Durations as people read them (torch-free: the CLI's progress lines and the cost estimates share it)."""

from __future__ import annotations


def duration(s: float) -> str:
    """Seconds as a short figure: '45 s', '3.2 min', '1.5 h'."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
