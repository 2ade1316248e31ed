"""Typer options generated from the config dataclasses (`deltalens.config`): one option per field,
named `--field-name` (plus the field's extra flags), with the field's help line, so the CLI can never
drift from the configs. Every generated option defaults to None, meaning "not given": only options a
user actually passed reach `Config.resolve`, which is how presets, YAML files and stored runs can sit
underneath them and how unused options are told apart from defaults.

Every command takes its options this way: `train`, `sweep` and `study` from the training and study
configs, and the analysis commands (`eval`, `report`, `diff`, `sparsify`, `diversity`, `probe`) from
`deltalens.evaluation.options.EvalConfig` and `deltalens.analysis.options`. On all of them `--config FILE`
is a YAML (or JSON) file of the command's options (`config_file_param`, `resolve`): unknown keys, wrong
types and options unused in the combination given are refused, flags override the file. Positional
arguments (MODELS, BASE, ...) stay typer arguments beside the generated options.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from deltalens.config import Config, flag_name, is_run_config, load_yaml
from deltalens.errors import DeltalensError


def _cli_type(tp, repeat: bool = False) -> tuple[type, bool]:
    """(the Python type typer parses, whether it is a boolean flag) for a field's type."""
    if repeat:
        return list[str], False  # `--label a --label b`: each value as given (commas and all)
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
        typ, is_flag = _cli_type(types[f.name], f.metadata.get("repeat", False))
        main = flag_name(f.name, prefix)
        extra = f.metadata.get("flags", ())
        if is_flag:  # a switch: --name/--no-name, or the field's own names (--no-cache)
            names = list(extra) if extra and not prefix else [f"{main}/--no-{main[2:]}"]
        else:  # extra names: as they are, or prefixed like the main one (--prompts -> --es-prompts)
            names = [main] + (list(extra) if not prefix else [flag_name(x[2:], prefix) for x in extra
                                                                if x.startswith("--")])
        default = _default_text(f)  # escaped: rich would read a bare [default: X] as markup and drop it
        help_text = f.metadata["help"] + (f" \\[default: {default}]" if default else "")
        bounds = {"min": f.metadata["min"]} if f.metadata.get("min") is not None else {}
        opt = typer.Option(*names, help=help_text, show_default=False, rich_help_panel=panel, **bounds)
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


def config_file_param(what: str) -> inspect.Parameter:
    """`--config FILE` of an analysis command: a YAML (or JSON) file of its options (`resolve`)."""
    return param("config_file", Path | None, "--config",
                 help=f"YAML (or JSON) file of {what} options (names as the flags', e.g. samples: 8); flags "
                      "given here override it; an architecture is --arch")


# keys of a model's own config.json (an architecture, which --config named before it meant a file of options)
_MODEL_KEYS = ("model_type", "architectures", "hidden_size", "vocab_size")


def options_file(path: str | Path, cls: type[Config]) -> dict:
    """The mapping of `cls` options in the YAML/JSON file `path` (`--config`), read within limits
    (`deltalens.config.load_yaml`). Anything else, an architecture above all (`--config tiny`, a model
    directory, a model's or a run's config.json: what `--config` meant on analysis commands before), is
    refused with one line pointing at --arch."""
    hint = f"--config is now a YAML file of {cls.NAME} options; use --arch for an architecture"
    p = Path(path).expanduser()
    if not p.is_file():
        what = "a directory" if p.is_dir() else "not a file"
        raise DeltalensError(f"--config {path} is {what}: {hint} (tiny, an HF or run directory, a config.json)")
    try:
        data = load_yaml(p)
    except DeltalensError as e:
        raise DeltalensError(f"{e} ({hint})") from None
    if is_run_config(data) or any(k in data for k in _MODEL_KEYS):
        raise DeltalensError(f"--config {path} is a model's or run's config.json, not options: {hint}")
    return data


def resolve(cls: type[Config], kwargs: dict, *, unsupported: dict[str, str] | None = None) -> Config:
    """The config of an analysis command: its `--config` file (kwargs["config_file"]) under the options
    given on the command line; unknown keys, wrong types and unused options refused (`Config.resolve`).

    unsupported: {field: why} options the command declares (they belong to its family) but cannot pass on
    yet; set explicitly, in the file or on the command line, they are refused in one line, never ignored."""
    path = kwargs.get("config_file")
    yaml = options_file(path, cls) if path is not None else {}
    explicit = given(kwargs, cls)
    cfg = cls.resolve(yaml=yaml, given=explicit, source=str(path))
    for name, why in (unsupported or {}).items():
        if name in yaml or name in explicit:
            raise DeltalensError(f"{flag_name(name)} is not yet supported by {cls.NAME} ({why}); drop it")
    return cfg


def command(name: str, doc: str, params: list[inspect.Parameter], body: Callable[[dict], Any]) -> Callable:
    """A function typer can register, with the generated `params` as its signature; calls body(kwargs)."""
    def fn(**kwargs):
        return body(kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = inspect.cleandoc(doc)
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn
