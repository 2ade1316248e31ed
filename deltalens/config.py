"""Config dataclasses: the single source of every training option (Python, CLI flags, YAML, config.json).

Each algorithm has one dataclass (`ESConfig`, `GRPOConfig`, `ChainConfig`), modelled on TRL's
`GRPOConfig` + `TrlParser`: a field is declared with `option()`, which carries its default and one
help line, and optionally

    flags       extra command-line names (`--prompts`, `-N`); the main one is `--field-name`
    trajectory  the field decides the run's trajectory: a resumed run must keep its value
    needs       (other field, allowed values): the option means something only when that field has
                one of those values (`NOT_NONE`: any; `AtLeast(n)`: n or more); given explicitly otherwise,
                it is refused (never silently ignored)
    cli         False keeps a field off the command line (set by a chain, for example)
    min         the least value of a number (the command line and YAML refuse a smaller one)
    repeat      a tuple of strings given by repeating the option (`--label a --label b`), not by commas
    old         the option's old name (`k`'s `ks`): still accepted as a flag, a YAML key and a stored key,
                and documented as the old name; giving both names is refused
    default_text  what `--help` shows as the default of an option whose default (None) is derived later

A boolean field is a `--name/--no-name` switch; with `flags`, those names alone (`--no-cache`).

From the fields, everything else is derived:

    cfg.to_dict() / Cls.from_dict(d)        every field / back (unknown keys refused); a resume reads its
                                            run's config.json with from_dict
    cfg.to_dict(in_use=True)                the options a run's config.json stores (`needs` rules hold)
    Cls.run_options(d)                      a run's config.json as the stored base of a new run
    Cls.resolve(preset=, yaml=, given=)     preset < YAML file < command line, with unknown YAML keys,
                                            wrong types and unused options refused before anything runs
    deltalens.cli.options                   typer options (name, help, type) for `deltalens train ...`

A run's config.json is the options the run used, under their names (`to_dict(in_use=True)`: an option whose
`needs` rule fails is left out, as it meant nothing), plus record fields apart from the options: RUN_KEYS
(`method`, `deltalens_version`; a chain's also `stages`, `deltalens.training.chain`). What a setting derives
is stored as resolved, beside its source (`budget` and the `iterations`/`steps` it gave). The same file is a
valid `--config` (`is_run_config`: it has both RUN_KEYS): `run_options` checks the method, drops the records,
and gives the options as the *stored* base of the new run (as a resume does), not as explicit YAML values, so
no preset lies under them, a stored budget and its count are one setting (the command line may replace
either) and the re-run is bit-identical. Older runs stored every field: an unused option there is dropped
when it holds its default and refused otherwise (never silently ignored).

A field added after runs were recorded, whose default changes what a run computes, names in the class's
`ABSENT` the value such a run ran with: a stored config.json without the field reads back with it (a resume
or a re-run keeps the old arithmetic; ES's `shared_prefix`).

A YAML file (`load_yaml`) is read within limits before anything is coerced: at most 64 KiB, 32 levels, 10,000
values, integers of 100 characters, and no aliases (`*name`: the "billion laughs" expansion); a wrong value's
message shows a bounded repr of it (`brief`), so no document makes a refusal slow, large or a traceback.

State vs hyperparameters (evosax): a config holds hyperparameters only; what a resume needs besides
them (step, seeds, checksums) lives in the run directory's state.json.

This module is torch-free and imports nothing above `deltalens.errors`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from pathlib import Path
from typing import Any, ClassVar

from deltalens.errors import DeltalensError

NOT_NONE = object()  # `needs=("budget", NOT_NONE)`: the other field must be set


class AtLeast:
    """`needs=("population_batch", AtLeast(2))`: the other field must be a number >= `least`."""

    def __init__(self, least):
        self.least = least

    def __contains__(self, value) -> bool:
        return value is not None and value >= self.least

    def __str__(self) -> str:
        return f"{self.least} or more"


def _wanted(allowed) -> str:
    """A `needs` rule's allowed values, as the refusal says them."""
    if allowed is NOT_NONE:
        return "set"
    return str(allowed) if isinstance(allowed, AtLeast) else " or ".join(map(str, allowed))


