"""``tierserve up``'s plans, with ``launch.up`` faked (nothing starts): engine flags, the L3
config and sizes, restarts, role arguments, integrity and TLS, logging flags reach the right
children, and each layout (TP, CP, PP) gives each role its sizes or is refused before any child
starts. The clusters themselves run in ``test_up.py`` and ``test_up_ranks.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.tiny_models import make_eagle_target, make_mimic_eagle
from helpers.up_plans import capture_plans, child_args, children, plan_up, run_up

from tierserve import launch
from tierserve.api.admission import AdmissionPolicy
from tierserve.cache.options import DraftLayout
from tierserve.cli.flags import engine_config, engine_flags
from tierserve.cli.main import build_parser
from tierserve.engine.config import SchedulePolicy, SpeculativeAlgorithm
from tierserve.engine.spec.draft_pools import draft_layout
from tierserve.launch.plan import KNOWN_NOISE, stages

pytestmark = pytest.mark.fakes


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
    plans = capture_plans(monkeypatch)
    assert run_up("--model", str(Path(__file__)), "--hicache-storage-backend-extra-config",
                  '{"prefetch_threshold": 16}') == 0
    plan = plans[0]
    assert "--hicache-storage-backend-extra-config" not in plan.node_flags
    node = build_parser().parse_args(["prefill", *plan.node_flags, *launch.l3_flags(plan, 5555)])
    assert node.hicache_storage_backend_extra_config == {"prefetch_threshold": 16,
                                                         "master_server_address": "127.0.0.1:5555",
                                                         "global_segment_size": plan.l3_segment_bytes}


def test_up_gives_each_node_a_share_of_the_l3_size_and_the_users_segment_size_wins(monkeypatch) -> None:
    """The default Mooncake segment (256 MiB) evicted a conversation trace's prefixes before their
    follow-ups came; ``up`` splits ``--l3-size-gb`` (default: a third of memory) between the nodes."""
    plans = capture_plans(monkeypatch)
    base = ["--model", "m", "--prefill-nodes", "2", "--decode-nodes", "2"]
    assert run_up(*base, "--l3-size-gb", "8") == 0
    node = build_parser().parse_args(["prefill", *launch.l3_flags(plans[-1], 5555)])
    assert node.hicache_storage_backend_extra_config["global_segment_size"] == 2_000_000_000
    assert run_up(*base) == 0
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert plans[-1].l3_segment_bytes == memory // 3 // 4
    assert run_up(*base, "--hicache-storage-backend-extra-config", '{"global_segment_size": 1048576}') == 0
    node = build_parser().parse_args(["prefill", *launch.l3_flags(plans[-1], 5555)])
    assert node.hicache_storage_backend_extra_config["global_segment_size"] == 1048576


def test_nodes_of_two_tp_sizes_write_the_l3_objects_of_both(monkeypatch) -> None:
    """``--prefill-tp-size 2 --decode-tp-size 1``: every node also writes the other size's objects,
    so a TP=2 rank reads what a TP=1 node wrote zero-copy (``l3_tp_sizes``); one size: nothing extra."""
    plans = capture_plans(monkeypatch)
    monkeypatch.setattr("tierserve.model.parallel.misfit", lambda *_: None)  # no model at /m
    extra = ["--hicache-storage-backend-extra-config"]
    for args, sizes in ((["--prefill-tp-size", "2"], [1, 2]), ([], None),
                        (["--decode-tp-size", "4", *extra, '{"l3_tp_sizes": [4]}'], [4])):
        assert run_up("--model", "m", *args) == 0
        node = build_parser().parse_args(["prefill", *launch.l3_flags(plans[-1], 5555)])
        assert node.hicache_storage_backend_extra_config.get("l3_tp_sizes") == sizes


def test_restart_and_state_file_flags_reach_the_plan(monkeypatch, capsys) -> None:
    plans = capture_plans(monkeypatch)
    assert run_up("--state-file", "/tmp/up.json", "--restart-limit", "2", "--restart-window", "30") == 0
    assert plans[0].state_file == Path("/tmp/up.json")
    assert (plans[0].restart.max_deaths, plans[0].restart.window_s) == (2, 30.0)
    assert run_up("--restart-limit", "0") == 2
    assert "max_deaths" in capsys.readouterr().err


def test_role_args_reach_only_their_role(monkeypatch) -> None:
    """``--prefill-args`` and friends reach their role alone, e.g. the reliability campaign's shorter
    stream idle timeout for the router."""
    plans = capture_plans(monkeypatch)
    assert run_up("--prefill-args", "--handoff-timeout 30", "--router-args", "--max-running-requests 7") == 0
    by_name = children(plans[0])
    assert by_name["prefill-0"][-2:] == ("--handoff-timeout", "30")
    assert "--handoff-timeout" not in by_name["decode-0"]
    assert by_name["router"][-2:] == ("--max-running-requests", "7")
    assert child_args(by_name["prefill-0"]).handoff_timeout == 30.0


def test_the_schedule_policy_reaches_every_node_and_the_admission_the_router(monkeypatch) -> None:
    plans = capture_plans(monkeypatch)
    assert run_up("--schedule-policy", "priority", "--admission", "fcfs") == 0
    by_name = children(plans[0])
    for node in ("prefill-0", "decode-0"):
        assert child_args(by_name[node]).schedule_policy is SchedulePolicy.PRIORITY
    assert child_args(by_name["router"]).admission is AdmissionPolicy.FCFS
    assert run_up() == 0
    assert child_args(children(plans[1])["router"]).admission is AdmissionPolicy.TTFT


def test_a_role_flag_its_role_does_not_take_stops_up_at_once(monkeypatch, capsys) -> None:
    """The test-only ``--fault-transfer-*`` flags are gone (docs/faults.md): ``up`` refuses them, and
    any other unknown role flag, before a child starts, instead of restarting crashing children."""
    plans = capture_plans(monkeypatch)
    assert run_up("--prefill-args", "--fault-transfer-rate 0.1") == 2
    assert "--prefill-args: tierserve prefill does not take --fault-transfer-rate 0.1" in capsys.readouterr().err
    assert run_up("--decode-args", "--handoff-timeout 3") == 2  # a prefill flag, not a decode one
    assert "tierserve decode does not take --handoff-timeout 3" in capsys.readouterr().err
    assert plans == []


def test_several_routers_front_the_same_nodes_on_ports_from_port_up(monkeypatch, capsys) -> None:
    """``--routers N``: N routers, each given every node, on ports --port, --port + 1, ... (docs/router.md)."""
    plans = capture_plans(monkeypatch)
    assert run_up("--port", "8100", "--routers", "3", "--prefill-nodes", "2") == 0
    planned = stages(plans[0])
    routers = planned[-1]
    assert [r.name for r in routers] == ["router-0", "router-1", "router-2"]
    assert [r.ports.http for r in routers] == [8100, 8101, 8102]
    nodes = {f"127.0.0.1:{n.ports.grpc}" for n in planned[-2]}
    for r in routers:
        parsed = child_args(r.argv)
        assert parsed.port == r.ports.http
        assert set(parsed.prefill) | set(parsed.decode) == nodes
    assert run_up("--routers", "0") == 2
    assert "--routers must be at least 1" in capsys.readouterr().err


def test_handoff_integrity_and_tls_reach_both_node_roles_and_tls_the_router(monkeypatch, tmp_path: Path) -> None:
    plans = capture_plans(monkeypatch)
    assert run_up("--handoff-integrity", "--tls", "--tls-dir", str(tmp_path)) == 0
    by_name = children(plans[0])
    for node in ("prefill-0", "decode-0"):
        parsed = child_args(by_name[node])
        assert parsed.handoff_integrity and parsed.tls_ca == tmp_path / "ca.pem" and parsed.tls_cert.exists()
    router = child_args(by_name["router"])
    assert router.tls_cert == tmp_path / "client.pem" and router.tls_ca == tmp_path / "ca.pem"
    assert run_up("--tls-dir", str(tmp_path)) == 2  # needs --tls


def test_up_gives_every_child_its_logging_flags(monkeypatch) -> None:
    """Every child's lines go through ``up``'s stdout: ``--log-level`` and ``--quiet-access-log``
    (no line per request) reach the nodes and the router (issue 17 item 5)."""
    plans = capture_plans(monkeypatch)
    args = build_parser().parse_args(["up", "--model", "m", "--log-level", "warning", "--quiet-access-log"])
    assert run_up("--model", "m", "--log-level", "warning", "--quiet-access-log") == 0
    plan = plans[0]
    node = build_parser().parse_args(["decode", *plan.node_flags])
    router = build_parser().parse_args(["router", *plan.router_flags])
    assert (node.log_level, node.quiet_access_log) == (router.log_level, router.quiet_access_log) == ("warning", True)
    assert router.disaggregation_threshold == args.disaggregation_threshold


@pytest.mark.parametrize(("level", "glog", "hidden"), [("info", 1, True), ("error", 2, True), ("debug", 0, False)])
def test_below_debug_the_master_logs_warnings_only_and_mooncakes_known_noise_is_not_relayed(
        monkeypatch, level: str, glog: int, hidden: bool) -> None:
    """``mooncake_master`` at INFO dumps its metrics every 10 s; Mooncake prints harmless lines on
    every node start (``launch.plan.KNOWN_NOISE``): both only at ``--log-level debug``."""
    plans = capture_plans(monkeypatch)
    assert run_up("--model", "m", "--log-level", level) == 0
    specs = {spec.name: spec for stage in launch.stages(plans[0]) for spec in stage}
    assert f"--minloglevel={glog}" in specs["mooncake-master"].argv
    for name in ("mooncake-master", "prefill-0", "decode-0"):
        assert (specs[name].hidden == KNOWN_NOISE) is hidden and bool(specs[name].hidden) is hidden


# ---- layouts: TP, CP and PP sizes per role ---------------------------------------------------


def _layout_model(request, layout: str) -> Path:
    return request.getfixturevalue("ranks_llama4" if layout == "pp" else "ranks_llama")


@pytest.mark.parametrize(("layout", "flags", "fields", "expected"), [
    ("tp", ["--prefill-tp-size", "2", "--decode-tp-size", "4", "--prefill-args", "--handoff-timeout 9"],
     ("prefill.tp_size", "decode.tp_size", "prefill.handoff_timeout"), (2, 4, 9.0)),
    ("cp", ["--prefill-cp-size", "2", "--decode-tp-size", "2"],
     ("prefill.cp_size", "prefill.tp_size", "decode.cp_size", "decode.tp_size"), (2, 1, 1, 2)),
    ("cp", ["--prefill-cp-size", "2", "--prefill-tp-size", "2"], ("prefill.cp_size", "prefill.tp_size"), (2, 2)),
    ("cp", ["--prefill-cp-size", "2", "--prefill-pp-size", "2"], ("prefill.cp_size", "prefill.pp_size"), (2, 2)),
    ("cp", ["--prefill-tp-size", "2", "--prefill-cp-size", "2", "--decode-cp-size", "2"],
     ("prefill.tp_size", "prefill.cp_size", "decode.cp_size", "decode.tp_size"), (2, 2, 2, 1)),
    ("pp", ["--prefill-pp-size", "2", "--decode-pp-size", "4", "--prefill-tp-size", "2"],
     ("prefill.tp_size", "prefill.pp_size", "decode.tp_size", "decode.pp_size"), (2, 2, 1, 4)),
    ("pp", ["--prefill-pp-size", "3", "--prefill-pp-layer-partition", "1,2,1", "--decode-pp-size", "3"],
     ("prefill.pp_size", "prefill.pp_layer_partition", "decode.pp_size", "decode.pp_layer_partition"),
     (3, (1, 2, 1), 3, None)),
    ("cp", ["--speculative-algorithm", "NGRAM", "--decode-tp-size", "2", "--decode-cp-size", "2"],
     ("decode.tp_size", "decode.cp_size", "decode.speculative_algorithm"), (2, 2, SpeculativeAlgorithm.NGRAM)),
    ("pp", ["--speculative-draft-model-path", "MODEL", "--prefill-tp-size", "2", "--decode-pp-size", "2"],
     ("prefill.tp_size", "decode.pp_size"), (2, 2)),
    ("cp", ["--speculative-draft-model-path", "MODEL", "--prefill-cp-size", "2", "--decode-cp-size", "2"],
     ("prefill.cp_size", "decode.cp_size"), (2, 2)),  # a draft at CP hands its KV over (docs/speculative.md, PD)
], ids=["tp", "cp", "cp-with-tp", "cp-with-pp", "decode-cp", "pp", "pp-uneven", "ngram-tp-cp", "standalone-tp-pp",
        "standalone-cp-cp"])
def test_each_role_gets_its_layout_sizes(monkeypatch, request, layout: str, flags: list[str],
                                         fields: tuple[str, ...], expected: tuple) -> None:
    model = _layout_model(request, layout)
    status, plans = plan_up(monkeypatch, model, "--no-l3", *[str(model) if f == "MODEL" else f for f in flags])
    assert status == 0
    by_name = children(plans[0])
    roles = {"prefill": child_args(by_name["prefill-0"]), "decode": child_args(by_name["decode-0"])}
    assert tuple(getattr(roles[f.split(".")[0]], f.split(".")[1]) for f in fields) == expected


def test_nodes_get_no_tp_size_unless_asked(monkeypatch, ranks_llama: Path) -> None:
    _, plans = plan_up(monkeypatch, ranks_llama, "--no-l3")
    assert "--tp-size" not in [a for argv in children(plans[0]).values() for a in argv]


@pytest.mark.parametrize(("layout", "flags", "message"), [
    ("tp", ["--no-l3", "--decode-tp-size", "3"], "--decode-tp-size 3: tensor-parallel size 3 does not divide"),
    ("tp", ["--no-l3", "--tp-size", "2"], "--prefill-tp-size, --decode-tp-size"),
    ("cp", ["--cp-size", "2"], "--prefill-cp-size"),
    ("cp", ["--prefill-cp-size", "0"], "cp_size must be at least 1"),
    ("cp", ["--decode-cp-size", "0"], "--decode-tp-size 1 --decode-cp-size 0: cp_size must be at least 1"),
    ("pp", ["--no-l3", "--decode-pp-size", "5"], "--decode-tp-size 1 --decode-pp-size 5: pipeline-parallel size 5 "
                                                 "is above the model's 4 layers"),
    ("pp", ["--no-l3", "--pp-size", "2"], "--prefill-pp-size and --decode-pp-size"),
    ("pp", ["--no-l3", "--decode-pp-size", "2", "--decode-pp-layer-partition", "2,3"],
     "--decode-tp-size 1 --decode-pp-size 2 --decode-pp-layer-partition 2,3: the layer partition 2,3 adds up to 5"),
    ("pp", ["--no-l3", "--prefill-pp-size", "2", "--prefill-pp-layer-partition", "4"],
     "--prefill-pp-layer-partition 4: --pp-layer-partition: the layer partition 4 names 1 stage(s)"),
    ("pp", ["--no-l3", "--pp-layer-partition", "2,2"], "--prefill-pp-layer-partition and --decode-pp-layer-partition"),
], ids=["tp-decode-3", "tp-one-flag", "cp-one-flag", "cp-0", "decode-cp-0", "pp-decode-5", "pp-one-flag",
        "pp-partition-sum", "pp-partition-count", "pp-partition-one-flag"])
def test_a_layout_size_that_cannot_run_is_refused_before_any_child_starts(monkeypatch, capsys, request, layout: str,
                                                                          flags: list[str], message: str) -> None:
    model = _layout_model(request, layout)
    status, plans = plan_up(monkeypatch, model, *[str(model) if f == "MODEL" else f for f in flags])
    assert status == 2 and plans == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("sizes", "layout"), [("--prefill-pp-size 2 --decode-tp-size 2", DraftLayout.SIDECAR),
                                               ("--prefill-tp-size 2 --decode-pp-size 2", DraftLayout.SIDECAR),
                                               ("--prefill-pp-size 2", DraftLayout.PACKED),
                                               ("--prefill-tp-size 2 --decode-tp-size 2", DraftLayout.SIDECAR)])
def test_both_roles_resolve_an_eagle_heads_auto_layout_alike(monkeypatch, tmp_path: Path, sizes: str,
                                                             layout: DraftLayout) -> None:
    """An EAGLE head's ``auto`` layout is packed at TP 1 and the sidecar at TP 2, and nodes of two
    layouts have two KV namespaces: the router refused the prefill node of PP 2 (packed) beside a
    decode node of TP 2 (sidecar) and ``up`` waited for it for ever. ``up`` now gives both roles
    the sidecar where they would differ, and leaves ``auto`` where they agree."""
    target = make_eagle_target(tmp_path / "target", layers=2)
    head = make_mimic_eagle(target, tmp_path / "head", 0.1)
    status, plans = plan_up(monkeypatch, target, "--no-l3", "--speculative-algorithm", "EAGLE",
                            "--speculative-draft-model-path", str(head), *sizes.split())
    assert status == 0
    roles = [child_args(argv) for name, argv in children(plans[0]).items() if name in ("prefill-0", "decode-0")]
    assert [draft_layout(engine_config(args, target)) for args in roles] == [layout, layout]
