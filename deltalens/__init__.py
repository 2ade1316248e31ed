"""deltalens: ES and GRPO fine-tuning, Pass@K evaluation, and analysis of what changed in the weights."""

__version__ = "0.1.0"

from deltalens.errors import DeltalensError

__all__ = ["DeltalensError", "__version__"]
