"""Hugging Face hub access that fails in one line when the hub cannot be reached.

Offline, the hub client retries every request five times with backoff, logging each retry, before the
loader gives up (about 30 s and a dozen lines per file). So before anything asks the hub, `unreachable()`
decides once per process whether it can: not when HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE /
TRANSFORMERS_OFFLINE) is set, nor when a TCP connection to the endpoint (HF_ENDPOINT, default
huggingface.co:443) fails within 3 s. Behind a proxy (HTTPS_PROXY / ALL_PROXY set) no direct connection
is expected, so the probe is skipped and the hub client decides.

When the hub is unreachable, a hub model loads from the local HF cache only (`local_files_only`, no
request at all), or is refused in one line when it is not cached there; data sets are refused by their
loaders (`deltalens.tasks.jsonl`). `quiet()` keeps the hub client's retry warnings off the terminal
while a loader runs: the loader's one-line error says what failed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

from deltalens.errors import DeltalensError

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
PROBE_TIMEOUT_S = 3.0
_LOGGERS = ("huggingface_hub", "datasets", "filelock")


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.cache
def _probe(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as e:
        why = e.strerror or (type(e).__name__ if not str(e) else str(e))
        return f"{host} cannot be reached: {why}"


def unreachable() -> str | None:
    """Why the hub cannot be reached ('HF_HUB_OFFLINE is set', 'huggingface.co cannot be reached: ...'), or
    None when it can (or a proxy decides)."""
    for var in OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    if any(os.environ.get(v) for v in PROXY_VARS):
        return None
    return _probe(*_endpoint())


def model_options(repo_id: str) -> dict:
    """from_pretrained options for a hub model: none when the hub is reachable; local_files_only when it is
    not but the model is in the local HF cache; otherwise a one-line DeltalensError."""
    why = unreachable()
    if why is None:
        return {}
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        cached = False
    if not cached:
        raise DeltalensError(f"cannot fetch {repo_id} from the hub ({why}) and it is not in the local cache; "
                             "download it and pass the local directory")
    return {"local_files_only": True}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The hub client's (and datasets') warnings, retries included, off for the block; restored after."""
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
