"""The bundled tiny base model (char-level Llama SFT'd on `arith`); see `deltalens.tiny.build`."""

from deltalens.io.spec import TINY_DIR as MODEL_DIR

__all__ = ["MODEL_DIR"]
