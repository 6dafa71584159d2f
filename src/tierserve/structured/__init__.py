"""Structured outputs with llguidance: constraints compiled to grammars and each request's matcher
(docs/structured.md). Torch-free: the API checks requests with it, the engine masks logits with it."""
