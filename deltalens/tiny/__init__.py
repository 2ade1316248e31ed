"""The bundled tiny base model (char-level Llama SFT'd on `arith`); see `deltalens.tiny.build`."""

from pathlib import Path

MODEL_DIR = Path(__file__).parent / "model"
