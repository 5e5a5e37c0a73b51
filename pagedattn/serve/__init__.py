"""`pagedattn serve`: an OpenAI-compatible HTTP server over the engine (the `[serve]` extra).

`command` (the command line) imports nothing heavy; `app`, `async_engine` and `metrics` need
FastAPI, uvicorn and prometheus_client.
"""

MAX_WAITING = 4096
"""Default bound of the requests waiting for the running batch (`--max-waiting`); past it a request
is answered 429. Generous (vLLM has no bound): a guard against unbounded memory, not a throttle."""
