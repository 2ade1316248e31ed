"""Keep transformers' own per-load progress bars ("Loading weights", "Writing model shards", "Converting
and de-quantizing GGUF tensors") off our terminal: deltalens draws its own progress bars for long work,
and one bar per checkpoint load or save (dozens in a sparsification sweep) buries them."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers(gguf: bool = False) -> Iterator[None]:
    """transformers' progress bars off for the duration of the block (restored afterwards).

    `gguf`: also silence the GGUF loader's bar, a plain tqdm that transformers' switch does not reach
    (its module is imported only then: it is slow to import).
    """
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_utils = old_tqdm = None
    if gguf:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        old_tqdm = getattr(gguf_utils, "tqdm", None)
        if old_tqdm is not None:
            gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
    try:
        yield
    finally:
        if old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
