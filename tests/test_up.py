"""``tierserve up`` starts the whole cluster (L3 master, prefill, decode, router) on the built-in
model, answers a chat request through it, shows role-prefixed logs, and stops everything on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.processes import free_port, running_up, start_up

from tierserve import launch
from tierserve.cli import up as cli_up
from tierserve.cli.flags import engine_config, engine_flags
from tierserve.cli.main import build_parser
from tierserve.launch import ClusterPlan
from tierserve.launch.plan import stages

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_serves_chat_and_stops_cleanly_on_ctrl_c() -> None:
    port = free_port()
    proc, lines = start_up(port, "--max-total-tokens", "2048")
    try:
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
                "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        text = "".join(lines)
        assert "curl http://127.0.0.1:" in text
        for role in ("[prefill-0]", "[decode-0]", "[router]"):
            assert role in text, role
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_prompt_sent_twice_is_served_from_storage_by_the_other_prefill_node_with_the_defaults() -> None:
    """Round robin sends the second copy to the node that never saw it: with the default prefetch
    policy it waits for L3, so most of the prompt comes from storage instead of being recomputed
    (with best_effort, the old default, an idle node took none of it from storage)."""
    port = free_port()
    prompt = [1000 + (i * 37) % 40000 for i in range(2000)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    with running_up(port, "--prefill-nodes", "2", "--prefill-policy", "round_robin", "--max-total-tokens",
                    "8192") as lines:
        usages = [httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300).json()["usage"]
                  for _ in range(2)]
        state = httpx.get(f"http://127.0.0.1:{port}/debug/state", timeout=10).json()
    routes = [r["prefill"] for r in state["routes"]][-2:]
    assert len(set(routes)) == 2, f"both copies went to {routes}"
    assert usages[0]["cached_tokens_by_tier"]["storage"] == 0
    assert usages[1]["cached_tokens_by_tier"]["storage"] >= 0.8 * len(prompt), (usages, "".join(lines[-30:]))


def test_up_on_a_taken_port_stops_at_once_starting_nothing() -> None:
    """A second ``tierserve up`` on the same port started a whole cluster, then stopped it when its
    router could not bind (exit 1 after the nodes had loaded); it now says so before starting any."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        cmd = [sys.executable, "-m", "tierserve.cli", "up", "--port", str(port), "--device", "cpu"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
    assert "mooncake-master" not in out.stdout + out.stderr, "a child was started"


def test_engine_flags_are_forwarded_to_every_node() -> None:
    args = build_parser().parse_args(["up", "--page-size", "32", "--enable-hierarchical-cache",
                                      "--hicache-mem-layout", "page_first", "--max-total-tokens", "2048"])
    flags = engine_flags(engine_config(args, Path("/m")))
    assert flags == ["--page-size", "32", "--max-total-tokens", "2048", "--enable-hierarchical-cache",
                     "--hicache-mem-layout", "page_first"]
    assert build_parser().parse_args(["prefill", *flags]).page_size == 32  # the nodes accept them


def test_the_users_l3_extra_config_reaches_the_nodes_with_the_masters_address(monkeypatch) -> None:
    """``up`` merges ``--hicache-storage-backend-extra-config`` (prefetch settings) into the
    Mooncake config it gives the nodes, instead of the nodes getting two and keeping the last."""
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    args = build_parser().parse_args(["up", "--model", str(Path(__file__)), "--hicache-storage-backend-extra-config",
                                      '{"prefetch_threshold": 16}'])
    monkeypatch.setattr(cli_up, "model_dir", lambda _: Path("/m"))
    assert cli_up.cmd_up(args) == 0
    plan = plans[0]
    assert "--hicache-storage-backend-extra-config" not in plan.node_flags
    node = build_parser().parse_args(["prefill", *plan.node_flags, *launch.l3_flags(plan, 5555)])
    assert node.hicache_storage_backend_extra_config == {"prefetch_threshold": 16,
                                                         "master_server_address": "127.0.0.1:5555",
                                                         "global_segment_size": plan.l3_segment_bytes}


def test_up_gives_each_node_a_share_of_the_l3_size_and_the_users_segment_size_wins(monkeypatch) -> None:
    """The default Mooncake segment (256 MiB) evicted a conversation trace's prefixes before their
    follow-ups came; ``up`` splits ``--l3-size-gb`` (default: a third of memory) between the nodes."""
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    monkeypatch.setattr(cli_up, "model_dir", lambda _: Path("/m"))
    base = ["up", "--model", "m", "--prefill-nodes", "2", "--decode-nodes", "2"]
    assert cli_up.cmd_up(build_parser().parse_args([*base, "--l3-size-gb", "8"])) == 0
    node = build_parser().parse_args(["prefill", *launch.l3_flags(plans[-1], 5555)])
    assert node.hicache_storage_backend_extra_config["global_segment_size"] == 2_000_000_000
    assert cli_up.cmd_up(build_parser().parse_args(base)) == 0
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert plans[-1].l3_segment_bytes == memory // 3 // 4
    own = '{"global_segment_size": 1048576}'
    assert cli_up.cmd_up(build_parser().parse_args([*base, "--hicache-storage-backend-extra-config", own])) == 0
    node = build_parser().parse_args(["prefill", *launch.l3_flags(plans[-1], 5555)])
    assert node.hicache_storage_backend_extra_config["global_segment_size"] == 1048576


