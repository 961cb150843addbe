"""kvroute: a KV-cache-aware request router for LLM serving, on trio.

Lower modules (types, transport, wire, keys, config, targets) form the shared
vocabulary; ``actors`` builds on them; the upper modules (supervisor, api, cli,
sidecar, ...) wire the actors together. Nothing is imported eagerly here so
the layering stays one-way.
"""

__version__ = "0.1.0"
