"""Transport security for both gRPC servers and their clients: TLS, mutual TLS, a bearer token.

Off by default: a server on loopback or a Unix socket trusts whoever can reach it, as before.
A server that listens beyond the machine should have all three layers switched on by flags:

    server  --tls-cert FILE --tls-key FILE     TLS (clients verify this certificate)
            --tls-client-ca FILE               mutual TLS: clients must present a certificate
                                               signed by this CA, else the handshake fails
            --auth-token-file FILE             every RPC must carry `authorization: Bearer <token>`
    client  --tls-ca FILE                      the CA that signed the server's certificate
            --tls-cert FILE --tls-key FILE     the client certificate, for mutual TLS
            --auth-token-file FILE             the same token as the server's

The token check is a `grpc.aio` server interceptor. It compares in constant time
(`hmac.compare_digest`), answers UNAUTHENTICATED with what to change and never echoes the
sent value. Health (`grpc.health.v1.Health`) and reflection are exempt: probes (kubelet,
deploy/healthcheck.py) carry no token, `grpcurl list` needs none, and neither reveals more
than the public .proto files. They still run over TLS when TLS is on.

Clients send the token as per-call metadata rather than call credentials: gRPC refuses call
credentials on a plaintext channel, and a token over loopback or a private socket is a
legitimate plaintext setup. One mechanism serves both.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

from base.grpc_util import normalize_address
from base.logs import get_logger

AUTH_METADATA_KEY = "authorization"
# Method-name prefixes answered without a token (see the module docstring for why).
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_LOOPBACK_HOSTS = ("127.", "localhost", "[::1]", "::1")
log = get_logger("pagedkv.security")


def read_file(path: str | Path, what: str) -> bytes:
    """The bytes of a credentials file, or a ValueError that names the flag's file and the problem."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(p)!r} does not exist") from None
    except OSError as e:
        raise ValueError(f"cannot read {what} file {str(p)!r}: {e.strerror or e}") from None
    if not data.strip():
        raise ValueError(f"{what} file {str(p)!r} is empty")
    return data


def read_token(path: str | Path) -> str:
    """The bearer token in `path`: its content with surrounding whitespace (a trailing newline
    from `echo` or a Kubernetes Secret) removed. Empty is an error, never "no auth"."""
    try:
        token = read_file(path, "auth token").decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"auth token file {str(path)!r} is not UTF-8 text") from None
    if any(c.isspace() for c in token):
        raise ValueError(f"auth token file {str(path)!r} must hold one token without spaces")
    return token


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS with the PEM certificate chain `cert` and its private key `key`; with `client_ca`,
    mutual TLS: a client without a certificate signed by that CA fails the handshake."""
    chain, private_key = read_file(cert, "TLS certificate"), read_file(key, "TLS key")
    roots = read_file(client_ca, "TLS client CA") if client_ca else None
    return grpc.ssl_server_credentials(
        [(private_key, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


def _bearer(metadata) -> str | None:
    """The value of the first `authorization` metadata entry, or None."""
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _denied_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape (unary/streaming) as `handler` that aborts UNAUTHENTICATED."""

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits an RPC only with `authorization: Bearer <token>` (health and reflection exempt)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("empty auth token")
        self._expected = token.encode()

    def check(self, authorization: str | None) -> str | None:
        """None when admitted, else why not (a message for the client, without the sent value)."""
        if authorization is None:
            return (
                "missing bearer token: this server requires metadata 'authorization: Bearer <token>' "
                "(pagedkv CLI: --auth-token-file FILE; grpcurl: -H 'authorization: Bearer <token>')"
            )
        scheme, _, sent = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not sent.strip():
            return "malformed authorization metadata: expected 'Bearer <token>'"
        if not hmac.compare_digest(sent.strip().encode(), self._expected):
            return "invalid bearer token: use the token in the server's --auth-token-file"
        return None

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        reason = self.check(_bearer(handler_call_details.invocation_metadata))
        if reason is None:
            return handler
        log.warning("auth.rejected", method=method, reason=reason.split(":", 1)[0])
        return _denied_handler(handler, reason)


