"""Torch pickle reader (.pt / .pth / .bin): ALWAYS `torch.load(weights_only=True)`, never pickled code.

Pickles cannot be streamed: the whole file is loaded. A dict holding the tensors under "state_dict" or
"model" is accepted; anything else that is not a plain name -> tensor mapping is refused.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.source import one_line


def torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a paragraph; the line naming the refused global is the useful one
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "global" in ln.lower() and "unsupported" in ln.lower()), None)
        raise DeltalensError(
            f"{path} is not a plain tensor state dict (weights_only load refused it): "
            f"{(why or one_line(e))[:200]}; "
            "re-save it with torch.save(model.state_dict(), path)"
        ) from e
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
