"""A live `ember serve` app on a free local port, in a thread of the test process, with its engine core in a
process of its own: started from an `LLM`'s setup, or a running `MPClient` shared by several servers (starting a
core process costs seconds on a small CPU)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass


@dataclass
class LiveServer:
    """A running server: its base URL, the uvicorn server, the app and the engine front."""
    url: str
    server: object
    app: object
    thread: object

    @property
    def front(self):
        return self.app.state.ember.front

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, **kwargs)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the front holds no request and the engine has published its load after the last one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = self.front.load
            if self.front.num_unfinished == 0 and load.num_running == 0 and load.num_waiting == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"server still busy after {timeout} s: {self.front.num_unfinished} unfinished, "
                             f"load {self.front.load}")


def start_core(llm, num_replicas: int = 1):
    """An `MPClient` running `llm`'s model (its config, weights and tokenizer's EOS) in processes of its own."""
    from ember.engine.core_client import MPClient
    setup = llm.setup
    return MPClient(setup.config, setup.model_path, setup.hf_config, setup.load_format,
                    setup.tokenizer, num_replicas)


@contextlib.contextmanager
def live_server(llm, model_name: str = "test-model", max_waiting: int = 512, drain_timeout: float = 5.0,
                core=None, **app_kwargs):
    """Serve `llm`'s model on 127.0.0.1 at a free port until the block exits, then stop the server. The engine
    core is `core` (a running `MPClient`, left running) or one started here and stopped with the server.
    `app_kwargs` go to `build_app` (tool_call_parser, chat_template)."""
    from ember.serve.app import build_app
    from ember.serve.server import bound_port, make_server, start_in_thread
    owns = core is None
    client = start_core(llm) if owns else core
    app = build_app(client, llm.setup, model_name, max_waiting=max_waiting, owns_client=owns, **app_kwargs)
    server = make_server(app, "127.0.0.1", 0, drain_timeout)
    try:
        thread = start_in_thread(server)
    except BaseException:
        if owns:
            client.shutdown()
        raise
    try:
        yield LiveServer(f"http://127.0.0.1:{bound_port(server)}", server, app, thread)
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive(), "the server did not stop"
        assert not app.state.ember.front.alive, "the engine front did not stop"
