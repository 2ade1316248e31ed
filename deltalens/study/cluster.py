"""`--ray` and its companions: the options `deltalens study` and `deltalens sweep` share, and the executor
they choose (docs/cluster.md).

    RayOptions      --ray ADDRESS, --cpus-per-run, --gpus-per-run, --ray-files: one config dataclass, from
                    which `deltalens sweep` generates its Ray options; the three companions mean something
                    only with --ray (given without it, they are refused)
    ray_option      one of its fields for a config that lists it in its own place (`StudyConfig`, whose
                    options keep their order in `deltalens study --help`); `ray_checks` its checks
    executor_for    no --ray: `LocalExecutor` (every task in this process, one after the other); with it:
                    a `RayExecutor` joining that cluster, files travelling as --ray-files says

Torch-free and Ray-free: `deltalens.study.ray_executor` (which imports ray, an optional extra) is imported
by name only when --ray is given, so the import graph never depends on it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from deltalens.config import NOT_NONE, Config, check, option
from deltalens.errors import DeltalensError
from deltalens.study.executor import Executor, LocalExecutor

Log = Callable[[str], None]
FILE_MODES = {"auto": {}, "shared": {"shared_fs": True}, "objects": {"shared_fs": False}}  # else: a directory


@dataclass
class RayOptions(Config):
    """Where a command's tasks run (one help line each)."""

    METHOD: ClassVar[str] = "ray"
    NAME: ClassVar[str] = "Ray"

    ray: str | None = option(None, "run every training run and measurement as a Ray task: auto, local or a "
                             "cluster address host:port (default: in this process)")
    cpus_per_run: float = option(1.0, "CPUs each task declares to Ray", needs=("ray", NOT_NONE))
    gpus_per_run: float = option(0.0, "GPUs each task declares to Ray", needs=("ray", NOT_NONE))
    ray_files: str = option("auto", "how files reach Ray workers: auto (probe every node for the study or sweep directory), "
                            "shared (a filesystem every node mounts), objects (through Ray's object store), or a "
                            "directory every node can reach (docs/cluster.md)", needs=("ray", NOT_NONE))

    def __post_init__(self):
        check(ray_checks(self))

    @property
    def resources(self) -> dict[str, float]:
        """What every task declares (`Task.cpus`, `Task.gpus`; the local executor ignores them)."""
        return {"cpus": float(self.cpus_per_run), "gpus": float(self.gpus_per_run)}


def ray_option(name: str):
    """RayOptions' field `name` (default, help line, `needs` rule), for a config that declares it among its
    own options (`ray: str | None = ray_option("ray")`): one definition, every config that has it."""
    f = RayOptions.field(name)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def ray_checks(opts) -> list[tuple[bool, str]]:
    """The (condition, message) pairs the Ray options of `opts` (a RayOptions, or a config declaring them with
    `ray_option`) must satisfy (`deltalens.config.check`)."""
    return [
        (opts.ray is None or bool(opts.ray.strip()), "--ray must be auto, local or host:port"),
        (opts.cpus_per_run > 0 and opts.gpus_per_run >= 0, "--cpus-per-run must be > 0, --gpus-per-run >= 0"),
    ]


def executor_for(opts, progress_factory=None, log: Log = print, **ray_kwargs) -> Executor:
    """The executor --ray asks for (`opts`: a RayOptions, or a config declaring its fields): in this process
    (None), or a RayExecutor at that address. `ray_kwargs`: further RayExecutor settings (e.g.
    `config_files`), unused without --ray."""
    if opts.ray is None:
        return LocalExecutor(progress_factory=progress_factory)
    try:  # optional (ray is an extra): imported by name so that the import graph does not depend on it
        mod = importlib.import_module("deltalens.study.ray_executor")
    except ModuleNotFoundError as e:
        raise DeltalensError(f"--ray needs deltalens.study.ray_executor and ray ({e.name} is not installed)") from e
    files = FILE_MODES.get(opts.ray_files, {"artefacts": opts.ray_files})  # else: a directory every node reaches
    return mod.RayExecutor(address=opts.ray, log=log, **files, **ray_kwargs)
