"""The gRPC trailing metadata a node ends a failed call with, for the router to read
(``docs/pd.md``, ``docs/migration.md``; ``proto/tierserve.proto`` says which call sends which). Each
key's value is "1" or "0". Nodes and router both take the names from here, so a node never imports
the router."""

from __future__ import annotations

from collections.abc import Iterable

WRITER_STOPPED = "tierserve-writer-stopped"  # a failed Prefill's word on its in-flight batches
DESTINATION_FAILED = "tierserve-destination-failed"  # a failed Prefill's word that D, not P, failed it
DRAINING = "tierserve-draining"  # a Generate's word that D ends it because D drains (router/migration.py)


def flag(key: str, on: bool) -> tuple[str, str]:
    """One trailer, as ``trailing_metadata`` takes it."""
    return key, "1" if on else "0"


def says(metadata: Iterable[tuple[str, str]] | None, key: str) -> bool:
    """Whether a call's trailing ``metadata`` (None: it had none) sets ``key`` to "1"."""
    return any(k == key and value == "1" for k, value in metadata or ())
