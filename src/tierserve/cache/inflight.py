"""In-flight sharing (docs/cache.md, in-flight sharing): a running request's computed full prompt
pages join the tree at the step that computed them, pinned by the request, so a request matched
later hits them while the first one still prefills (or decodes). Its page table never changes: the
tree takes the request's own pages, and where the tree already holds another copy of them (two
requests computed the same prefix at once) nothing is shared now; those pages join at release, as
before. So no page a handoff or a step may still read is ever freed or swapped here."""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.cache.base import PrefixHit
from tierserve.cache.loads import Loads
from tierserve.cache.radix_tree import RadixTree, path_pages


def share(tree: RadixTree, token_ids: Sequence[int], pages: list[int], num_full: int, hit: PrefixHit,
          loads: Loads | None = None) -> PrefixHit | None:
    """Puts ``pages[:num_full]`` (the KV of the first ``num_full`` full pages of ``token_ids``) in the
    tree and returns the pinned hit that replaces ``hit`` (unpinned here), whose pages are
    ``pages[:num_full]``; None when nothing changed: no new page, a load under the hit not yet
    agreed landed, or another copy of these tokens already on the device. Under CP the caller
    passes only the pages that keep the path's rotation (``cp_storable``)."""
    ps = tree.page_size
    if loads is not None:
        num_full = min(num_full, loads.usable(pages))
        if not all(load.landed for load in hit.loads) or tree.loading_under(token_ids[: num_full * ps], hit.salt):
            return None  # a failed load would drop the nodes under it: wait until it is agreed landed
    if num_full <= len(hit.pages) or _on_device(tree, token_ids[: num_full * ps], hit.salt) != len(hit.pages):
        return None
    unused, node = tree.insert(token_ids[: num_full * ps], pages[:num_full], hit.salt)
    if unused:
        raise RuntimeError("radix tree: in-flight sharing found another copy of pages it checked were new")
    tree.lock(node)
    if hit.handle is not None:
        tree.unlock(hit.handle)
    lent = PrefixHit(num_full * ps, path_pages(node), dict(hit.by_tier), handle=node, salt=hit.salt)
    if loads is not None:
        loads.returned(hit)
        loads.lent(lent)
    return lent


def _on_device(tree: RadixTree, token_ids: Sequence[int], salt: str) -> int:
    """How many leading pages of ``token_ids`` the tree holds on the device (a device node's parent
    is on the device too, so they come first)."""
    return tree.copies_along(token_ids, salt)[1]
