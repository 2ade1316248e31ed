"""Entry point of the `deltalens` console script: registers each command (one library call each) and
handles every error in one place: a usage error (unknown option, bad value, missing argument) and a
DeltalensError both print one line and exit 2; tracebacks only with DELTALENS_DEBUG=1."""

from __future__ import annotations

import os
import sys

import typer

from deltalens.errors import DeltalensError
from deltalens.io.heap import keep_freed_memory

from . import common
from . import models as models_cmds
from . import train as train_cmds
from .demo import demo
from .diff import diff_cmd, sparsify_cmd
from .diversity import diversity
from .eval import eval_cmd
from .probe import probe_cmd
from .report import render, report
from .study import study, study_merge, study_scale, study_verify
from .sweep import app as sweep_app

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
app.add_typer(train_cmds.app, name="train")
app.add_typer(sweep_app, name="sweep")
app.add_typer(models_cmds.app, name="models")
app.command("eval")(common.guard(eval_cmd))
app.command("probe")(common.guard(probe_cmd))
app.command("study")(common.guard(study))
app.command("study scale")(common.guard(study_scale))  # `deltalens study scale DIR...` (main() routes it)
app.command("study verify")(common.guard(study_verify))  # `deltalens study verify STUDY` (routed likewise)
app.command("study merge")(common.guard(study_merge))  # `deltalens study merge STUDY... --out DIR` (likewise)
app.command("diff")(common.guard(diff_cmd))
app.command("sparsify")(common.guard(sparsify_cmd))
app.command("diversity")(common.guard(diversity))
app.command("render")(common.guard(render))
app.command("report")(common.guard(report))


TRAINING_COMMANDS = ("train", "study", "sweep", "demo")  # DELTALENS_MALLOC=auto keeps freed memory in these


def main(argv: list[str] | None = None) -> None:
    """Run the CLI on `argv` (default: sys.argv[1:]) and exit with its code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:  # training commands reuse freed memory instead of faulting it in again (`deltalens.io.heap`)
        keep_freed_memory(training=bool(args) and args[0] in TRAINING_COMMANDS)
    except DeltalensError as e:
        common.print_error(str(e))
        sys.exit(2)
    if args and args[0] == "train":
        args = ["train", *train_cmds.rewrite_alias(args[1:])]
    if args[:1] == ["study"] and args[1:2] in (["scale"], ["verify"], ["merge"]):  # subcommands beside `study MODEL`,
        args = [f"study {args[1]}", *args[2:]]  # whose first argument is a model
    cmd = typer.main.get_command(app)
    try:
        rv = cmd.main(args=args, prog_name="deltalens", standalone_mode=False)
    except Exception as e:  # click's exceptions (typer vendors its own copy of click: matched by shape)
        if not (callable(getattr(e, "format_message", None)) and isinstance(getattr(e, "exit_code", None), int)):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()
            sys.exit(0)
        if os.environ.get("DELTALENS_DEBUG") == "1":
            raise
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None and e.exit_code == 2 else ""
        common.print_error(e.format_message() + hint)
        sys.exit(e.exit_code)
    except typer.Abort:
        common.console.print("aborted")
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


if __name__ == "__main__":
    main()
