"""`pagedattn serve`: an OpenAI-compatible HTTP server over the engine (the `[serve]` extra).

`command` (the command line) imports nothing heavy; `app`, `async_engine` and `metrics` need
FastAPI, uvicorn and prometheus_client.
"""
