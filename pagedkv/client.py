"""Python client for `pagedkv.v1.Engine`: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("127.0.0.1:50051") as c:
        for msg in c.generate("Hello", max_tokens=16):      # streams GenerateResponse messages
            print(msg.text, end="", flush=True)
        print(c.complete(token_ids=[1, 2, 3], max_tokens=8, n=2))   # collected per sample

Targets: "host:port", "unix:///path/to.sock", "dns:///name:port" (every address the name
resolves to), or a list of "ip:port" addresses. Calls are spread over all resolved addresses
with gRPC's own `round_robin` policy: scale-out across replicas needs no proxy.

Security (off by default; see base.security): `tls_ca=` (the CA that signed the server's
certificate) turns on TLS, `tls_cert=` + `tls_key=` add a client certificate for mutual TLS,
`tls_server_name=` checks the certificate against that name instead of the target's host, and
`auth_token=` / `auth_token_file=` send `authorization: Bearer <token>` with every call:

    Client("10.0.0.5:50051", tls_ca="ca.crt", auth_token_file="/etc/pagedkv/token")

Failures raise `ClientError(code, details)`; `code` is the grpc.StatusCode the server sent
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND, UNAVAILABLE, ...). Leaving a `generate`
iteration early (break, exception, garbage collection) cancels the RPC, and the server aborts
the request and frees its blocks.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from base.grpc_util import CHANNEL_OPTIONS, normalize_address
from base.security import ClientSecurity
from base.v1 import engine_pb2, engine_pb2_grpc
from pagedkv.requests import Completion, build_request, collect

DEFAULT_TARGET = "127.0.0.1:50051"
_ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


class ClientError(Exception):
    """An RPC failed. `code`: grpc.StatusCode; `details`: the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def resolve_target(target: str | Sequence[str]) -> str:
    """One gRPC target string for a target or a list of IP:port addresses."""
    if isinstance(target, str):
        return normalize_address(target)
    addrs = [a.strip() for a in target]
    if not addrs:
        raise ValueError("empty address list")
    if len(addrs) == 1:
        return normalize_address(addrs[0])
    hosts = []
    for a in addrs:
        host, _, port = a.rpartition(":")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"{a!r}: a list of targets must be IP:PORT addresses; for host names use dns:///NAME:PORT"
            ) from None
        hosts.append((ip.version, f"[{host}]:{port}" if ip.version == 6 else f"{host}:{port}"))
    versions = {v for v, _ in hosts}
    if len(versions) != 1:
        raise ValueError("mix of IPv4 and IPv6 addresses; use one family")
    return f"ipv{versions.pop()}:" + ",".join(h for _, h in hosts)


def _channel_options(extra) -> list:
    return [*CHANNEL_OPTIONS, ("grpc.service_config", _ROUND_ROBIN), *(extra or ())]


class _EngineChannel:
    """What both clients share: the target, the default timeout and one channel (blocking or
    asyncio, per `_aio`) with TLS / mTLS / bearer token as asked (see the module docstring;
    plaintext, no token by default)."""

    _aio = False

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        options=None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        auth_token: str | None = None,
        auth_token_file: str | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        self.target = resolve_target(target)
        self.timeout = timeout
        sec = security or ClientSecurity.from_files(
            tls_ca, tls_cert, tls_key, tls_server_name, auth_token_file, auth_token=auth_token
        )
        self._metadata = sec.metadata
        make = sec.aio_channel if self._aio else sec.channel
        self._channel = make(self.target, _channel_options(options))
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)


