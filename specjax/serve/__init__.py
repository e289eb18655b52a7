"""Online mode: continuous batching over the compiled loop (`Engine`), and the OpenAI-compatible
server over it (`specjax serve MODEL`).

    specjax.serve.Engine(model, proposer, EngineConfig(...))           continuous batching
    specjax.serve.serve(model_or_path, speculative_config=None, ...)   run the server (blocks)
    specjax.serve.make_app(engine, ...)                                the FastAPI app over an Engine
    specjax.serve.speculative_config_to_proposer(config, target)       vLLM's --speculative-config

The HTTP layer (app.py, protocol.py, scheduler.py, metrics.py) needs the `serve` extra (FastAPI,
uvicorn, prometheus-client); it is imported on first use, so the engine and the config mapping
load without it.
"""

from specjax.serve.config import speculative_config_to_proposer
from specjax.serve.engine import Engine
from specjax.serve.engine_config import EngineConfig, Request, Update


def __getattr__(name: str):
    if name in ("serve", "make_app"):
        from specjax.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'specjax.serve' has no attribute {name!r}")


__all__ = [
    "Engine",
    "EngineConfig",
    "Request",
    "Update",
    "make_app",
    "serve",
    "speculative_config_to_proposer",
]
