"""A chat request's prompt: its messages (and tools) rendered by the chat template, the tokenizer's or the one
`ember serve --chat-template` gives; and the check of a request's grammar, which names the field it came from."""

from __future__ import annotations

from ember.chat_input import chat_prompt_ids, chat_prompt_text
from ember.sampling_params import SamplingParams
from ember.serve.protocol import ApiError, ChatCompletionRequest

# a tool no conversation names: whether it shows in a rendered prompt tells whether the template renders tools
_PROBE_TOOL = {"type": "function", "function": {"name": "ember_probe_tool_x7q", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def check_structured(front, params: SamplingParams, field: str | None) -> None:
    """Refuse a schema, regex or grammar that cannot compile, naming the field that gave it and the problem."""
    if params.structured_outputs is None:
        return
    try:
        front.check_structured_output(params.structured_outputs)
    except ValueError as exc:
        raise ApiError(f"'{field}': {exc}", param=field) from None


class ChatPrompts:
    """Renders chat requests with the model's chat template, or `chat_template` (its text) in its place."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._renders_tools: bool | None = None

    def prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The token ids of the request's rendered conversation; ApiError naming what the template refuses."""
        tokenizer = self.tokenizer
        if tokenizer is None or not (self.chat_template or getattr(tokenizer, "chat_template", None)):
            raise ApiError("this model has no chat template; use /v1/completions (or start the server with "
                           "--chat-template)", param="messages")
        conversation = body.conversation()
        kwargs = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template
        tools = body.tool_dicts()
        if tools:
            if not self.renders_tools():
                raise ApiError("this model's chat template does not render tools (it leaves out the 'tools' it is "
                               "given), so the model would never see them; start the server with --chat-template "
                               "FILE holding a template that renders tools", param="tools")
            kwargs["tools"] = tools
        try:
            return chat_prompt_ids(tokenizer, conversation, bool(body.add_generation_prompt), **kwargs)
        except Exception as exc:   # noqa: BLE001 - a template that refuses the conversation (jinja raises its own)
            raise ApiError(f"the chat template refused the messages: {exc}", param="messages") from None

    def renders_tools(self) -> bool:
        """Whether the template puts the tools it is given into the prompt (found once, with a probe tool)."""
        if self._renders_tools is None:
            kwargs = {"chat_template": self.chat_template} if self.chat_template else {}
            try:
                text = chat_prompt_text(self.tokenizer, [{"role": "user", "content": "hi"}], True,
                                        tools=[_PROBE_TOOL], **kwargs)
            except Exception:   # noqa: BLE001 - a template that fails on tools does not render them
                text = ""
            self._renders_tools = _PROBE_TOOL["function"]["name"] in text
        return self._renders_tools
