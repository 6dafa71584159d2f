"""Test-only switches stay out of production config (docs/faults.md, test-only switches): a node given
one of them (``unsafe_skip_agreement``, ``fault_injection``, ``handoff_faults``) in
``--hicache-storage-backend-extra-config`` exits 2 with a message naming the key, before it loads
anything; the prefill node's handoff faults are no flag (``--fault-transfer-*`` fail argparse); the
tests reach them only through ``TIERSERVE_TEST_FAULTS`` (``helpers.injected_faults``). The admin attach's 400 is in
tests/test_admin_storage.py, the faults taking effect in tests/test_shards.py and the agreement tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.injected_faults import handoff_env, write_faults

from tierserve.cache.options import HiCacheOptions
from tierserve.cli.main import build_parser
from tierserve.cli.prefill import cmd_prefill
from tierserve.core.test_hooks import FAULTS_ENV, FaultSwitch, injected
from tierserve.transfer.faulty import NO_FAULTS, HandoffFaults, injected_handoff_faults

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


@pytest.mark.parametrize("flag", ["--fault-transfer-rate", "--fault-transfer-delay", "--fault-transfer-corrupt-rate"])
def test_the_old_handoff_fault_flags_fail_argparse(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["prefill", "--model", "/m", flag, "0.1"])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {flag} 0.1" in capsys.readouterr().err


def test_handoff_faults_come_from_the_fault_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert injected_handoff_faults() == NO_FAULTS
    monkeypatch.setenv(FAULTS_ENV, str(write_faults(tmp_path / "faults.json", {"ranks": [0]})))
    assert injected_handoff_faults() == NO_FAULTS  # only the L3 faults: no handoff faults
    monkeypatch.setenv(FAULTS_ENV, handoff_env(tmp_path / "h.json", rate=0.1, delay_s=2)[FAULTS_ENV])
    assert injected_handoff_faults() == HandoffFaults(rate=0.1, delay_s=2.0)
    write_faults(tmp_path / "h.json", handoff={"rate": 0.1, "dealy_s": 2})
    with pytest.raises(ValueError, match=r"unknown handoff fault fields \['dealy_s'\]"):
        injected_handoff_faults()


def test_a_prefill_node_with_a_bad_fault_file_exits_2_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Read at the node's start, before it loads anything (no model needed)."""
    monkeypatch.setenv(FAULTS_ENV, handoff_env(tmp_path / "faults.json", corrupt_rat=0.5)[FAULTS_ENV])
    assert cmd_prefill(build_parser().parse_args(["prefill", "--model", str(tmp_path), "--port", "0"])) == 2
    assert "unknown handoff fault fields ['corrupt_rat']" in capsys.readouterr().err
