"""tierserve: LLM serving with prefill-decode disaggregation and a three-tier KV cache."""

__version__ = "0.1.0"
