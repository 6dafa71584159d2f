"""Speculative decoding (``docs/speculative.md``): a draft proposes tokens, the target verifies
them in one forward pass.

- ``decoder.py``: the draft-and-verify step over a batch of decoding requests.
- ``spans.py``: one forward pass over free-form token spans (the draft's chain, the verification).
- ``sampling.py``: drawing draft tokens and verifying them without changing the target's distribution.
- ``draft_pools.py``: where the draft's KV lives beside the target's (packed or a sidecar pool).
"""
