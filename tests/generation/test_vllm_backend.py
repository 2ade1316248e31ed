"""VLLMBackend without a real vLLM: what close() does with the engine (the real engine: test_vllm_real.py)."""

from __future__ import annotations

from types import SimpleNamespace

from deltalens.generation.vllm import VLLMBackend


def _llm(with_shutdown: bool):
    calls = []
    client = SimpleNamespace(shutdown=lambda: calls.append("engine_core"))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
    if with_shutdown:
        llm.shutdown = lambda: calls.append("llm")
    return llm, calls


def test_close_stops_the_engine_core_when_the_llm_has_no_shutdown():
    llm, calls = _llm(with_shutdown=False)  # vLLM 0.32: LLM has no shutdown(), its engine-core client has
    be = VLLMBackend(llm, None)
    be.close()
    assert calls == ["engine_core"] and be.llm is None
    be.close()  # a second close does nothing
    assert calls == ["engine_core"]


def test_close_prefers_the_llms_own_shutdown():
    llm, calls = _llm(with_shutdown=True)
    VLLMBackend(llm, None).close()
    assert calls == ["llm"]
