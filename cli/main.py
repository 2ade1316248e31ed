"""Entry point of the `deltalens` console script: registers each command (one library call each)."""

from __future__ import annotations

import typer

from . import common
from .demo import demo
from .diff import diff_cmd, sparsify_cmd
from .diversity import diversity
from .eval import eval_cmd
from .report import render, report
from .train import train

app = typer.Typer(
    name="deltalens",
    help="Fine-tune LMs with ES and GRPO, evaluate Pass@K, and see what changed in the weights.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)



@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="print the version and exit")):
    """Fine-tune LMs with ES and GRPO, evaluate Pass@K, and see what changed in the weights.

    Errors print one line and exit 2; set DELTALENS_DEBUG=1 for tracebacks.
    """
    if version:
        from deltalens import __version__

        typer.echo(__version__)
        raise typer.Exit()


app.command("demo")(common.guard(demo))
app.command("train")(common.guard(train))
app.command("eval")(common.guard(eval_cmd))
app.command("diff")(common.guard(diff_cmd))
app.command("sparsify")(common.guard(sparsify_cmd))
app.command("diversity")(common.guard(diversity))
app.command("render")(common.guard(render))
app.command("report")(common.guard(report))


def main():
    app()


if __name__ == "__main__":
    main()
