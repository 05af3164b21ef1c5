"""What both pagedkv servers share: addresses, channel options, health and reflection.

Addresses: `host:port` (TCP; port 0 = ephemeral), `:port` or a bare port (= 127.0.0.1), or
`unix:///abs/path` / `unix:relative/path` (a Unix domain socket, the natural transport for the
two processes on one box). TCP defaults to loopback: exposing a server is an explicit choice.
"""

from __future__ import annotations

import os

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

DEFAULT_HOST = "127.0.0.1"
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


def bind(server: grpc.aio.Server, address: str) -> tuple[str, int]:
    """Add an insecure port; returns (the address clients should use, TCP port or 0).

    A stale socket file from a crashed previous run is removed first (the directory must
    exist). Raises RuntimeError naming the address when binding fails (port in use...).
    """
    address = normalize_address(address)
    path = unix_socket_path(address)
    if path is not None:
        if os.path.exists(path):
            os.unlink(path)
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise RuntimeError(f"cannot listen on {address}: directory {parent} does not exist")
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e} (in use? permissions?)") from None
    if path is not None:
        return address, 0
    if port == 0:
        raise RuntimeError(f"cannot listen on {address} (port in use or host not local?)")
    host = address.rpartition(":")[0]
    return f"{host}:{port}", port


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
