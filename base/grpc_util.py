"""What both pagedkv servers share: addresses, channel options, health and reflection.

Addresses: `host:port` (TCP; port 0 = ephemeral), `:port` or a bare port (= 127.0.0.1), or
`unix:///abs/path` / `unix:relative/path` (a Unix domain socket, the natural transport for the
two processes on one box). TCP defaults to loopback: exposing a server is an explicit choice.
"""

from __future__ import annotations

import os
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

DEFAULT_HOST = "127.0.0.1"
# Request metadata naming the calling control plane on the Worker service (owner lease:
# worker/owner_lease.py, ResetRequest in worker.proto).
OWNER_METADATA_KEY = "pagedkv-owner"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # Describe carries tokenizer.json (MBs for 150k vocabularies)

# Both directions of a pagedkv channel: large messages, fast reconnects (a restarted worker is
# noticed within ~0.1-1 s instead of gRPC's default back-off that grows to 120 s), keepalive so
# a half-open TCP connection to a dead peer is detected.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # gRPC sets SO_REUSEPORT by default on Linux: a second server on a busy port then starts
    # silently and the kernel splits connections between the two. Off: the bind fails.
    ("grpc.so_reuseport", 0),
)


def normalize_address(address: str) -> str:
    """A listen/target address in gRPC syntax; raises ValueError with the accepted forms."""
    address = address.strip()
    if not address:
        raise ValueError("empty address; use HOST:PORT or unix:///path/to/socket")
    if address.startswith("unix:") or address.startswith(("dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/"):
        return "unix://" + address
    if address.isdigit():
        return f"{DEFAULT_HOST}:{address}"
    if address.startswith(":"):
        return DEFAULT_HOST + address
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"bad address {address!r}; use HOST:PORT, :PORT or unix:///path/to/socket")
    return address


def unix_socket_path(address: str) -> str | None:
    """The filesystem path of a `unix:` address, else None."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    return None


def bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> tuple[str, int]:
    """Add a port, TLS with `credentials` else plaintext; returns (the address clients should
    use, TCP port or 0).

    A stale socket file from a crashed previous run is removed first (the directory must
    exist). Raises RuntimeError naming the address when binding fails (port in use...).
    """
    address = normalize_address(address)
    path = unix_socket_path(address)
    if path is not None:
        if os.path.exists(path):
            if _socket_answers(path):
                raise RuntimeError(
                    f"cannot listen on {address}: another process is serving on that socket "
                    "(stop it first, or choose another path)"
                )
            os.unlink(path)  # stale: left by a process that died
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise RuntimeError(f"cannot listen on {address}: directory {parent} does not exist")
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e} (in use? permissions?)") from None
    if path is not None:
        return address, 0
    if port == 0:
        raise RuntimeError(f"cannot listen on {address} (port in use or host not local?)")
    host = address.rpartition(":")[0]
    return f"{host}:{port}", port


async def bind_and_start(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> str:
    """`bind`, then start. A server that cannot bind is stopped before the error propagates:
    an unstarted grpc.aio server left to the garbage collector shuts itself down on whatever
    event loop runs then, which once hung a later test's teardown."""
    try:
        bound, _ = bind(server, address, credentials)
    except RuntimeError:
        await server.stop(None)
        raise
    await server.start()
    return bound


def _socket_answers(path: str) -> bool:
    """True if a process accepts connections on the Unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:  # refused (stale file), not a socket, permissions...
            return False
    return True


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard `grpc.health.v1.Health` plus server reflection (so grpcurl needs no .proto).

    The health servicer starts SERVING for "" in grpc's implementation; callers set
    NOT_SERVING before `server.start()` when they are not ready yet.
    """
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    """Set the overall ("") status and each service's status together."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await servicer.set(name, status)