@dataclass(frozen=True)
class ServerSecurity:
    """What `grpc.aio.server` and `bind` need: TLS credentials (None = plaintext) and
    interceptors (the token check). `ServerSecurity()` is plaintext and open."""

    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    mutual_tls: bool = False

    @classmethod
    def from_files(
        cls,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        auth_token_file: str | None = None,
    ) -> ServerSecurity:
        if (tls_cert is None) != (tls_key is None):
            missing = "--tls-key" if tls_key is None else "--tls-cert"
            raise ValueError(f"TLS needs both --tls-cert and --tls-key; {missing} is missing")
        if tls_client_ca and not tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")
        creds = server_credentials(tls_cert, tls_key, tls_client_ca) if tls_cert else None
        interceptors = (TokenAuthInterceptor(read_token(auth_token_file)),) if auth_token_file else ()
        return cls(creds, interceptors, mutual_tls=bool(tls_client_ca))

    @classmethod
    def from_args(cls, args) -> ServerSecurity:
        """From argparse's --tls-cert --tls-key --tls-client-ca --auth-token-file (absent = off)."""
        return cls.from_files(*(getattr(args, n, None) for n in _SERVER_FLAGS))

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    def describe(self) -> dict[str, str]:
        """For the `listening` log line: {"tls": "off" | "on" | "mutual", "auth": "none" | "token"}."""
        tls = "mutual" if self.mutual_tls else "on" if self.tls else "off"
        return {"tls": tls, "auth": "token" if self.interceptors else "none"}

    def exposure_warning(self, address: str) -> str | None:
        """A warning when `address` is reachable beyond this machine without TLS or a token."""
        address = normalize_address(address)
        if address.startswith("unix:") or address.startswith(_LOOPBACK_HOSTS):
            return None
        missing = [what for what, on in (("TLS", self.tls), ("a token", self.interceptors)) if not on]
        if not missing:
            return None
        return f"listening on {address} without {' or '.join(missing)}: see docs/DEPLOY.md, Security"


_SERVER_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")
_CLIENT_FLAGS = ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "auth_token_file")


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server: TLS credentials (None = plaintext), the metadata that
    carries the token (None = no token) and extra channel options (the TLS name override)."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] | None = None
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_files(
        cls,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        auth_token_file: str | None = None,
        *,
        auth_token: str | None = None,
    ) -> ClientSecurity:
        """TLS is on when any of `tls_ca` (else the system's roots), `tls_cert` + `tls_key`
        (a client certificate for mutual TLS) is given. `tls_server_name`: the name to check the
        server's certificate against when the target (e.g. an IP) is not in it."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("a client certificate needs both --tls-cert and --tls-key")
        if auth_token is not None and auth_token_file is not None:
            raise ValueError("give the token either inline or as a file, not both")
        creds = None
        if tls_ca or tls_cert:
            creds = grpc.ssl_channel_credentials(
                root_certificates=read_file(tls_ca, "TLS CA") if tls_ca else None,
                private_key=read_file(tls_key, "TLS key") if tls_key else None,
                certificate_chain=read_file(tls_cert, "TLS certificate") if tls_cert else None,
            )
        elif tls_server_name:
            raise ValueError("--tls-server-name needs TLS (--tls-ca)")
        token = read_token(auth_token_file) if auth_token_file else auth_token
        if token is not None and not token.strip():
            raise ValueError("empty auth token")
        metadata = ((AUTH_METADATA_KEY, f"Bearer {token.strip()}"),) if token else None
        options = (("grpc.ssl_target_name_override", tls_server_name),) if tls_server_name else ()
        return cls(creds, metadata, options)

    @classmethod
    def from_args(cls, args, prefix: str = "") -> ClientSecurity:
        """From argparse's --{prefix}tls-ca ... --{prefix}auth-token-file (absent = off)."""
        return cls.from_files(*(getattr(args, prefix + n, None) for n in _CLIENT_FLAGS))

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    def channel(self, target: str, options) -> grpc.Channel:
        """A blocking channel; send `metadata` with every call."""
        opts = [*options, *self.options]
        if self.credentials is None:
            return grpc.insecure_channel(target, options=opts)
        return grpc.secure_channel(target, self.credentials, options=opts)

    def aio_channel(self, target: str, options) -> grpc.aio.Channel:
        """An asyncio channel; send `metadata` with every call."""
        opts = [*options, *self.options]
        if self.credentials is None:
            return grpc.aio.insecure_channel(target, options=opts)
        return grpc.aio.secure_channel(target, self.credentials, options=opts)
