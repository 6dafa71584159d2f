"""Shared fixtures: tiny models per family, the built-in model, a mooncake_master per test (and one
per module, with a client of its L3), the clients a test closes before its master stops, and the
answers of an engine without a cache."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process: `make test` runs three workers on two cores, each starting nodes of
# their own, so the cores are always oversubscribed, and torch's OpenMP threads then spin at every
# parallel region waiting for a sibling that is not running (a 135M model's 16 tokens took 20 s of
# CPU instead of 2). Set before torch is imported; node processes the tests start inherit it
# (multi-rank nodes already give each rank cores // ranks threads, 1 here).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers.mooncake_engines import PARAMS, plain_engine
from helpers.processes import MasterProcess, master_running, store_client
from helpers.tiny_models import FAMILIES, add_word_tokenizer, make_tiny_model

from tierserve.cache.storage.mooncake import MooncakeStorage

# `make test` runs the files on three workers (pytest-xdist, a whole file each), longest first, so that no
# long file starts last and runs alone while the other workers idle. By time taken in a full run
# (pytest --durations=0, summed per file; those under ~40 s keep collection order after these).
LONGEST_FIRST = (
    "test_rank_hicache", "test_pd_ranks", "test_pp_serve", "test_cp_long", "test_router", "test_cp_pd",
    "test_agents_e2e", "test_tp_serve", "test_lm_eval", "test_router_streams", "test_routers", "test_observability",
    "test_cp_serve", "test_up_ranks", "test_speculative_sampling", "test_cp_split",
    "test_server", "test_cp_pp_pd_faults", "test_rank_agreement", "test_pp_l3_agreement", "test_tp_pd_faults",
    "test_handoff_integrity", "test_tp_faults",
    "test_speculative", "test_speculative_pd", "test_speculative_ranks", "test_migration", "test_speculative_migration",
    "test_pd_ranks_l3", "test_priority_router",
    "test_offload", "test_pd_faults",
    "test_node_auth", "test_deploy", "test_speculative_cache", "test_engine_machine", "test_up", "test_tenants",
    "test_structured", "test_router_faults", "test_restore_overlap", "test_cp_gather_overlap", "test_model_hf",
    "test_api_logprobs", "test_up_supervise", "test_speculative_builtin", "test_builtin_model",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Orders the longest files first (a stable sort: the rest keep their order, every worker alike)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model(request, tmp_path_factory) -> Path:
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def builtin_model() -> Path:
    from tierserve.model.fetch import fetch_builtin_model

    return fetch_builtin_model(progress=False)


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory) -> Path:
    """A tiny llama with a 2048-token context, for prompts longer than several prefill chunks."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("long_llama"), max_position=2048)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    """A real ``mooncake_master`` per test: segments of a node stopped by another test must not
    receive objects."""
    master = MasterProcess(tmp_path / "master.log").start()
    yield master
    master.kill()


@pytest.fixture(scope="module")
def module_master(tmp_path_factory) -> Iterator[MasterProcess]:
    """One ``mooncake_master`` for a whole module, whose node processes are module fixtures too."""
    with master_running(tmp_path_factory.mktemp("master") / "master.log") as master:
        yield master


@pytest.fixture(scope="module")
def l3_store(module_master: MasterProcess) -> Iterator[MooncakeStorage]:
    """A client of the module's L3 that lends it no memory (it only asks what is there)."""
    with store_client(module_master) as client:
        yield client


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MasterProcess]:
    """A fresh master per test (it starts in ~0.1 s); stopped at teardown, after the clients the
    test opened through ``closing`` (closing a client while its master is down takes ~11 s)."""
    master = MasterProcess(tmp_path / "mooncake_master.log")
    assert Path(master.binary).exists(), "mooncake_master not found: run make setup (it installs the Mooncake wheel)"
    master.start()
    yield master
    master.kill()


@pytest.fixture
def closing(mooncake_master: MasterProcess) -> Iterator[Callable[[Any], Any]]:
    """Registers things with a ``close()`` to close at teardown, before the master stops."""
    opened: list[Any] = []
    yield lambda thing: opened.append(thing) or thing
    for thing in reversed(opened):
        thing.close()


@pytest.fixture(scope="module")
def plain(long_llama: Path) -> Callable[[list[int]], list[int]]:
    """Outputs of an engine of ``long_llama`` without any prefix cache (``mooncake_engines.PARAMS``):
    what every cached run must reproduce."""
    engine = plain_engine(long_llama)
    return lambda prompt: engine.generate([prompt], PARAMS)[0]


@pytest.fixture(scope="session")
def ranks_llama(tmp_path_factory) -> Path:
    """A tiny Llama that splits over ranks (8 heads, 4 KV heads, 2 layers: TP and CP sizes up to 4),
    2048 positions, with the word tokenizer."""
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("ranks_llama"), heads=8, kv_heads=4,
                                              max_position=2048))


@pytest.fixture(scope="session")
def ranks_llama4(tmp_path_factory) -> Path:
    """``ranks_llama`` with 4 layers (PP sizes up to 4)."""
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("ranks_llama4"), heads=8, kv_heads=4,
                                              layers=4, max_position=2048))
