"""The tests' ``tierserve`` processes, forked from a forkserver that has imported torch
(``tests/helpers/forked.py``), start as fresh processes would, down to the compute threads their own
environment asks for: the forkserver's torch read ``OMP_NUM_THREADS`` once, from the first process's
environment, and a benchmark's CP=1 node of two threads started after a one-thread node computed with one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.pd_nodes import NODE_ARGS
from helpers.processes import NodeProcess

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("threads", [2, 1])
def test_a_forked_node_computes_with_the_threads_its_environment_asks_for(tiny_llama: Path, tmp_path: Path,
                                                                           threads: int) -> None:
    # conftest set OMP_NUM_THREADS=1 before this worker's forkserver started: 2 is the case that failed
    log = tmp_path / "prefill.log"
    node = NodeProcess("prefill", ["--model", str(tiny_llama), *NODE_ARGS], log, env={"OMP_NUM_THREADS": str(threads)})
    try:
        node.wait_ready()
        assert re.findall(r"engine ready: .* threads=(\d+)", log.read_text()) == [str(threads)]
    finally:
        node.stop()