def test_nodes_of_two_tp_sizes_write_the_l3_objects_of_both(monkeypatch) -> None:
    """``--prefill-tp-size 2 --decode-tp-size 1``: every node also writes the other size's objects,
    so a TP=2 rank reads what a TP=1 node wrote zero-copy (``l3_tp_sizes``); one size: nothing extra."""
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    monkeypatch.setattr(cli_up, "model_dir", lambda _: Path("/m"))
    monkeypatch.setattr("tierserve.model.parallel.misfit", lambda *_: None)  # no model at /m
    extra = ["--hicache-storage-backend-extra-config"]
    for args, sizes in ((["--prefill-tp-size", "2"], [1, 2]), ([], None),
                        (["--decode-tp-size", "4", *extra, '{"l3_tp_sizes": [4]}'], [4])):
        assert cli_up.cmd_up(build_parser().parse_args(["up", "--model", "m", *args])) == 0
        node = build_parser().parse_args(["prefill", *launch.l3_flags(plans[-1], 5555)])
        assert node.hicache_storage_backend_extra_config.get("l3_tp_sizes") == sizes


def test_restart_and_state_file_flags_reach_the_plan(monkeypatch, capsys) -> None:
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    monkeypatch.setattr(cli_up, "model_dir", lambda _: Path("/m"))
    args = ["up", "--state-file", "/tmp/up.json", "--restart-limit", "2", "--restart-window", "30"]
    assert cli_up.cmd_up(build_parser().parse_args(args)) == 0
    assert plans[0].state_file == Path("/tmp/up.json")
    assert (plans[0].restart.max_deaths, plans[0].restart.window_s) == (2, 30.0)
    assert cli_up.cmd_up(build_parser().parse_args(["up", "--restart-limit", "0"])) == 2
    assert "max_deaths" in capsys.readouterr().err


def test_role_args_reach_only_their_role(monkeypatch) -> None:
    """``--prefill-args`` and friends are how the reliability campaign injects transfer faults on
    the prefill nodes alone and shortens the router's stream idle timeout."""
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    monkeypatch.setattr(cli_up, "model_dir", lambda _: Path("/m"))
    args = ["up", "--prefill-args", "--fault-transfer-rate 0.1", "--router-args", "--max-running-requests 7"]
    assert cli_up.cmd_up(build_parser().parse_args(args)) == 0
    by_name = {spec.name: spec.argv for stage in stages(plans[0]) for spec in stage}
    assert by_name["prefill-0"][-2:] == ("--fault-transfer-rate", "0.1")
    assert "--fault-transfer-rate" not in by_name["decode-0"]
    assert by_name["router"][-2:] == ("--max-running-requests", "7")
    prefill = build_parser().parse_args(list(by_name["prefill-0"][3:]))  # past "python -m tierserve.cli"
    assert prefill.fault_transfer_rate == 0.1


def test_handoff_integrity_and_tls_reach_both_node_roles_and_tls_the_router(monkeypatch, tmp_path: Path) -> None:
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    monkeypatch.setattr(cli_up, "model_dir", lambda _: Path("/m"))
    args = ["up", "--handoff-integrity", "--tls", "--tls-dir", str(tmp_path)]
    assert cli_up.cmd_up(build_parser().parse_args(args)) == 0
    by_name = {spec.name: spec.argv for stage in stages(plans[0]) for spec in stage}
    for node in ("prefill-0", "decode-0"):
        parsed = build_parser().parse_args(list(by_name[node][3:]))  # past "python -m tierserve.cli"
        assert parsed.handoff_integrity and parsed.tls_ca == tmp_path / "ca.pem" and parsed.tls_cert.exists()
    router = build_parser().parse_args(list(by_name["router"][3:]))
    assert router.tls_cert == tmp_path / "client.pem" and router.tls_ca == tmp_path / "ca.pem"
    assert cli_up.cmd_up(build_parser().parse_args(["up", "--tls-dir", str(tmp_path)])) == 2  # needs --tls


def test_up_gives_every_child_its_logging_flags(monkeypatch) -> None:
    """Every child's lines go through ``up``'s stdout: ``--log-level`` and ``--quiet-access-log``
    (no line per request) reach the nodes and the router (issue 17 item 5)."""
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    monkeypatch.setattr(cli_up, "model_dir", lambda _: Path("/m"))
    args = build_parser().parse_args(["up", "--model", "m", "--log-level", "warning", "--quiet-access-log"])
    assert cli_up.cmd_up(args) == 0
    plan = plans[0]
    node = build_parser().parse_args(["decode", *plan.node_flags])
    router = build_parser().parse_args(["router", *plan.router_flags])
    assert (node.log_level, node.quiet_access_log) == (router.log_level, router.quiet_access_log) == ("warning", True)
    assert router.disaggregation_threshold == args.disaggregation_threshold