RUN_KEYS = ("method", "deltalens_version")  # record fields a run's config.json carries beside the options


def is_run_config(d: Any) -> bool:
    """A deltalens run's config.json (it carries both record fields), as opposed to a hand-written config."""
    return isinstance(d, dict) and all(k in d for k in RUN_KEYS)


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (),
           trajectory: bool = False, needs: tuple[str, Any] | None = None, cli: bool = True,
           min: float | None = None, repeat: bool = False, old: str | None = None, default_text: str | None = None,
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its help line and CLI/resume metadata (see module docstring)."""
    if not help:
        raise ValueError("every option needs a help line")
    meta = {"help": help, "flags": tuple(flags), "trajectory": trajectory, "needs": needs, "cli": cli, "min": min,
            "repeat": repeat, "old": old, "default_text": default_text}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(name: str, prefix: str = "") -> str:
    """The command-line name of a field: sigma -> --sigma, eval_every -> --eval-every."""
    return "--" + (prefix + name).replace("_", "-")


def _describe(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


class Config:
    """Base of the config dataclasses. Subclasses set METHOD and PRESETS and may set COUNT (the field
    that `budget` decides: ES iterations, GRPO steps)."""

    METHOD: ClassVar[str] = ""
    NAME: ClassVar[str] = ""  # for messages: ES, GRPO, chain
    PRESETS: ClassVar[dict[str, dict]] = {"paper": {}}
    COUNT: ClassVar[str | None] = None
    ABSENT: ClassVar[dict] = {}  # field -> the value a stored config.json without it ran with (`_with_absent`)

    # ---- fields
    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def field(cls, name: str) -> dataclasses.Field:
        return next(f for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def types(cls) -> dict[str, Any]:
        """Resolved type of every field (annotations are strings under `from __future__ import annotations`)."""
        return typing.get_type_hints(cls)

    @classmethod
    def trajectory_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("trajectory"))

    def resume_conflicts(self, stored: Config) -> list[str]:
        """Fields besides the trajectory ones that a resume of `stored` with this config may not change."""
        return []

    # ---- config.json
    def to_dict(self, in_use: bool = False) -> dict:
        """{"method": METHOD, every field} (tuples as lists); `in_use`: only the fields whose `needs` rule
        holds (what a run's config.json stores: a re-run from it never trips a `needs` rule)."""
        out = {"method": self.METHOD}
        for f in dataclasses.fields(self):
            if in_use and not self.in_use(f.name):
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def in_use(self, name: str) -> bool:
        """The field means something in this config: it has no `needs` rule, or its rule holds."""
        needs = self.field(name).metadata.get("needs")
        if needs is None:
            return True
        other, allowed = needs
        value = getattr(self, other)
        return value is not None if allowed is NOT_NONE else value in allowed

    @classmethod
    def run_options(cls, d: dict, source: str = "config") -> dict:
        """A run's config.json (or a chain stage's config) as options for `resolve(stored=...)`.

        The method is checked and the record fields dropped; unknown keys and wrong types are refused; an
        option this config does not use (its `needs` rule fails) is dropped when it holds its default
        (older runs stored every field) and refused otherwise. The values are checked together (a budget
        must give the stored count)."""
        if not isinstance(d, dict):
            raise DeltalensError(f"{source} must be a mapping of option names to values")
        cls._check_method(d, source)
        values = cls._with_absent(cls.check_keys({k: v for k, v in d.items() if k not in RUN_KEYS}, source))
        cfg = cls(**values)
        out = {}
        for name, v in values.items():
            if cfg.in_use(name):
                out[name] = v
                continue
            f = cls.field(name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if getattr(cfg, name) != default:
                other, allowed = f.metadata["needs"]
                want = _wanted(allowed)
                raise DeltalensError(f"{source}: {name} is {_describe(getattr(cfg, name))}, but it is only used "
                                     f"when {other} is {want} (it is {_describe(getattr(cfg, other))}); drop {name} "
                                     f"or set {other}")
        return out

    @classmethod
    def _check_method(cls, d: dict, source: str) -> None:
        method = d.get("method", cls.METHOD)
        if method != cls.METHOD:
            raise DeltalensError(f"{source} is a {brief(method)} config, not {cls.METHOD!r}; "
                                 f"use `deltalens train resume` or `deltalens train {method}`")

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> Config:
        """Rebuild from a run's config.json; unknown keys and another method's config are refused."""
        if not isinstance(d, dict):
            raise DeltalensError(f"{source} must be a mapping of option names to values")
        cls._check_method(d, source)
        values = cls._with_absent(cls.check_keys({k: v for k, v in d.items() if k not in RUN_KEYS}, source))
        return cls(**values)

    @classmethod
    def _with_absent(cls, values: dict) -> dict:
        """A stored config's values with `ABSENT`'s value for each field it lacks and would use: a field added
        since, whose default changes the arithmetic, reads back as what the run ran with."""
        missing = {k: v for k, v in cls.ABSENT.items() if k not in values}
        if not missing:
            return values
        stored = cls(**values)
        return {**values, **{k: v for k, v in missing.items() if stored.in_use(k)}}

    @classmethod
    def current_keys(cls, d: dict, source: str) -> dict:
        """`d` with an option's old name (`option(old=...)`) as the option's own; both names given: refused."""
        out = dict(d)
        for f in dataclasses.fields(cls):
            old = f.metadata.get("old")
            if old is not None and old in out:
                if f.name in out:
                    raise DeltalensError(f"{source}: give {f.name} or {old} (its old name), not both")
                out[f.name] = out.pop(old)
        return out

    @classmethod
    def check_keys(cls, d: dict, source: str) -> dict:
        """`d` with each value coerced to its field's type (an old name as its option's: `current_keys`);
        unknown keys and wrong types are refused."""
        d = cls.current_keys(d, source)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names, key=repr)  # a stage mapping's keys may be any YAML key
        if unknown:
            shown = ", ".join(brief(k, 40) for k in unknown[:5]) + (f" and {len(unknown) - 5} more"
                                                                        if len(unknown) > 5 else "")
            raise DeltalensError(f"{source}: unknown {cls.NAME} option(s) {shown}; "
                                 f"known: {', '.join(sorted(names))}")
        types = cls.types()
        out = {k: coerce(v, types[k], k, source) for k, v in d.items()}
        for k, v in out.items():
            least = cls.field(k).metadata.get("min")
            if least is not None and v is not None and v < least:
                raise DeltalensError(f"{source}: {k} must be >= {least} (got {brief(v)})")
        return out

    # ---- presets and the three sources
    @classmethod
    def preset(cls, name: str, **overrides) -> Config:
        """A named preset (`paper` = the defaults) plus overrides; an override this config does not use
        (its `needs` rule fails) is refused as on the command line (`check_needs`)."""
        cfg = cls(**{**cls.preset_values(name), **overrides})
        cfg.check_needs(overrides)
        return cfg

    @classmethod
    def preset_values(cls, name: str) -> dict:
        if not isinstance(name, str) or name not in cls.PRESETS:  # a YAML `preset:` may be any value
            raise DeltalensError(f"unknown {cls.NAME} preset {brief(name)}; use one of {', '.join(cls.PRESETS)}")
        return dict(cls.PRESETS[name])

    @classmethod
    def resolve(cls, *, preset: str | None = None, yaml: dict | None = None, given: dict | None = None,
                stored: dict | None = None, source: str = "the config file") -> Config:
        """The config from (lowest to highest precedence) the dataclass defaults, a preset (or a stored
        run's config), a YAML mapping and the command line (`given`: only options actually passed).

        Refused with one line: unknown YAML keys, values of the wrong type, `budget` together with an
        explicit COUNT, and explicit options whose `needs` rule does not hold in the final config.
        """
        base = dict(stored) if stored is not None else (cls.preset_values(preset) if preset else {})
        explicit = {**cls.check_keys(yaml or {}, source), **cls.check_keys(given or {}, "command line")}
        if cls.COUNT is not None and "budget" in cls.types():
            if explicit.get("budget") is not None and explicit.get(cls.COUNT) is not None:
                raise DeltalensError(f"pass either {flag_name('budget')} or {flag_name(cls.COUNT)}, not both")
            if explicit.get("budget") is not None:
                base.pop(cls.COUNT, None)  # the budget decides the count
            elif explicit.get(cls.COUNT) is not None:
                base.pop("budget", None)  # an explicit count replaces a stored budget
        cfg = cls(**{**base, **explicit})
        cfg.check_needs(explicit)
        return cfg

    def check_needs(self, explicit: dict) -> None:
        """Refuse explicitly given options that this config does not use (their `needs` rule fails)."""
        for name in explicit:
            if not self.in_use(name):
                other, allowed = self.field(name).metadata["needs"]
                value = getattr(self, other)
                want = _wanted(allowed)
                raise DeltalensError(
                    f"{flag_name(name)} is only used when {flag_name(other)} is {want} (it is "
                    f"{_describe(value)}); drop {flag_name(name)} or set {flag_name(other)}")


# ---------------------------------------------------------------------------------------------- values


def _strip_optional(tp) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else functools.reduce(operator.or_, rest)), True
    return tp, False


