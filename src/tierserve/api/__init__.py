"""The OpenAI-compatible HTTP layer shared by `tierserve serve` and the router (torch-free)."""
