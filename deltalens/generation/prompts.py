"""Prompts -> token ids, the same way on every path that generates or scores (HF and vLLM backends, ES
population batching, GRPO's dataset, diversity, probe).

One setting decides the form, `chat_template`:
    auto   use the tokenizer's chat template when it has one (instruct models), else raw text
    on     always (an error when the tokenizer has no template)
    off    never: raw text with the tokenizer's own special tokens (e.g. BOS)

A prompt is raw text or a list of chat messages. Tasks give both forms of every problem
(`Problem.prompt`, `Problem.chat()`); `problem_prompts` picks the one the setting asks for. With the chat
template a text prompt becomes one user turn; messages (few-shot turns first) are rendered as they are,
with the generation prompt and no extra special tokens. Raw mode only takes text.
"""

from __future__ import annotations

from collections.abc import Sequence

from deltalens.errors import DeltalensError

CHAT_MODES = ("auto", "on", "off")
Prompt = str | list  # raw text, or [{"role": ..., "content": ...}, ...]


def check_mode(mode) -> str:
    """The setting as one of auto/on/off (True/False from old configs are on/off)."""
    if mode is True:
        return "on"
    if mode is False or mode is None:
        return "off" if mode is False else "auto"
    if mode not in CHAT_MODES:
        raise DeltalensError(f"chat_template must be auto, on or off (got {mode!r})")
    return mode


def uses_chat(tok, mode) -> bool:
    """Whether prompts for this tokenizer go through its chat template under `mode`."""
    mode = check_mode(mode)
    has = bool(getattr(tok, "chat_template", None))
    if mode == "on" and not has:
        raise DeltalensError("--chat-template on, but this tokenizer has no chat template; use auto or off")
    return has if mode == "auto" else mode == "on"


def problem_prompts(problems, chat: bool) -> list[Prompt]:
    """The prompt of each problem in the form the setting asks for (chat messages or raw text)."""
    return [p.chat() if chat else p.prompt for p in problems]


def format_prompt(tok, prompt: Prompt, chat: bool) -> str:
    """The text the model sees for `prompt`."""
    if chat:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise DeltalensError("chat messages need the chat template (--chat-template auto or on)")
    return prompt


def encode_prompts(tok, prompts: Sequence[Prompt], chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt (`format_prompt`, then the tokenizer; no special tokens added to a chat
    rendering, which has its own)."""
    return [list(tok(format_prompt(tok, p, chat), add_special_tokens=not chat)["input_ids"]) for p in prompts]
