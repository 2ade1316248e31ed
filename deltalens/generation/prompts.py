"""Prompt text -> token ids, the same way for every path that generates (HF, vLLM, ES population
batching): with `chat_template`, the prompt becomes one user message of the tokenizer's chat template
(with the generation prompt, no extra special tokens); without, the raw text with the tokenizer's own
special tokens (e.g. BOS)."""

from __future__ import annotations

from collections.abc import Sequence


def format_prompt(tok, prompt: str, chat_template: bool) -> str:
    """The text the model sees for `prompt`."""
    if chat_template:
        msgs = [{"role": "user", "content": prompt}]
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return prompt


def encode_prompts(tok, prompts: Sequence[str], chat_template: bool = False) -> list[list[int]]:
    """Token ids of each prompt (`format_prompt`, then the tokenizer)."""
    return [list(tok(format_prompt(tok, p, chat_template), add_special_tokens=not chat_template)["input_ids"])
            for p in prompts]
