"""The OpenAI-compatible HTTP server: `ember serve`.

`protocol` holds the request models and their mapping to `SamplingParams`, `async_engine` the one adapter between
the engine's step loop (in its own thread) and asyncio, `metrics` the Prometheus collectors, `app` the routes and
`server` the uvicorn process with its signal handling. The server's dependencies are optional (`pip install
ember[serve]`), so nothing here is imported by `import ember`.
"""
