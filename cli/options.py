"""Typer options generated from the config dataclasses (`deltalens.config`): one option per field,
named `--field-name` (plus the field's extra flags), with the field's help line, so the CLI can never
drift from the configs. Every generated option defaults to None, meaning "not given": only options a
user actually passed reach `Config.resolve`, which is how presets, YAML files and stored runs can sit
underneath them and how unused options are told apart from defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from deltalens.config import Config, flag_name


def _cli_type(tp) -> tuple[type, bool]:
    """(the Python type typer parses, whether it is a boolean flag) for a field's type."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    inner = args[0] if typing.get_origin(tp) in (typing.Union, type(int | str)) and len(args) == 1 else tp
    if inner is bool:
        return bool, True
    if inner in (int, float, str):
        return inner, False
    return str, False  # tuples (comma-separated), float | str (budget), ...: parsed by Config.resolve


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING and f.default is not None:
        v = f.default
        return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return ""


def config_params(cls: type[Config], *, prefix: str = "", exclude: tuple[str, ...] = (),
                  panel: str | None = None) -> list[inspect.Parameter]:
    """One keyword parameter per CLI field of `cls` (name `prefix + field`), for a generated command."""
    types = cls.types()
    params = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or f.name in exclude:
            continue
        typ, is_flag = _cli_type(types[f.name])
        main = flag_name(f.name, prefix)
        names = [f"{main}/--no-{main[2:]}"] if is_flag else [main]
        if not is_flag:  # extra names: as they are, or prefixed like the main one (--prompts -> --es-prompts)
            extra = f.metadata.get("flags", ())
            names += list(extra) if not prefix else [flag_name(x[2:], prefix) for x in extra if x.startswith("--")]
        default = _default_text(f)
        help_text = f.metadata["help"] + (f" [default: {default}]" if default else "")
        opt = typer.Option(*names, help=help_text, show_default=False, rich_help_panel=panel)
        params.append(inspect.Parameter(prefix + f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[typ | None, opt]))
    return params


def param(name: str, typ, *flags: str, help: str, default=None, panel: str | None = None) -> inspect.Parameter:
    """One hand-written keyword option (run-level options of `train`, `sweep`) beside the generated ones."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[typ, typer.Option(*flags, help=help, rich_help_panel=panel)])


def given(kwargs: dict, cls: type[Config], *, prefix: str = "") -> dict:
    """The options of `cls` a user passed (non-None), keyed by field name."""
    out = {}
    for f in dataclasses.fields(cls):
        v = kwargs.get(prefix + f.name)
        if v is not None:
            out[f.name] = v
    return out


def command(name: str, doc: str, params: list[inspect.Parameter], body: Callable[[dict], Any]) -> Callable:
    """A function typer can register, with the generated `params` as its signature; calls body(kwargs)."""
    def fn(**kwargs):
        return body(kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn
