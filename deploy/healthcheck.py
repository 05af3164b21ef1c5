#!/usr/bin/env python3
"""Ask a pagedkv server (worker or control plane) whether it is ready, over `grpc.health.v1`.

One probe for every place that needs one: the systemd units' `ExecStartPost` (a unit turns
"active" only once its server answers SERVING, so `After=pagedkv-worker.service` really means
"after the model is loaded"), the Docker `HEALTHCHECK`, and the Kubernetes exec probe of the
worker (kubelet's native gRPC probe cannot dial a Unix socket).

    healthcheck.py [ADDRESS]                  one check: exit 0 if SERVING
    healthcheck.py --wait 600 ADDRESS         poll until SERVING or 600 s have passed
    healthcheck.py --alive ADDRESS            liveness: any health answer (SERVING or
                                              NOT_SERVING) means the process is responsive

ADDRESS is what the server was told to `--listen` on: `host:port` or `unix:///path`. A
wildcard listen host (0.0.0.0, ::, [::]) is probed on loopback, so a unit can pass its own
`--listen` value. Without ADDRESS, `$PAGEDKV_HEALTH_ADDR` is used (the container images set it).

A server with `--tls-cert` is probed over TLS: `--tls-ca FILE` (the CA that signed it) and
`--tls-server-name NAME` (a name in the certificate; the probe dials loopback, which the
certificate may not name), plus `--tls-cert/--tls-key` when it requires client certificates.
Each defaults to `$PAGEDKV_HEALTH_TLS_CA`, `..._SERVER_NAME`, `..._CERT`, `..._KEY`, so a
container's HEALTHCHECK needs only environment variables. No token is needed: the health
service is exempt from `--auth-token-file`.

Exit status: 0 healthy; 1 not serving, unreachable or timed out (the reason is printed on
stderr); 2 usage error. Needs only `grpcio` and `grpcio-health-checking` (dependencies of the
pagedkv package), never torch, so a probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2
ADDRESS_ENV = "PAGEDKV_HEALTH_ADDR"
TLS_ENV_PREFIX = "PAGEDKV_HEALTH_TLS_"
TLS_FLAGS = {
    "ca": "probe over TLS, verifying the server with this CA (PEM)",
    "cert": "client certificate, for a server with --tls-client-ca",
    "key": "private key of --tls-cert",
    "server_name": "name to verify in the server's certificate (the probe dials loopback)",
}
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]", "": "127.0.0.1"}


def probe_target(address: str) -> str:
    """The gRPC target to dial for a server listening on `address`."""
    address = address.strip()
    if not address:
        raise ValueError("empty address; use HOST:PORT or unix:///path/to.sock")
    if address.startswith("unix:"):
        return address
    if address.startswith("/"):
        return "unix://" + address
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {address!r}; use HOST:PORT or unix:///path/to.sock")
    if int(port) == 0:
        raise ValueError(f"{address!r} has port 0 (ephemeral): probe the port the server printed")
    return f"{_WILDCARDS.get(host, host)}:{port}"


def _channel(target: str, tls: dict | None):
    """A plaintext channel, or a TLS one when `tls` names a CA or a client certificate."""
    import grpc

    options = [("grpc.enable_retries", 0)]
    if not tls or not (tls.get("ca") or tls.get("cert")):
        return grpc.insecure_channel(target, options=options)

    def read(name):
        if not tls.get(name):
            return None
        with open(tls[name], "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(read("ca"), read("key"), read("cert"))
    if tls.get("server_name"):
        options.append(("grpc.ssl_target_name_override", tls["server_name"]))
    return grpc.secure_channel(target, creds, options=options)


def check_once(target: str, service: str, timeout_s: float, tls: dict | None = None) -> tuple[str, str]:
    """(status name, detail): SERVING / NOT_SERVING / SERVICE_UNKNOWN / UNKNOWN, or the gRPC
    error code name (UNAVAILABLE, DEADLINE_EXCEEDED, ...) when no answer came back.
    `tls`: {"ca", "cert", "key", "server_name"} file paths / name, or None for plaintext."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # A fresh channel per attempt: a probe must not ride on a connection kept from a
    # previous server instance, and gRPC's reconnect back-off must not delay the next try.
    with _channel(target, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:  # the server does not know this service name
                return "SERVICE_UNKNOWN", e.details() or ""
            return code.name, e.details() or ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), ""


def healthy(status: str, alive: bool) -> bool:
    if alive:  # the health service answered: the process and its event loop are up
        return status in ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", "UNKNOWN")
    return status == "SERVING"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedkv-healthcheck",
        description="Probe a pagedkv server's grpc.health.v1 service (exit 0 = healthy).",
    )
    parser.add_argument(
        "address",
        nargs="?",
        default=os.environ.get(ADDRESS_ENV, ""),
        help=f"HOST:PORT or unix:///path (default: ${ADDRESS_ENV})",
    )
    parser.add_argument("--service", default="", help='health service name (default "": the whole server)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per attempt (default 2)")
    parser.add_argument(
        "--wait", type=float, default=0.0, help="keep trying for up to this many seconds (default: one try)"
    )
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between tries (default 0.5)")
    parser.add_argument(
        "--alive", action="store_true", help="succeed on any health answer, SERVING or not (liveness)"
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    for name, what in TLS_FLAGS.items():
        env = f"{TLS_ENV_PREFIX}{name.upper()}"
        parser.add_argument(
            f"--tls-{name.replace('_', '-')}",
            metavar="NAME" if name == "server_name" else "FILE",
            default=os.environ.get(env),
            help=f"{what} (${env})",
        )
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.wait < 0 or args.interval <= 0:
        parser.error("--timeout and --interval must be > 0, --wait >= 0")
    try:
        target = probe_target(args.address)
    except ValueError as e:
        parser.error(f"{e} (or set ${ADDRESS_ENV})")

    tls = {name: getattr(args, f"tls_{name}") for name in TLS_FLAGS}
    missing = [
        path for name, path in tls.items() if path and name != "server_name" and not os.path.isfile(path)
    ]
    if missing:
        parser.error(f"TLS file not found: {missing[0]}")
    deadline = time.monotonic() + args.wait
    attempts = 0
    while True:
        attempts += 1
        status, detail = check_once(target, args.service, args.timeout, tls)
        if healthy(status, args.alive):
            if not args.quiet:
                print(f"{target}: {status}")
            return EXIT_OK
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            waited = f" after {attempts} tries in {args.wait:g} s" if args.wait else ""
            reason = f"{status}: {detail}" if detail else status
            print(f"{target}: not healthy{waited}: {reason}", file=sys.stderr)
            return EXIT_UNHEALTHY
        time.sleep(min(args.interval, remaining))


if __name__ == "__main__":
    sys.exit(main())
