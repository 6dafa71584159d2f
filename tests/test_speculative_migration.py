"""Speculative decoding survives a migration (issue 32 item 3, docs/migration.md): a draft whose
KV rows need the sidecar layout (its own pool, its own L3 objects), or one packed into the target's pages,
on a prefill node of one rank and two decode nodes: a STANDALONE draft of either layout on decode nodes of
one rank, and an EAGLE-1 or an EAGLE-3 head (its rows and the
target's hidden states it reads: EAGLE-3's the three residual streams it captures, a feature plane three
times as wide) on decode nodes of two tensor ranks (each holding and backing up the replicated head's
rows, which the prefill node reads whole: L3 across TP sizes). Greedy streams lose
their decode node (SIGKILL) mid-stream and continue on the spare, re-prefilled from L3, where the
victim's continuous offload put the target's and the draft's pages as they filled. Checked by effect,
per stream: the tokens equal decoding without speculation; the accepted drafts reported for the whole
request equal those of one uninterrupted engine up to the seam plus those of a cold engine continuing
from the seam, so the draft state the spare got from L3 and the handoff is the one a cold engine
computes; no prompt position's draft KV was computed after its target KV
(``spec_prompt_catch_up_tokens`` 0 on every node); and the usage adds the tries' counts up
(``test_migration_progress.py`` has the unit test)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.migration_streams import ARGS, PAGE, Stream, l3_args, model_with_words, prompts, start_all, wait_streaming
from helpers.pd_nodes import node_metric
from helpers.processes import MasterProcess, NodeProcess, RouterProcess, free_port
from helpers.tiny_models import (
    add_word_tokenizer,
    make_eagle_target,
    make_mimic_eagle,
    make_mimic_eagle3,
    make_noisy_draft,
    widen_kv_heads,
)

from tierserve.cache.options import DraftLayout
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ADMIN = {"Authorization": "Bearer k"}
STREAMS, PROMPT, MAX_NEW, CUT = 4, 40, 300, 40  # CUT: tokens every stream got before the fault
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """By setup kind, the target and its draft: the word-tokenizer llama with a draft agreeing with it
    often, its KV heads doubled (sidecar), or as they are (packed: its rows in the target's pages, so
    its L3 objects too); the EAGLE target with a head that mimics its layer, and the EAGLE-3 target with
    a head that mimics its first layer."""
    root = tmp_path_factory.mktemp("spec-migration")
    target = model_with_words(root / "target")
    eagle = add_word_tokenizer(make_eagle_target(root / "eagle", layers=1), byte_level=True)
    eagle3 = add_word_tokenizer(make_eagle_target(root / "eagle3", layers=2, embed_rms=0.01), byte_level=True)
    return {"standalone": (target, widen_kv_heads(make_noisy_draft(target, root / "draft", 0.03))),
            "packed": (target, make_noisy_draft(target, root / "packed", 0.03)),
            "eagle": (eagle, make_mimic_eagle(eagle, root / "head", 0.1)),
            "eagle3": (eagle3, make_mimic_eagle3(eagle3, root / "head3", 0.1, embed_feature=0.3))}


# the algorithm and the decode nodes' flags (EAGLE-3 is the EAGLE algorithm: its head's tensors say which);
# EAGLE's sidecar on every node (its ``auto`` would pack it on the prefill node of one rank: another KV namespace)
SETUPS = {"standalone-decode-tp1": ("standalone", ()),
          "standalone-packed-decode-tp1": ("packed", ()),
          "eagle-decode-tp2": ("eagle", ("--tp-size", "2")),
          "eagle3-decode-tp2": ("eagle3", ("--tp-size", "2"))}
SPEC_FLAGS = {"standalone": (), "packed": ("--speculative-draft-layout", "packed"),
              "eagle": ("--speculative-algorithm", "EAGLE", "--speculative-draft-layout", "sidecar"),
              "eagle3": ("--speculative-algorithm", "EAGLE", "--speculative-draft-layout", "sidecar")}


@pytest.fixture(scope="module", params=list(SETUPS))
def cluster(request, models, tmp_path_factory) -> Iterator[tuple[str, RouterProcess, list[NodeProcess]]]:
    """Master, prefill node (the only L3 segment), victim and spare decode nodes (store clients
    only: what they back up outlives them), all with the draft; a router that knows the victim. The
    decode nodes take the setup's flags (their TP size)."""
    algorithm, sizes = SETUPS[request.param]
    target, draft = models[algorithm]
    logs = tmp_path_factory.mktemp("logs")
    master = MasterProcess(logs / "master.log").start()

    def node(role: str, name: str, segment: int) -> NodeProcess:
        flags = [*SPEC_FLAGS[algorithm], *(sizes if role == "decode" else ())]
        return NodeProcess(role, ["--model", str(target), *ARGS, "--speculative-draft-model-path", str(draft), *flags,
                                  "--metrics-port", str(free_port()), *l3_args(master.address, segment)],
                           logs / f"{name}.log")

    prefill = node("prefill", "prefill", 256 << 20)
    victim, spare = node("decode", "victim", 0), node("decode", "spare", 0)
    nodes, router = [prefill, victim, spare], None
    try:
        for n in nodes:
            n.wait_ready()
        router = RouterProcess(["--model", str(target), "--prefill", prefill.address, "--decode", victim.address,
                                "--admin-api-key", "k", "--health-check-interval", "0.5"],
                               logs / "router.log").wait_ready()
        yield algorithm, router, nodes
    finally:
        for proc in (router, *nodes):
            if proc is not None:
                proc.stop()
        master.kill()


