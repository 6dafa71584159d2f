"""Test-only switches stay out of production config (docs/faults.md, test-only switches): a node given
``unsafe_skip_agreement`` or ``fault_injection`` in ``--hicache-storage-backend-extra-config`` exits 2
with a message naming the key, before it loads anything; the tests reach them only through
``TIERSERVE_TEST_FAULTS`` (``helpers.injected_faults``). The admin attach's 400 is in
tests/test_admin_storage.py, the faults taking effect in tests/test_shards.py and the agreement tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.injected_faults import write_faults

from tierserve.cache.options import HiCacheOptions
from tierserve.core.test_hooks import FAULTS_ENV, FaultSwitch, injected

SWITCHES = [s.value for s in FaultSwitch]


@pytest.mark.parametrize("key", SWITCHES)
def test_hicache_options_refuse_a_test_only_key(key: str) -> None:
    with pytest.raises(ValueError, match=f"'{key}' is a test-only switch"):
        HiCacheOptions(storage_backend="file", storage_config={"path": "/tmp/l3", key: True})


def test_the_switches_come_from_the_tests_fault_file_read_at_each_call(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert injected(FaultSwitch.SKIP_AGREEMENT) is None
    path = write_faults(tmp_path / "faults.json", {"ranks": [1], "exists_cap": 2})
    monkeypatch.setenv(FAULTS_ENV, str(path))
    assert injected(FaultSwitch.STORAGE_FAULTS) == {"ranks": [1], "exists_cap": 2}
    assert injected(FaultSwitch.SKIP_AGREEMENT) is False
    write_faults(path, skip_agreement=True)
    assert injected(FaultSwitch.SKIP_AGREEMENT) is True and injected(FaultSwitch.STORAGE_FAULTS) is None


@pytest.mark.integration
@pytest.mark.parametrize(("command", "key"), [("serve", k) for k in SWITCHES] + [("up", "fault_injection")])
def test_a_node_given_a_test_only_key_exits_2_naming_it(tmp_path: Path, command: str, key: str) -> None:
    """The refusal comes from the flags alone: the folder only needs to look like a model's."""
    (tmp_path / "config.json").write_text("{}")
    extra = json.dumps({"path": str(tmp_path / "l3"), key: {"ranks": [0], "unreachable": True}})
    cmd = [sys.executable, "-m", "tierserve.cli", command, "--model", str(tmp_path), "--port", "0",
           "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
           "--hicache-storage-backend-extra-config", extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"'{key}' is a test-only switch, refused in a node's L3 extra config" in done.stderr, done.stderr
