"""Online mode: continuous batching over the compiled loop (`Engine`), and what serves it."""

from specjax.serve.engine import Engine, Request, Update

__all__ = ["Engine", "Request", "Update"]
