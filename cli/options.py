"""Typer options generated from the config dataclasses (`deltalens.config`): one option per field,
named `--field-name` (plus the field's extra flags), with the field's help line, so the CLI can never
drift from the configs. Every generated option defaults to None, meaning "not given": only options a
user actually passed reach `Config.resolve`, which is how presets, YAML files and stored runs can sit
underneath them and how unused options are told apart from defaults.

Every command takes its options this way: `train`, `sweep`, `study` and `demo` from the training, sweep,
study and demo configs, and the analysis commands (`eval`, `report`, `diff`, `sparsify`, `diversity`,
`probe`) from `deltalens.evaluation.options.EvalConfig` and `deltalens.analysis.options`. On all of them
`--config FILE` is a YAML (or JSON) file of the command's options (`config_file_param`, `resolve`,
`split_options`): unknown keys, wrong types and options unused in the combination given are refused, flags
override the file. Positional arguments (MODELS, BASE, ...) stay typer arguments beside the generated
options (a file naming one is refused: `resolve(arguments=...)`).

One name for one thing on every command: a field is named as the flag every command gives that thing
(`k`, `out`); a field renamed so keeps its old name (`option(old=...)`: `--ks`, `--output`) as a second flag,
documented as the old name, and as a YAML key (`deltalens.config.Config.current_keys`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from deltalens.config import Config, brief, flag_name, is_run_config, load_yaml
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
    if f.metadata.get("default_text") is not None:  # a default derived later (None: not given)
        return f.metadata["default_text"]
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
        old = f.metadata.get("old")  # the field's old name: accepted, documented as the old name
        extra = tuple(x for x in f.metadata.get("flags", ()) if x != flag_name(f.name)) + \
            ((flag_name(old),) if old else ())
        if is_flag:  # a switch: --name/--no-name, or the field's own names (--no-cache)
            names = list(extra) if extra and not prefix else [f"{main}/--no-{main[2:]}"]
        else:  # extra names: as they are, or prefixed like the main one (--prompts -> --es-prompts)
            names = [main] + (list(extra) if not prefix else [flag_name(x[2:], prefix) for x in extra
                                                                if x.startswith("--")])
        default = _default_text(f)  # escaped: rich would read a bare [default: X] as markup and drop it
        help_text = (f.metadata["help"] + (f" ({flag_name(old, prefix)}: the old name)" if old else "")
                     + (f" \\[default: {default}]" if default else ""))
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


def config_file_param(what: str, example: str = "samples: 8", arch: bool = True,
                      panel: str | None = None) -> inspect.Parameter:
    """`--config FILE` of a command: a YAML (or JSON) file of its options (`resolve`, `split_options`).
    `example`: one line of such a file; `arch`: the command has --arch (the hint names it)."""
    return param("config_file", Path | None, "--config", panel=panel,
                 help=f"YAML (or JSON) file of {what} options (names as the flags', e.g. {example}); flags given "
                      "here override it" + ("; an architecture is --arch" if arch else ""))


# keys of a model's own config.json (an architecture, which --config named before it meant a file of options)
_MODEL_KEYS = ("model_type", "architectures", "hidden_size", "vocab_size")


def options_file(path: str | Path, cls: type[Config] | str, *, arch: bool = True) -> dict:
    """The mapping of `cls` options (`cls`: a config, or the name of a command whose options several configs
    share: `split_options`) in the YAML/JSON file `path` (`--config`), read within limits
    (`deltalens.config.load_yaml`). Anything else, an architecture above all (`--config tiny`, a model
    directory, a model's or a run's config.json: what `--config` meant on analysis commands before), is
    refused with one line pointing at --arch (`arch`: the command has it; else saying it is not a model)."""
    name = cls if isinstance(cls, str) else cls.NAME
    hint = (f"--config is now a YAML file of {name} options; use --arch for an architecture" if arch
            else f"--config is a YAML file of {name} options, not a model")
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


def file_keys(cls: type[Config], data: dict, source: str, *, arguments: tuple[str, ...] = ()) -> dict:
    """A --config mapping keyed by `cls`'s field names: an option's old name (ks, output) as its own (not both:
    `Config.current_keys`); a key naming one of the command's positional `arguments` (a study's model) or a
    field kept off the command line is refused in one line, never silently replaced. Other keys pass
    unchanged (`Config.resolve` refuses the unknown ones)."""
    out = cls.current_keys(data, source)
    for f in dataclasses.fields(cls):
        if f.name in out and (f.name in arguments or not f.metadata.get("cli", True)):
            what = f"the {f.name.upper()} argument" if f.name in arguments else "not an option of the command line"
            raise DeltalensError(f"{source}: {f.name} is {what}; drop it from the file")
    return out


def resolve(cls: type[Config], kwargs: dict, *, unsupported: dict[str, str] | None = None,
            arguments: dict | None = None, arch: bool = True) -> Config:
    """The config of a command: its `--config` file (kwargs["config_file"]) under the options given on the
    command line; unknown keys, wrong types and unused options refused (`Config.resolve`).

    unsupported: {field: why} options the command declares (they belong to its family) but cannot pass on
    yet; set explicitly, in the file or on the command line, they are refused in one line, never ignored.
    arguments: {field: value} the command's positional arguments set (a study's MODEL); the file may not.
    arch: the command has --arch (what a file that is an architecture is pointed at)."""
    path = kwargs.get("config_file")
    arguments = arguments or {}
    yaml = {} if path is None else file_keys(cls, options_file(path, cls, arch=arch), str(path),
                                             arguments=tuple(arguments))
    explicit = given(kwargs, cls)
    cfg = cls.resolve(yaml=yaml, given={**explicit, **arguments}, source=str(path))
    for name, why in (unsupported or {}).items():
        if name in yaml or name in explicit:
            raise DeltalensError(f"{flag_name(name)} is not yet supported by {cls.NAME} ({why}); drop it")
    return cfg


def split_options(data: dict, classes: dict[str, type[Config]], source: str, what: str) -> dict[str, dict]:
    """A --config mapping of a command whose options come from several configs (a sweep: its own, the method's,
    Ray's), split by key: {part: its keys (`file_keys`), coerced and checked by that config}. A key none of
    them has is refused as `Config.check_keys` refuses one (naming them all), so no key is silently ignored."""
    owner = {}
    for part, cls in classes.items():
        for f in dataclasses.fields(cls):
            owner.setdefault(f.name, part)
            if f.metadata.get("old") is not None:
                owner.setdefault(f.metadata["old"], part)
    unknown = sorted((k for k in data if k not in owner), key=repr)
    if unknown:
        shown = ", ".join(brief(k, 40) for k in unknown[:5]) + (f" and {len(unknown) - 5} more"
                                                                    if len(unknown) > 5 else "")
        raise DeltalensError(f"{source}: unknown {what} option(s) {shown}; known: {', '.join(sorted(owner))}")
    parts = {part: {} for part in classes}
    for k, v in data.items():
        parts[owner[k]][k] = v
    return {part: file_keys(classes[part], parts[part], source) for part in classes}


def command(name: str, doc: str, params: list[inspect.Parameter], body: Callable[[dict], Any]) -> Callable:
    """A function typer can register, with the generated `params` as its signature; calls body(kwargs)."""
    def fn(**kwargs):
        return body(kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = inspect.cleandoc(doc)
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn
