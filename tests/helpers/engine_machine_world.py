"""The engine machine's world (``test_engine_machine``): its tiny model and drafts, the cache-less
reference engine a request run alone on gives the truth, the requests and sampling parameters it
draws, the handoff it plays for prefill requests (``Sender``), and the checks on the engine's state
it runs after every rule (page owners, salts kept apart)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import strategies as st

from helpers.tiny_models import add_word_tokenizer, make_noisy_draft, make_tiny_model, widen_kv_heads
from tierserve.cache.hicache import HiCache
from tierserve.cache.options import DraftLayout
from tierserve.cache.radix_tree import RadixTree
from tierserve.core.outputs import FinishReason
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PS = 2  # tokens per page
VOCAB = 24  # few ids: EOS (1) and stop ids come up, random prompts collide
MAX_NEW = 10
STOP_IDS = (2, 3, 5, 7)


@functools.cache
def tiny_model() -> Path:
    """One tiny Llama with a word tokenizer (stop strings need text) for every example."""
    out = Path(tempfile.mkdtemp(prefix="engine-machine-"))
    atexit.register(shutil.rmtree, out, True)
    return add_word_tokenizer(make_tiny_model("llama", out, max_position=64, vocab_size=VOCAB), VOCAB)


@functools.cache
def draft_model(layout: DraftLayout) -> Path:
    """A draft that agrees with ``tiny_model`` often but not always; for the sidecar layout its KV
    rows are shaped unlike the target's (twice the KV heads)."""
    out = Path(tempfile.mkdtemp(prefix=f"engine-machine-draft-{layout.value}-"))
    atexit.register(shutil.rmtree, out, True)
    draft = make_noisy_draft(tiny_model(), out / "draft", 0.05)
    return widen_kv_heads(draft) if layout is DraftLayout.SIDECAR else draft


@functools.cache
def reference_engine() -> Engine:
    """A cache-less engine: a request run alone on it is the truth a cached, batched run must match."""
    return Engine(EngineConfig(tiny_model(), dtype="float32", page_size=PS, max_total_tokens=256,
                               disable_radix_cache=True))


_ALONE: dict[str, tuple[list[int], FinishReason | None]] = {}


def alone(prompt: list[int], params: SamplingParams) -> tuple[list[int], FinishReason | None]:
    """``prompt`` run alone on the reference engine (remembered: the examples repeat requests)."""
    key = repr((prompt, params))
    if key not in _ALONE:
        _ALONE[key] = _run_alone(prompt, params)
    return _ALONE[key]


def _run_alone(prompt: list[int], params: SamplingParams) -> tuple[list[int], FinishReason | None]:
    engine, tokens, reason = reference_engine(), [], None
    engine.add_request("alone", list(prompt), params)
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason if out.finished else reason
    return tokens, reason


@dataclass
class Tracked:
    """A request the machine follows: what it asked for and what came out so far."""

    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: int = 0  # outputs' logprob entries
    reason: FinishReason | None = None
    checked: bool = True  # its output must equal the request run alone (not a reservation's)
    salt: str = ""  # its cache_salt: requests of different salts never share KV


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, MAX_NEW))
    mode = draw(st.sampled_from(["greedy", "seeded", "random"]))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if mode == "greedy" else 1.0,
        seed=draw(st.integers(0, 3)) if mode == "seeded" else None,
        min_tokens=draw(st.integers(0, max_tokens)),
        stop_token_ids=draw(st.lists(st.sampled_from(STOP_IDS), max_size=2, unique=True)),
        stop=draw(st.lists(st.sampled_from(["w4", "w6 w6"]), max_size=1)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 2)),
        prompt_logprobs=draw(st.none() | st.just(1)),  # forces recomputing part of a cached prompt
    )


class Sender:
    """A prefill request's handoff as the machine plays the transfer: it copies each layer's prompt
    KV out of the request's pages as the engine reports it, and stays busy (the engine parks the
    pages once the request ends) until the machine ends it; the pages must still hold that KV then.
    ``layers``: each layer's [2, slots, heads, dim] rows in the engine's numbering (a sidecar
    draft's layers follow the target's)."""

    def __init__(self, layers: list[torch.Tensor]) -> None:
        self.layers = layers
        self.sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (slots, their KV)
        self.ended = False

    def on_layer(self, layer: int, pages: list[int], end: int) -> None:
        slots = torch.tensor([pages[t // PS] * PS + t % PS for t in range(end)], dtype=torch.long)
        self.sent[layer] = slots, self.layers[layer].index_select(1, slots).clone()

    def busy(self) -> bool:
        return not self.ended

    def end(self) -> None:
        """The transfer ended: what it read must not have changed while it was busy."""
        self.ended = True
        for layer, (slots, kv) in self.sent.items():
            now = self.layers[layer].index_select(1, slots)
            assert torch.equal(now, kv), "a page changed while its handoff read it"


def assert_device_pages_owned(engine: Engine) -> None:
    """Each allocated L1 page has one owner: the tree, a live request or reservation (its own pages
    past its hit), the quarantine, a parked handoff or a failed load."""
    cache = engine.cache
    sched = engine.scheduler
    reservations = engine.reservations
    requests = [*sched.running, *sched.waiting, *(x.request for x in reservations.active.values())]
    held = [p for r in requests for p in r.pages[len(r.hit.pages):]]
    held += [p for _, pages in reservations.quarantine for p in pages]
    held += [p for x in sched.parked for p in x.pages[len(x.hit.pages):]]
    owned = cache.tree.device_pages() + held + [p for p in cache.loads._orphans if p not in held]
    assert len(owned) == len(set(owned)), "an L1 page has two owners"
    assert len(owned) == engine.allocator.num_used, \
        f"{engine.allocator.num_used - len(owned)} L1 pages are allocated but owned by nobody"
    engine.allocator.check()


def assert_host_pages_owned(cache: HiCache) -> None:
    """Each allocated L2 page has one owner: the tree, an in-flight write or a prefetch."""
    tier = cache.storage
    owned = (cache.tree.host_pages() + [p for w in cache._writes for p in w.host_pages]
             + [p for t in tier.tickets for p in (t.leftover if t.consumed else t.host_pages)])
    assert len(owned) == len(set(owned)), "an L2 page has two owners"
    assert len(owned) == cache.host.allocator.num_used, \
        f"{cache.host.allocator.num_used - len(owned)} L2 pages are allocated but owned by nobody"
    cache.host.allocator.check()


def assert_paths_computed(tree: RadixTree, streams: dict[str, list[Tracked]]) -> None:
    """Every path the tree caches under a salt's root is a prefix of what a request of that salt
    computed (its prompt, then its tokens so far): requests of different salts never share KV."""
    allowed = {salt: {tuple(seq[:n]) for t in tracked for seq in [t.prompt + t.tokens]
                      for n in range(PS, len(seq) + 1, PS)} for salt, tracked in streams.items()}
    for salt, root in tree.roots.items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + tuple(node.tokens)
            assert path in allowed.get(salt, set()), f"the tree holds a prefix no request of salt {salt!r} computed"
            stack += [(child, path) for child in node.children.values()]
