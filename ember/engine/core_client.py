"""One interface to an engine core, wherever it runs: `InprocClient` is the core in this process (each call is the
core's own, with no copy and no message).

A front end adds requests as `EngineCoreRequest`s, aborts them, finishes those whose stop string matched, and
reads `EngineCoreOutputs` with `get_output()`, which in-process runs one step."""

from __future__ import annotations

from ember.config import EngineConfig
from ember.engine.core_io import CoreInfo, EngineCoreOutputs, EngineCoreRequest, PromptLogprobData


class InprocClient:
    """The engine core in this process, driven by the caller: `get_output()` is one `EngineCore.step()`."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto",
                 tokenizer=None):
        from ember.engine.core import EngineCore
        self.core = EngineCore(config, model_path, hf_config, load_format, tokenizer)
        self.info: CoreInfo = self.core.info()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request in the core (ValueError if its id is in use)."""
        self.core.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self.core.abort_requests(request_ids)

    def finish_requests(self, request_ids) -> None:
        """Finish requests whose stop string matched."""
        self.core.finish_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """Run one step and return what it produced."""
        return self.core.step()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobData:
        return self.core.prompt_logprobs(token_ids, k)

    def shutdown(self) -> None:
        self.core.shutdown()
