"""Torch pickle reader (.pt / .pth / .bin): ALWAYS `torch.load(weights_only=True)`, never pickled code.

Pickles cannot be streamed: the whole file is loaded. A dict holding the tensors under "state_dict" or
"model" is accepted; anything else that is not a plain name -> tensor mapping is refused.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.source import one_line


def _refusal(e: Exception) -> str:
    """What torch's weights_only unpickler refused, in a few words (its own message is a paragraph
    whose advice, re-running with weights_only=False, is exactly what must not be done)."""
    text = str(e)
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"it would import {m.group(1)}"
    m = re.search(r"Unsupported operand (\d+)", text)
    if m:
        return f"it uses pickle instruction {m.group(1)}, which plain tensor files never need"
    return "it holds objects other than tensors"


def torch_load(path: Path) -> dict[str, torch.Tensor]:
    """Load a tensor state dict from a torch pickle, never running pickled code (one-line errors)."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": noise around a one-line error
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DeltalensError(
            f"{path} is not a plain tensor state dict (weights_only load refused it): {_refusal(e)}; deltalens "
            "never runs code from a pickle: re-save it with torch.save(model.state_dict(), path)"
        ) from None
    except Exception as e:  # truncated zip, not a torch file at all, ...
        raise DeltalensError(f"cannot read {path} as a torch checkpoint: {one_line(e)}") from e
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict):
        raise DeltalensError(f"{path} holds a {type(obj).__name__}, not a state dict: "
                             "save model.state_dict()")
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise DeltalensError(
            f"{path} has non-tensor entries ({', '.join(map(str, bad[:3]))}): save model.state_dict() only"
        )
    return dict(obj)
