"""The library's version, in a module of its own so that any layer can read it without importing
the top-level package (which imports every layer)."""

__version__ = "0.1.0"
