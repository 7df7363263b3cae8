"""Checks on text and chat input, so that a bad message is refused naming what is wrong instead of failing inside
the tokenizer or the chat template."""

from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")


def check_text(text: str, name: str) -> str:
    """Return `text` if it is valid Unicode; a lone surrogate (which no tokenizer can encode) is a ValueError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        raise ValueError(f"{name} has a lone surrogate U+{ord(char):04X} at index {e.start}; text must be valid "
                         f"Unicode") from None
    return text


def check_conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, checked; returns a list of conversations."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of message dicts (or a list of such lists), got "
                        f"{type(messages).__name__} {messages!r}")
    if not messages or isinstance(messages[0], dict):
        conversations = [messages]
    elif isinstance(messages[0], (list, tuple)):
        conversations = list(messages)
    else:
        raise TypeError(f"messages must be a list of message dicts (or a list of such lists), got a list of "
                        f"{type(messages[0]).__name__} starting with {messages[0]!r}")
    for c, conversation in enumerate(conversations):
        where = f"conversation {c}" if len(conversations) > 1 else "the conversation"
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(f"{where} must be a list of message dicts, got {type(conversation).__name__}")
        if not conversation:
            raise ValueError(f"{where} is empty; give at least one message")
        for i, message in enumerate(conversation):
            _check_message(message, f"message {i} of {where}")
    return [[_flatten(m) for m in c] for c in conversations]


def _flatten(message: dict) -> dict:
    """A message whose content is a list of text parts, with the parts joined into one string (as vLLM does for
    chat templates that expect a string)."""
    if not isinstance(message["content"], list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in message["content"])}


def _check_message(message, where: str) -> None:
    if not isinstance(message, dict):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__} "
                        f"{message!r}")
    if "role" not in message:
        raise ValueError(f"{where} has no 'role' (keys {sorted(message)}); give one of {list(ROLES)}")
    role = message["role"]
    if role not in ROLES:
        raise ValueError(f"{where} has role {role!r}; use one of {list(ROLES)}")
    if "content" not in message:
        raise ValueError(f"{where} has no 'content' (keys {sorted(message)})")
    content = message["content"]
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return      # an assistant turn that only calls tools
        raise ValueError(f"{where} has content None; give a string (None is allowed only for an assistant "
                         f"message with tool_calls)")
    if isinstance(content, str):
        check_text(content, f"the content of {where}")
        return
    if not isinstance(content, list):
        raise TypeError(f"the content of {where} must be a str or a list of parts, got {type(content).__name__} "
                        f"{content!r}")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"part {j} of the content of {where} is {part!r}; only text parts "
                             f"{{'type': 'text', 'text': ...}} are supported")
        check_text(part["text"], f"part {j} of the content of {where}")


def chat_prompt_text(tokenizer, conversation: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """One checked conversation rendered by the tokenizer's chat template."""
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def chat_prompt_ids(tokenizer, conversation: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """The token ids of the rendered conversation (the template carries its own special tokens)."""
    return tokenizer.encode(chat_prompt_text(tokenizer, conversation, add_generation_prompt, **kwargs),
                            add_special_tokens=False)
