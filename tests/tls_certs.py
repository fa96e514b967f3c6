"""Throwaway PEM certificates for the TLS/mTLS tests: one CA, a server cert for localhost and
127.0.0.1, a client cert, and a second CA the servers must not trust. Made with the openssl CLI.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # signed by a CA nobody trusts
    rogue_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(out: Path, name: str) -> tuple[Path, Path]:
    cert, key = out / f"{name}.pem", out / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}")
    return cert, key


def _leaf(out: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    cert, key, csr, extfile = out / f"{name}.pem", out / f"{name}.key", out / f"{name}.csr", out / f"{name}.ext"
    extfile.write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(extfile))
    return cert, key


def make_certs(out: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    ca = _ca(out, "tokenwire-test-ca")
    rogue_ca = _ca(out, "rogue-ca")
    server = _leaf(out, "worker", ca, "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                      "extendedKeyUsage=serverAuth\n")
    client = _leaf(out, "gateway", ca, "extendedKeyUsage=clientAuth\n")
    rogue = _leaf(out, "rogue", rogue_ca, "extendedKeyUsage=clientAuth\n")
    return Certs(ca[0], *server, *client, *rogue)