def _clip(text: str, limit: int = 200) -> str:
    """`text` as one line of at most `limit` characters (user text in a one-line error)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


@functools.cache
def _reprlib():
    import reprlib

    r = reprlib.Repr()
    # a value's repr in a message walks at most a few levels and items (a shared or huge value would
    # otherwise be walked whole before it is cut)
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset, r.maxfrozenset = 3, 4, 4, 4, 4, 4
    r.maxstring, r.maxlong, r.maxother = 60, 40, 60
    return r


def brief(value: Any, limit: int = 80) -> str:
    """A bounded repr of `value` for an error message (at most `limit` characters, bounded work)."""
    return _clip(_reprlib().repr(value), limit)  # reprlib also survives a repr that raises


class _Bad(Exception):
    """A value that `_coerce` cannot convert; `coerce` turns it into the one-line message."""


def coerce(value: Any, tp: Any, name: str, source: str) -> Any:
    """`value` as type `tp` (int, float, str, bool, tuples, optionals); a one-line error otherwise.

    Lenient only where YAML and the command line differ: a comma-separated string or a list for a
    tuple, an int for a float. Booleans are never numbers and numbers never booleans. The message
    is built only once the value is known to be bad, and shows a bounded repr of it (`brief`).
    """
    inner, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise DeltalensError(f"{source}: {name} must be set, not null")
    try:
        return _coerce(value, inner, name, source)
    except _Bad:
        raise DeltalensError(f"{source}: {name} must be {_type_name(inner)} (got {brief(value)})") from None


def _coerce(value: Any, inner: Any, name: str, source: str) -> Any:
    origin = typing.get_origin(inner)
    if origin is tuple:
        item = typing.get_args(inner)[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise _Bad
        return tuple(coerce(v, item, name, source) for v in value)
    if origin is typing.Union or isinstance(inner, type(int | str)):  # e.g. float | str (budget)
        for alt in typing.get_args(inner):
            try:
                return coerce(value, alt, name, source)
            except DeltalensError:
                continue
        raise _Bad
    if inner is bool:
        if isinstance(value, bool):
            return value
        raise _Bad
    if isinstance(value, bool):
        raise _Bad
    if inner is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and len(value) <= MAX_INT_CHARS and value.strip().lstrip("-").isdigit():
            try:  # items of a comma-separated list; isdigit() also accepts digits int() refuses ("²")
                return int(value)
            except ValueError:
                raise _Bad from None
        raise _Bad
    if inner is float:
        if isinstance(value, (int, float)):
            try:
                return float(value)
            except OverflowError:  # an int beyond 1e308
                raise _Bad from None
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _Bad from None
        raise _Bad
    if inner is str:
        if isinstance(value, str):
            return value
        raise _Bad
    return value


def _type_name(tp) -> str:
    if typing.get_origin(tp) is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is typing.Union or isinstance(tp, type(int | str)):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check(checks: list[tuple[bool, str]]) -> None:
    """Raise the first failed (condition, message) pair as a DeltalensError."""
    for ok, message in checks:
        if not ok:
            raise DeltalensError(message)


# Limits of a config file (`load_yaml`). A config is a mapping of a few dozen options, two levels deep at
# most (a chain's `es:`/`grpo:` stages), so these are far above any real one and far below what hurts.
MAX_YAML_BYTES = 64 * 1024  # the pure-Python composer takes ~1 s per 100 KB on a slow CPU
MAX_YAML_DEPTH = 32  # the composer recurses per level: 5000 nested `[` would be a RecursionError
MAX_YAML_NODES = 10_000  # scalars + collections
MAX_INT_CHARS = 100  # int("9" * 5000) is a ValueError (Python's int-str limit); 1:2:3 sexagesimal loops


class _YAMLLimit(Exception):
    """A config file beyond one of the limits (the message names the line)."""


@functools.cache
def _limited_loader():
    """SafeLoader with the limits checked while the node graph is composed, before anything is built.

    Aliases (`*name`) are refused outright: no config needs them, and an alias to a collection is how a
    0.7 KB "billion laughs" document expands to gigabytes (PyYAML shares the object, but anything that
    walks it, a repr or a coercion, walks every expansion). Without aliases the document built is no
    larger than the text, which the size limit bounds. Anchors alone (`&name`) are harmless and allowed.
    """
    import yaml

    class Loader(yaml.SafeLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self._depth = 0
            self._nodes = 0

        def compose_node(self, parent, index):
            mark = self.peek_event().start_mark
            if self.check_event(yaml.AliasEvent):
                raise _YAMLLimit(f"line {mark.line + 1}: YAML aliases (*name) are not allowed in a config "
                                 "file; write the value out")
            self._nodes += 1
            if self._nodes > MAX_YAML_NODES:
                raise _YAMLLimit(f"line {mark.line + 1}: more than {MAX_YAML_NODES} values")
            if self._depth >= MAX_YAML_DEPTH:
                raise _YAMLLimit(f"line {mark.line + 1}: nested more than {MAX_YAML_DEPTH} levels deep")
            self._depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_object(self, node, deep=False):
            try:
                return super().construct_object(node, deep)
            except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
                # an explicit tag on a value it cannot read (`!!int abc`, `!!bool 2`, `!!timestamp x`)
                raise _YAMLLimit(f"line {node.start_mark.line + 1}: {brief(node.value)} is not a valid "
                                 f"{node.tag.rsplit(':', 1)[-1]}") from None

        def construct_yaml_int(self, node):
            if isinstance(node.value, str) and len(node.value) > MAX_INT_CHARS:
                raise _YAMLLimit(f"line {node.start_mark.line + 1}: an integer of {len(node.value)} characters "
                                 f"(at most {MAX_INT_CHARS})")
            return super().construct_yaml_int(node)

    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    return Loader


def _yaml_problem(e) -> str:
    # a MarkedYAMLError's first line is often only its context ("while parsing a flow node"): give both
    said = ", ".join(x for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if said:
        return f"line {mark.line + 1}: {said}" if mark is not None else said
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def load_yaml(path: str | Path) -> dict:
    """A YAML (or JSON) mapping from `path`, with one-line errors.

    Read within limits (`MAX_YAML_*`, `MAX_INT_CHARS`; aliases refused: `_limited_loader`) so that no
    document, however built, makes the loader or a later coercion run long, use much memory or recurse.
    Only YAML's safe tags are built (`!!python/...` is refused).
    """
    import yaml

    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)  # never read a huge file (or /dev/zero) whole
    except FileNotFoundError:
        raise DeltalensError(f"no such config file: {p}") from None
    except OSError as e:
        raise DeltalensError(f"cannot read config file {p}: {e.strerror or e}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise DeltalensError(f"config file {p} is larger than {MAX_YAML_BYTES // 1024} KiB; a config is a "
                             "mapping of option names to values")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DeltalensError(f"cannot read config file {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_limited_loader())  # a SafeLoader: safe tags only
    except _YAMLLimit as e:
        raise DeltalensError(f"{p} is refused: {_clip(str(e))}") from None
    except yaml.YAMLError as e:
        raise DeltalensError(f"{p} is not valid YAML: {_clip(_yaml_problem(e))}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise DeltalensError(f"{p} must be a mapping of option names to values")
    return data
