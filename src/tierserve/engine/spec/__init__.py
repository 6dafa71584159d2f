"""Speculative decoding (``docs/speculative.md``): a draft source proposes tokens, the target verifies
them in one forward pass.

- ``decoder.py``: the draft-and-verify step over a batch of decoding requests.
- ``drafts.py``: what the step asks of a draft source (``Drafter``), its proposals and counters.
- ``standalone.py``: STANDALONE, a draft model's chain over its own KV.
- ``ngram.py``: NGRAM, prompt lookup in the request's own tokens (bounded per request).
- ``spans.py``: one forward pass over free-form token spans (the draft's chain, the verification).
- ``sampling.py``: drawing draft tokens and verifying them without changing the target's distribution.
- ``draft_pools.py``: where the draft's KV lives beside the target's (packed or a sidecar pool).
"""
