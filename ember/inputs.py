"""Typed prompts, as in `vllm.inputs`: plain dicts that `LLM.generate` takes beside strings and token-id lists."""

from __future__ import annotations

from typing import TypedDict

try:
    from typing import NotRequired
except ImportError:            # Python 3.10
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt given as text; the model folder's tokenizer encodes it."""
    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids; `prompt` (optional) is its text, carried into `RequestOutput.prompt`."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt", "PromptType"]
