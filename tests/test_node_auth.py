"""Authenticated node traffic (``core/node_auth.py``): a node started with a token refuses every
RPC that lacks it (health stays open for probes), and a router given the token serves end to end
through such nodes (``up`` does this by default with a token of its own)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.polling import wait_until
from helpers.processes import NodeProcess, RouterProcess, free_port, running_up

from tierserve.core.node_auth import TLSFiles, client_interceptors, node_channel, read_token
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "node-secret-18"
ARGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048"]


def test_read_token_prefers_the_flag_then_the_file_then_the_environment(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "t").write_text("from-file\n")
    monkeypatch.setenv("TIERSERVE_NODE_TOKEN", "from-env")
    assert read_token("lit", tmp_path / "t") == "lit"
    assert read_token(None, tmp_path / "t") == "from-file"
    assert read_token(None, None) == "from-env"
    monkeypatch.delenv("TIERSERVE_NODE_TOKEN")
    assert read_token(None, None) is None
    with pytest.raises(ValueError):
        read_token("", None)


async def _info(address: str, token: str | None) -> pb.NodeInfo:
    async with grpc.aio.insecure_channel(address, interceptors=client_interceptors(token)) as channel:
        return await pb_grpc.NodeServiceStub(channel).Info(pb.InfoRequest(), timeout=10)


async def _reserve(address: str, token: str | None) -> pb.ReserveResponse:
    async with grpc.aio.insecure_channel(address, interceptors=client_interceptors(token)) as channel:
        request = pb.ReserveRequest(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=1)
        return await pb_grpc.DecodeServiceStub(channel).Reserve(request, timeout=10)


def test_nodes_refuse_rpcs_without_the_token_and_serve_the_router_with_it(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    args = ["--model", str(tiny_llama), *ARGS, "--node-token-file", str(tmp_path / "token")]
    prefill = NodeProcess("prefill", args, tmp_path / "prefill.log")
    decode = NodeProcess("decode", args, tmp_path / "decode.log")
    router = None
    try:
        prefill.wait_ready()  # the health service answers without a token
        decode.wait_ready()
        for address, call in ((prefill.address, _info), (decode.address, _info), (decode.address, _reserve)):
            for token in (None, "wrong"):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    asyncio.run(call(address, token))
                assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(_info(prefill.address, TOKEN)).role == pb.ROLE_PREFILL
        router = RouterProcess(["--model", str(tiny_llama), "--prefill", prefill.address, "--decode",
                                decode.address, "--node-token", TOKEN], tmp_path / "router.log").wait_ready()
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        for proc in (router, prefill, decode):
            if proc is not None:
                proc.stop()


def _certs(folder: Path, names: str = "IP:127.0.0.1,DNS:localhost") -> dict[str, Path]:
    """A CA, a node certificate for ``names`` (subject alternative names) and a client certificate,
    both signed by the CA (openssl)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=tierserve-test-ca")
    for name in ("node", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        (folder / f"{name}.ext").write_text(f"subjectAltName={names}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {n: folder / n for n in ("ca.pem", "node.pem", "node.key", "client.pem", "client.key")}


def _tls_serving(address: str, tls: TLSFiles) -> bool:
    async def check() -> bool:
        async with node_channel(address, None, tls) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    try:
        return asyncio.run(check())
    except grpc.aio.AioRpcError:
        return False


def test_mutual_tls_refuses_a_client_without_a_certificate_and_serves_the_router(tiny_llama: Path,
                                                                                 tmp_path: Path) -> None:
    c = _certs(tmp_path)
    client = TLSFiles(c["client.pem"], c["client.key"], c["ca.pem"])
    tls = ["--tls-cert", str(c["node.pem"]), "--tls-key", str(c["node.key"]), "--tls-ca", str(c["ca.pem"])]
    args = ["--model", str(tiny_llama), *ARGS, "--node-token", TOKEN, *tls]
    nodes = [NodeProcess(role, args, tmp_path / f"{role}.log") for role in ("prefill", "decode")]
    router = None
    try:
        for node in nodes:
            wait_until(lambda n=node: _tls_serving(n.address, client), "TLS node", 120, node.proc, node.log)
        for who in (None, TLSFiles(ca=c["ca.pem"])):  # plaintext; TLS without a client certificate
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                asyncio.run(_call_info(nodes[0].address, who))
            assert exc.value.code() is grpc.StatusCode.UNAVAILABLE
        assert asyncio.run(_call_info(nodes[0].address, client)).role == pb.ROLE_PREFILL
        router = _tls_router(tiny_llama, nodes, c, tmp_path)
        _assert_serves(router)
    finally:
        for proc in (router, *nodes):
            if proc is not None:
                proc.stop()


def test_a_router_with_a_tls_server_name_reaches_nodes_whose_certificate_names_only_that(
        tiny_llama: Path, tmp_path: Path) -> None:
    """How deploy/ reaches pods by IP: the nodes' certificate names one DNS name and no address;
    a client dialling 127.0.0.1 fails the handshake unless it checks for that name
    (``--tls-server-name``), and a router given it serves end to end."""
    c = _certs(tmp_path, "DNS:tierserve-node")
    files = (c["client.pem"], c["client.key"], c["ca.pem"])
    tls = ["--tls-cert", str(c["node.pem"]), "--tls-key", str(c["node.key"]), "--tls-ca", str(c["ca.pem"])]
    nodes = [NodeProcess(role, ["--model", str(tiny_llama), *ARGS, "--node-token", TOKEN, *tls],
                         tmp_path / f"{role}.log") for role in ("prefill", "decode")]
    router = None
    try:
        for node in nodes:
            wait_until(lambda n=node: _tls_serving(n.address, TLSFiles(*files, server_name="tierserve-node")),
                       "TLS node", 120, node.proc, node.log)
        for name in (None, "other-name"):  # the address, or a name the certificate lacks
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                asyncio.run(_call_info(nodes[1].address, TLSFiles(*files, server_name=name)))
            assert exc.value.code() is grpc.StatusCode.UNAVAILABLE
        router = _tls_router(tiny_llama, nodes, c, tmp_path, "--tls-server-name", "tierserve-node")
        _assert_serves(router)
    finally:
        for proc in (router, *nodes):
            if proc is not None:
                proc.stop()


def test_a_tls_server_name_without_tls_is_a_usage_error(tiny_llama: Path) -> None:
    from tierserve.cli.main import main

    with pytest.raises(ValueError, match="--tls-server-name"):
        TLSFiles.of(None, None, None, "tierserve-node")
    assert TLSFiles.of(None, None, Path("ca.pem"), "n") == TLSFiles(ca=Path("ca.pem"), server_name="n")
    assert main(["router", "--model", str(tiny_llama), "--tls-server-name", "tierserve-node"]) == 2


async def _call_info(address: str, tls: TLSFiles | None) -> pb.NodeInfo:
    async with node_channel(address, TOKEN, tls) as channel:
        return await pb_grpc.NodeServiceStub(channel).Info(pb.InfoRequest(), timeout=5)


def test_up_with_tls_serves_end_to_end_and_its_nodes_refuse_plaintext(tmp_path: Path) -> None:
    """``up --tls``: the certificates are made in --tls-dir, the nodes serve mutual TLS only, the
    router reaches them with its client certificate, and a request is answered end to end."""
    import json

    from tierserve.launch.probes import grpc_serving
    from tierserve.launch.tls import cluster_tls

    port, state = free_port(), tmp_path / "up.json"
    with running_up(port, "--tls", "--tls-dir", str(tmp_path / "certs"), "--no-l3", "--state-file", str(state),
                    "--max-total-tokens", "2048") as lines:
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert any("mutual TLS" in line for line in lines)
        tls = cluster_tls(tmp_path / "certs")  # made by up: reused as they are
        nodes = [c for c in json.loads(state.read_text())["children"] if c["grpc_port"]]
        assert len(nodes) == 2
        for node in nodes:
            address = f"127.0.0.1:{node['grpc_port']}"
            assert grpc_serving(address, tls.client())
            assert not grpc_serving(address)  # plaintext
            assert not grpc_serving(address, TLSFiles(ca=tls.folder / "ca.pem"))  # no client certificate


def _tls_router(model: Path, nodes: list[NodeProcess], c: dict[str, Path], tmp_path: Path, *extra: str
                ) -> RouterProcess:
    """A router over ``nodes`` with the token, presenting the client certificate of ``c``."""
    return RouterProcess(["--model", str(model), "--prefill", nodes[0].address, "--decode", nodes[1].address,
                          "--node-token", TOKEN, "--tls-cert", str(c["client.pem"]), "--tls-key",
                          str(c["client.key"]), "--tls-ca", str(c["ca.pem"]), *extra],
                         tmp_path / "router.log").wait_ready()


def _assert_serves(router: RouterProcess) -> None:
    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
