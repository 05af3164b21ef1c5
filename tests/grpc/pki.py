"""A throwaway PKI for the security tests, made with the `openssl` CLI: a CA, a server
certificate (SAN 127.0.0.1 and localhost), a client certificate, an unrelated CA, two tokens."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

TOKEN = "s3cret-token-for-tests"
EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = pagedkv-test
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
[client]
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
"""


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


def _make_cert(d: Path, name: str, serial: int) -> None:
    """`name`.crt/.key signed by ca.crt, with the config's [`name`] extensions."""
    _openssl(
        d,
        *("req", "-new", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr"),
        *("-config", "openssl.cnf", "-subj", f"/CN=pagedkv test {name}"),
    )
    _openssl(
        d,
        *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key"),
        *("-set_serial", str(serial), "-days", "2", "-out", f"{name}.crt"),
        *("-extfile", "openssl.cnf", "-extensions", name),
    )


def make_pki(d: Path) -> dict[str, str]:
    """Paths: ca, server_cert, server_key, client_cert, client_key, other_ca, token, wrong_token,
    dir. Skips the calling test, saying why, when there is no openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed; it makes the test certificates")
    (d / "openssl.cnf").write_text(OPENSSL_CONFIG)
    for ca in ("ca", "other_ca"):
        _openssl(
            d,
            *("req", "-x509", "-new", *EC_KEY, "-days", "2", "-keyout", f"{ca}.key", "-out", f"{ca}.crt"),
            *("-config", "openssl.cnf", "-extensions", "ca", "-subj", f"/CN=pagedkv test {ca}"),
        )
    _make_cert(d, "server", 2)
    _make_cert(d, "client", 3)
    (d / "token").write_text(TOKEN + "\n")
    (d / "wrong_token").write_text("not-the-token\n")
    names = ("ca", "other_ca")
    paths = {n: str(d / f"{n}.crt") for n in names}
    for n in ("server", "client"):
        paths[f"{n}_cert"], paths[f"{n}_key"] = str(d / f"{n}.crt"), str(d / f"{n}.key")
    paths.update(token=str(d / "token"), wrong_token=str(d / "wrong_token"), dir=str(d))
    return paths
