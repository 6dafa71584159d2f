"""TLS for a ``tierserve up`` cluster (``up --tls``, ``docs/tenancy.md``):
the certificates in one folder, made with ``openssl`` where missing, and the flags that hand them
to the nodes (serve mutual TLS) and to the router (verifies the nodes, presents its certificate).

Files in the folder: ``ca.pem`` (``ca.key`` only when made here), ``node.pem``/``node.key`` (for
127.0.0.1 and localhost, where ``up`` reaches its nodes, plus the host given), ``client.pem``/
``client.key`` (the router's, also used by ``up``'s own readiness probes). A folder that holds all
five is used as it is: bring your own certificates that way.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tierserve.core.node_auth import TLSFiles

FILES = ("ca.pem", "node.pem", "node.key", "client.pem", "client.key")
DAYS = "825"  # the longest validity common clients accept for a leaf certificate


@dataclass(frozen=True)
class ClusterTLS:
    """The cluster's certificate folder (see the module's docstring)."""

    folder: Path

    def node_flags(self) -> list[str]:
        f = self.folder
        return ["--tls-cert", str(f / "node.pem"), "--tls-key", str(f / "node.key"), "--tls-ca", str(f / "ca.pem")]

    def router_flags(self) -> list[str]:
        f = self.folder
        return ["--tls-ca", str(f / "ca.pem"), "--tls-cert", str(f / "client.pem"), "--tls-key", str(f / "client.key")]

    def client(self) -> TLSFiles:
        """What a client of the nodes presents: the router's certificate and the CA."""
        return TLSFiles(self.folder / "client.pem", self.folder / "client.key", self.folder / "ca.pem")


def cluster_tls(folder: Path, host: str = "127.0.0.1") -> ClusterTLS:
    """The folder's certificates, made first unless all five files are there; ``ValueError`` when
    they must be made and ``openssl`` is missing or fails."""
    folder.mkdir(parents=True, exist_ok=True)
    if not all((folder / name).exists() for name in FILES):
        _make(folder, host)
    return ClusterTLS(folder.resolve())


def _make(folder: Path, host: str) -> None:
    if shutil.which("openssl") is None:
        raise ValueError("up --tls makes its certificates with openssl, which is not installed; "
                         f"or put {', '.join(FILES)} in --tls-dir")
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", DAYS, "-subj", "/CN=tierserve-up-ca")
    for name, names in (("node", _names(host)), ("client", "DNS:tierserve-router")):
        _openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=tierserve-{name}")
        (folder / f"{name}.ext").write_text(f"subjectAltName={names}\n")
        _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", DAYS, "-extfile", f"{name}.ext")
    for key in folder.glob("*.key"):
        key.chmod(0o600)


def _names(host: str) -> str:
    """The node certificate's subject alternative names: loopback, and ``host`` when it is another."""
    names = ["IP:127.0.0.1", "DNS:localhost"]
    if host not in ("", "0.0.0.0", "::", "127.0.0.1", "localhost"):
        try:
            names.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            names.append(f"DNS:{host}")
    return ",".join(names)


def _openssl(folder: Path, *args: str) -> None:
    done = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")
