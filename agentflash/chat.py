"""Chat-template rendering for sessions whose KV lives across turns.

A session's token list is what the model really saw and produced: the first prompt rendered by
the tokenizer's chat template, then each reply's generated tokens as generated, then only the
rendering of the messages added since (user messages, tool results). Re-rendering the whole
history instead could tokenize an earlier reply differently from how it was generated, and the
prefix cache would then miss from that point on.

The new messages' text is the template's rendering of the whole conversation minus its rendering
up to the last reply; what the template writes after a reply's end-of-turn token (Qwen: "\n") is
prepended. Where a template does not render histories as prefixes of each other, the whole
conversation is rendered afresh (still correct; the cache then reuses the common prefix only).
"""

from __future__ import annotations

from typing import Any

from .errors import CheckpointError
from .toolcall_parser import detect_format


class ChatFormat:
    """The model's chat template and tool-call syntax, from its Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any, eos_token_id: int) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise CheckpointError("the model's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.eos_text = tokenizer.decode([eos_token_id])
        self.call_format = detect_format(tokenizer.chat_template)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt(self, session: list[int] | None, replied: int, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]]) -> list[int]:
        """Token ids of the next prompt: `session` (tokens so far, ending with the last reply;
        None on the first step) followed by messages[replied:] rendered, then the assistant's
        generation prompt. messages[:replied] are the messages `session` already holds."""
        full = self.render(messages, tools, generation_prompt=True)
        if session is None:
            return self.encode(full)
        before = self.render(messages[:replied], tools, generation_prompt=False)
        end = before.rfind(self.eos_text)
        if not full.startswith(before) or end < 0:
            return self.encode(full)
        after_eos = before[end + len(self.eos_text):]
        return session + self.encode(after_eos + full[len(before):])