def engine(target: Path, draft: Path | None, algorithm: str = "standalone") -> Engine:
    eagle = {"speculative_algorithm": SpeculativeAlgorithm.EAGLE, "speculative_draft_layout": DraftLayout.SIDECAR} \
        if algorithm.startswith("eagle") and draft is not None else {}
    return Engine(EngineConfig(target, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=16384,
                               disable_radix_cache=True, speculative_draft_model_path=draft, **eagle))


def accepted_by_length(target: Path, draft: Path, algorithm: str, prompt: list[int], max_tokens: int
                       ) -> dict[int, int]:
    """One cold engine's run of ``prompt``: drafts accepted so far, by tokens produced so far, after
    each of its steps (a stream's seam falls between two steps: the router forwards whole steps)."""
    eng, seen, count = engine(target, draft, algorithm), {}, 0
    eng.add_request("0", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while eng.has_work():
        for out in eng.step():
            count += len(out.new_token_ids)
            seen[count] = out.spec_accepted_tokens
    return seen


def test_speculation_continues_after_a_sigkill_migration_with_the_draft_state_from_l3(models, cluster) -> None:
    algorithm, router, (prefill, victim, spare) = cluster
    target, draft = models[algorithm]
    batch = prompts(STREAMS, PROMPT, seed=7)
    usage = {"stream_options": {"include_usage": True}}
    streams = [Stream({"prompt": p, "max_tokens": MAX_NEW, "ignore_eos": True, "stream": True, "temperature": 0,
                       **usage}) for p in batch]
    threads = start_all(router.url, streams)
    wait_streaming(streams, CUT)
    added = httpx.post(f"{router.url}/workers", json={"role": "decode", "address": spare.address}, headers=ADMIN)
    assert added.status_code == 201, added.text
    victim.signal(signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert all(s.status == 200 and not s.errors and s.finish_reason == "length" for s in streams), \
        [(s.status, s.errors, s.finish_reason) for s in streams]
    assert [s.tokens for s in streams] == engine(target, None).generate(batch, GREEDY)
    seams = {m["request"]: m for m in httpx.get(f"{router.url}/debug/state", headers=ADMIN).json()["recent_migrations"]}
    assert len(seams) == STREAMS, seams  # every stream was still running on the victim when it died
    for stream, prompt in zip(streams, batch, strict=True):
        found = [m for rid, m in seams.items() if rid.startswith(stream.id)]
        assert len(found) == 1, (stream.id, list(seams))
        seam = found[0]
        cut = seam["generated"]
        assert CUT <= cut < MAX_NEW, seam
        before = accepted_by_length(target, draft, algorithm, prompt, MAX_NEW)
        assert cut in before, f"the seam ({cut} tokens) is not between two steps of one engine's run: {before}"
        after = accepted_by_length(target, draft, algorithm, prompt + stream.tokens[:cut], MAX_NEW - cut)[MAX_NEW - cut]
        assert stream.usage["speculative"]["accepted_tokens"] == before[cut] + after, (before, after, stream.usage)
    assert sum(s.usage["speculative"]["accepted_tokens"] for s in streams) > 0
    assert sum(m["cached_by_tier"].get("storage", 0) for m in seams.values()) > 0, seams  # re-prefills read L3
    for node in (prefill, spare):
        assert node_metric(node, "tierserve_spec_prompt_catch_up_tokens_total") == 0
