"""A node's rank processes and how they stay in step (``docs/ranks.md``).

- ``ranks.py``: one rank's place (process groups, device, TP shard, PP stage, CP rank).
- ``spawn.py``: rank 0 starts ranks 1..N-1 and takes the node down when one dies.
- ``worker.py``: the loop of ranks 1..N-1, applying what rank 0 broadcasts.
- ``step_bus.py``: rank 0's commands and step decisions, broadcast every loop turn.
- ``token_share.py``: one rank samples; every rank appends the same tokens.
"""
