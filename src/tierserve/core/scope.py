"""A request's cache namespace (``docs/tenancy.md``): the tenant the server named from the API key
and the client's ``cache_salt`` within it, as one value. Built once where a request enters (the
API, a node service reading its gRPC request), carried to the cache, and folded there into the
salt its page keys chain from (``CacheScope.salt``). The wire formats keep the two fields apart."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol


class Scoped(Protocol):
    """A message naming a scope, as the node protos' requests do (``tenant`` and ``cache_salt``)."""

    tenant: str
    cache_salt: str


@dataclass(frozen=True)
class CacheScope:
    """``tenant``: named by the server from the API key, never by the client ("": a server without
    keys); ``cache_salt``: the client's, subdividing its tenant's namespace. Requests of different
    scopes never share cached KV, in any tier."""

    tenant: str = ""
    cache_salt: str = ""

    @classmethod
    def of(cls, message: Scoped) -> CacheScope:
        return cls(message.tenant, message.cache_salt)

    @property
    def salt(self) -> str:
        """The salt of the scope's pages (``cache/hashing.py``, ``salted_seed``): the tenant's
        subdivided by the client's. Injective, so no ``cache_salt`` of one tenant names another
        tenant's pages; without a tenant the client's salt is the whole salt, as before tenants
        existed. Page keys, L3 objects' included, derive from it: it must never change."""
        return self.cache_salt if not self.tenant else json.dumps(["tenant", self.tenant, self.cache_salt])


NO_SCOPE = CacheScope()  # a request without tenant or salt: the namespace's own pages
