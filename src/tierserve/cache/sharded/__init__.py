"""The cache of a node that spans several ranks (``docs/ranks.md``): who stores which page, head
and layer, and the one point where the ranks agree.

- ``shards.py``: which KV heads and layers of every page a rank holds (TP, PP), and its L3 object names.
- ``shard_io.py``: one rank's L3 reads and writes, across the TP and PP sizes that wrote the objects.
- ``cp_pages.py``: context parallelism's page ownership (owner ``page % size``), its allocator.
- ``cp_host.py``: the host tier and L3 under CP: every copy of a page runs on its owner rank.
- ``agreement.py``: background work that finishes at different times on different ranks is applied
  on the value the ranks agree on.
"""
