"""A live `ember serve` app on a free local port, in a thread of the test process, around an already loaded LLM."""

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


@contextlib.contextmanager
def live_server(llm, model_name: str = "test-model", max_waiting: int = 512, drain_timeout: float = 5.0,
                **app_kwargs):
    """Serve `llm` on 127.0.0.1 at a free port until the block exits, then stop the server and its engine thread.
    `app_kwargs` go to `build_app` (tool_call_parser, chat_template)."""
    from ember.serve.app import build_app
    from ember.serve.server import bound_port, make_server, start_in_thread
    app = build_app(llm, model_name, max_waiting=max_waiting, **app_kwargs)
    server = make_server(app, "127.0.0.1", 0, drain_timeout)
    thread = start_in_thread(server)
    try:
        yield LiveServer(f"http://127.0.0.1:{bound_port(server)}", server, app, thread)
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive(), "the server did not stop"
        assert not app.state.ember.front.alive, "the engine thread did not stop"
