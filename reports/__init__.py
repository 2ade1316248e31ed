"""Render an `analysis.json` (docs/analysis-schema.md) into one self-contained, offline HTML report.

    from deltalens.reports import render_file
    render_file("analysis.json", "report.html")

This package reads only JSON: it must never import torch, nor any deltalens module that does.
"""

from .render import (
    SCHEMA_VERSION,
    SECTIONS,
    build_html,
    default_html,
    load_analysis,
    render_file,
    render_report,
)

__all__ = ["SCHEMA_VERSION", "SECTIONS", "build_html", "default_html", "load_analysis", "render_file", "render_report"]