class Client(_EngineChannel):
    """Blocking client. Thread-safe (one channel, many concurrent calls)."""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Iterator:
        """Stream GenerateResponse messages (see `build_request` for the keywords)."""
        return self.generate_request(build_request(prompt, **kw), timeout=timeout)

    def generate_request(
        self, request: engine_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> Iterator:
        """Stream the responses to a GenerateRequest built by the caller."""
        call = self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as e:
            raise ClientError(e.code(), e.details()) from None
        finally:
            call.cancel()  # no-op when complete; aborts the request when the caller stopped early

    def complete(self, prompt: str | None = None, **kw) -> list[Completion]:
        """Run a request to the end; one Completion per sample, by index."""
        done: dict[int, Completion] = {}
        collect(self.generate(prompt, **kw), done)
        return [done[i] for i in sorted(done)]

    def _unary(self, method, request, timeout):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise ClientError(e.code(), e.details()) from None

    def abort(self, request_id: str, timeout: float | None = None) -> int:
        """Abort a live request; returns the samples aborted. NOT_FOUND if unknown."""
        req = engine_pb2.AbortRequest(request_id=request_id)
        return self._unary(self._stub.Abort, req, timeout).num_aborted_samples

    def stats(self, timeout: float | None = None) -> engine_pb2.EngineStats:
        return self._unary(self._stub.GetStats, engine_pb2.GetStatsRequest(), timeout)

    def block_table(self, request_id: str, timeout: float | None = None) -> engine_pb2.BlockTable:
        req = engine_pb2.GetBlockTableRequest(request_id=request_id)
        return self._unary(self._stub.GetBlockTable, req, timeout)

    def model_info(self, timeout: float | None = None) -> engine_pb2.ModelInfo:
        return self._unary(self._stub.GetModelInfo, engine_pb2.GetModelInfoRequest(), timeout)

    def load_adapter(self, name: str, path: str, timeout: float | None = None) -> engine_pb2.AdapterInfo:
        """Load the PEFT LoRA adapter in directory `path` (on the worker's machine) as `name`."""
        req = engine_pb2.LoadAdapterRequest(name=name, path=path)
        return self._unary(self._stub.LoadAdapter, req, timeout)

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        self._unary(self._stub.UnloadAdapter, engine_pb2.UnloadAdapterRequest(name=name), timeout)

    def list_adapters(self, timeout: float | None = None) -> list[engine_pb2.AdapterInfo]:
        return list(self._unary(self._stub.ListAdapters, engine_pb2.ListAdaptersRequest(), timeout).adapters)

    def tokenize(
        self, text: str, add_special_tokens: bool = False, timeout: float | None = None
    ) -> engine_pb2.TokenizeResponse:
        """The server tokenizer's ids for `text` (`.token_ids`) and its `.max_model_len`."""
        req = engine_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return self._unary(self._stub.Tokenize, req, timeout)

    def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = False, timeout: float | None = None
    ) -> engine_pb2.DetokenizeResponse:
        """`.text` of the ids, and per id `.token_bytes` and `.special`
        (`base.tokenizer.token_display` shows a piece that is not whole UTF-8)."""
        req = engine_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, req, timeout)

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """ "SERVING", "NOT_SERVING", ... of the standard health service."""
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the server reports SERVING; raises TimeoutError naming the last status."""
        import time

        deadline = time.monotonic() + timeout
        last = "unreachable"
        while time.monotonic() < deadline:
            try:
                last = self.health(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except ClientError as e:
                last = e.code.name
            time.sleep(0.05)
        raise TimeoutError(f"{self.target} not SERVING after {timeout:.0f}s (last: {last})")


class AsyncClient(_EngineChannel):
    """asyncio client with the same methods as `Client` (awaitables / async iterators)."""

    _aio = True

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> AsyncIterator:
        return self.generate_request(build_request(prompt, **kw), timeout=timeout)

    async def generate_request(
        self, request: engine_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncIterator:
        call = self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        except grpc.RpcError as e:
            raise ClientError(e.code(), e.details()) from None
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, **kw) -> list[Completion]:
        done: dict[int, Completion] = {}
        collect([m async for m in self.generate(prompt, **kw)], done)
        return [done[i] for i in sorted(done)]

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise ClientError(e.code(), e.details()) from None

    async def abort(self, request_id: str, timeout: float | None = None) -> int:
        req = engine_pb2.AbortRequest(request_id=request_id)
        return (await self._unary(self._stub.Abort, req, timeout)).num_aborted_samples

    async def stats(self, timeout: float | None = None) -> engine_pb2.EngineStats:
        return await self._unary(self._stub.GetStats, engine_pb2.GetStatsRequest(), timeout)

    async def block_table(self, request_id: str, timeout: float | None = None) -> engine_pb2.BlockTable:
        req = engine_pb2.GetBlockTableRequest(request_id=request_id)
        return await self._unary(self._stub.GetBlockTable, req, timeout)

    async def model_info(self, timeout: float | None = None) -> engine_pb2.ModelInfo:
        return await self._unary(self._stub.GetModelInfo, engine_pb2.GetModelInfoRequest(), timeout)

    async def load_adapter(self, name: str, path: str, timeout: float | None = None):
        """Load the PEFT LoRA adapter in directory `path` as `name`; its engine_pb2.AdapterInfo."""
        req = engine_pb2.LoadAdapterRequest(name=name, path=path)
        return await self._unary(self._stub.LoadAdapter, req, timeout)

    async def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        await self._unary(self._stub.UnloadAdapter, engine_pb2.UnloadAdapterRequest(name=name), timeout)

    async def list_adapters(self, timeout: float | None = None) -> list[engine_pb2.AdapterInfo]:
        reply = await self._unary(self._stub.ListAdapters, engine_pb2.ListAdaptersRequest(), timeout)
        return list(reply.adapters)

    async def tokenize(
        self, text: str, add_special_tokens: bool = False, timeout: float | None = None
    ) -> engine_pb2.TokenizeResponse:
        req = engine_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return await self._unary(self._stub.Tokenize, req, timeout)

    async def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = False, timeout: float | None = None
    ) -> engine_pb2.DetokenizeResponse:
        req = engine_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return await self._unary(self._stub.Detokenize, req, timeout)

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        req = health_pb2.HealthCheckRequest(service=service)
        resp = await self._unary(self._health.Check, req, timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the server reports SERVING; raises TimeoutError naming the last status."""
        import asyncio
        import time

        deadline = time.monotonic() + timeout
        last = "unreachable"
        while time.monotonic() < deadline:
            try:
                last = await self.health(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except ClientError as e:
                last = e.code.name
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{self.target} not SERVING after {timeout:.0f}s (last: {last})")
