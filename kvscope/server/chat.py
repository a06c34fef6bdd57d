"""The chat template: messages rendered to one prompt text, deterministically.

    <|system|>\nYou are terse.\n<|user|>\nhello\n<|assistant|>\n

Each message is `<|role|>`, a newline, its content and a newline; the prompt ends with the
assistant's header, where generation starts. The same messages always give the same bytes,
so a conversation that grows by turns shares its whole history as a prefix (the radix cache
hits it). Content may be a string or OpenAI's list of {"type": "text", "text": ...} parts.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's; any other string is taken, as vLLM takes it


class ChatError(ValueError):
    """A malformed message; `param` names the field, as in OpenAI's errors."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError(
                    f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': ...}}", f"{where}.content"
                )
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ChatError(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def render_chat(messages: Any) -> str:
    """The prompt text of OpenAI-style `messages`; ChatError on a malformed one."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list", "messages")
    lines = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatError(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatError(f"{where}.role must be a string ({', '.join(ROLES)}, or a custom role)", f"{where}.role")
        lines.append(f"<|{role}|>\n{message_text(message.get('content'), where)}\n")
    lines.append("<|assistant|>\n")
    return "".join(lines)
