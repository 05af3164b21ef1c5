"""TLS, mutual TLS and the bearer token (base.security) on real servers over loopback TCP.

Certificates come from tests/grpc/pki.py (the `openssl` CLI; skipped, saying so, without it).
The OS processes (`pagedkv serve`, worker + control over TCP) are in test_security_processes.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from base.plan import Plan
from base.security import ClientSecurity, ServerSecurity, TokenAuthInterceptor, read_token
from control_plane.sim_worker import SimWorker
from control_plane.worker_client import WorkerClient, WorkerStepError
from pagedkv.cli import build_parser, main
from pagedkv.client import AsyncClient, Client, ClientError
from pagedkv.serve import child_commands, security_hints
from tests.grpc.conftest import ScriptedWorker
from tests.grpc.harness import TIMEOUT_S, Stack
from tests.grpc.pki import TOKEN, make_pki
from worker.service import WorkerServicer, create_worker_server


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secure_stack(pki):
    """secure_stack(tls=, mtls=, token=, **client kwargs) -> a started Stack; closed after."""
    stacks = []

    def make(*, tls=True, mtls=False, token=False, **client_kwargs) -> Stack:
        security = ServerSecurity.from_files(
            tls_cert=pki["server_cert"] if tls else None,
            tls_key=pki["server_key"] if tls else None,
            tls_client_ca=pki["ca"] if mtls else None,
            auth_token_file=pki["token"] if token else None,
        )
        kw = dict(client_kwargs)
        if tls:
            kw.setdefault("tls_ca", pki["ca"])
        if mtls:
            kw.setdefault("tls_cert", pki["client_cert"])
            kw.setdefault("tls_key", pki["client_key"])
        if token:
            kw.setdefault("auth_token_file", pki["token"])
        stack = Stack(
            lambda: ScriptedWorker(num_blocks=64, block_size=16), security=security, client_kwargs=kw
        )
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        s.close()


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(ClientError) as info:
        fn()
    return info.value.code


def _generate(client: Client) -> list[int]:
    (c,) = client.complete(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True, timeout=TIMEOUT_S)
    return c.token_ids


# -- TLS -------------------------------------------------------------------------------------
def test_tls_generate_with_the_ca(secure_stack):
    stack = secure_stack()
    assert len(_generate(stack.client)) == 4
    assert stack.client.stats().num_blocks_total == 63


def test_plaintext_client_to_a_tls_server_is_unavailable(secure_stack):
    stack = secure_stack()
    with Client(stack.address, timeout=TIMEOUT_S) as plain:
        assert _code(lambda: plain.stats(timeout=TIMEOUT_S)) == grpc.StatusCode.UNAVAILABLE


def test_a_client_trusting_another_ca_is_refused(secure_stack, pki):
    stack = secure_stack()
    with Client(stack.address, tls_ca=pki["other_ca"]) as c:
        assert _code(lambda: c.stats(timeout=TIMEOUT_S)) == grpc.StatusCode.UNAVAILABLE


def test_server_name_override_for_an_address_not_in_the_certificate(secure_stack, pki):
    stack = secure_stack()
    port = stack.address.rpartition(":")[2]
    # "localhost" is in the certificate; connect by IP but verify the name.
    with Client(f"127.0.0.1:{port}", tls_ca=pki["ca"], tls_server_name="localhost") as c:
        assert c.stats(timeout=TIMEOUT_S).num_blocks_total == 63


# -- mutual TLS ------------------------------------------------------------------------------
def test_mutual_tls_needs_a_client_certificate(secure_stack, pki):
    stack = secure_stack(mtls=True)
    assert len(_generate(stack.client)) == 4  # the stack's client presents client.crt
    with Client(stack.address, tls_ca=pki["ca"]) as no_cert:
        assert _code(lambda: no_cert.stats(timeout=TIMEOUT_S)) == grpc.StatusCode.UNAVAILABLE


# -- bearer token ----------------------------------------------------------------------------
def test_token_missing_or_wrong_is_unauthenticated_on_every_rpc(secure_stack, pki):
    stack = secure_stack(tls=False, token=True)
    assert len(_generate(stack.client)) == 4
    with (
        Client(stack.address) as anonymous,
        Client(stack.address, auth_token_file=pki["wrong_token"]) as wrong,
    ):
        for client in (anonymous, wrong):
            with pytest.raises(ClientError) as info:
                _generate(client)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "not-the-token" not in info.value.details and TOKEN not in info.value.details
            assert _code(lambda c=client: c.stats(timeout=TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda c=client: c.model_info(timeout=TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(ClientError) as info:
            anonymous.stats(timeout=TIMEOUT_S)
        assert "--auth-token-file" in info.value.details  # says what to do


def test_health_and_reflection_answer_without_a_token(secure_stack):
    stack = secure_stack(tls=False, token=True)
    with Client(stack.address) as anonymous:
        assert anonymous.health(timeout=TIMEOUT_S) == "SERVING"
    with grpc.insecure_channel(stack.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT_S
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "pagedkv.v1.Engine" in names


def test_tls_and_token_together_sync_and_async(secure_stack, pki):
    stack = secure_stack(token=True)
    assert len(_generate(stack.client)) == 4
    with Client(stack.address, tls_ca=pki["ca"]) as tls_only:
        assert _code(lambda: tls_only.stats(timeout=TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED

    async def run() -> int:
        async with AsyncClient(stack.address, tls_ca=pki["ca"], auth_token=TOKEN, timeout=TIMEOUT_S) as c:
            (done,) = await c.complete(token_ids=[5, 6], max_tokens=3, ignore_eos=True)
            return len(done.token_ids)

    assert asyncio.run(asyncio.wait_for(run(), TIMEOUT_S)) == 3


# -- the worker link over TCP ----------------------------------------------------------------
def test_worker_link_over_tcp_with_tls_and_token(pki):
    """Unary (Describe) and the plan stream (ExecuteStream) both carry the token over TLS."""
    server_security = ServerSecurity.from_files(pki["server_cert"], pki["server_key"], None, pki["token"])

    async def run():
        servicer = WorkerServicer(SimWorker(num_blocks=32, block_size=16))
        server, address = await create_worker_server("127.0.0.1:0", servicer, security=server_security)
        good = WorkerClient(
            address, security=ClientSecurity.from_files(pki["ca"], auth_token_file=pki["token"])
        )
        no_token = WorkerClient(address, security=ClientSecurity.from_files(pki["ca"]))
        try:
            info = await good.describe(timeout=TIMEOUT_S)
            result = await good.execute(Plan(step_id=1), info.instance_id)
            codes = []
            for call in (no_token.describe(timeout=TIMEOUT_S), no_token.execute(Plan(step_id=2))):
                with pytest.raises(WorkerStepError) as refused:
                    await call
                codes.append(refused.value.code)
            return info, result, codes
        finally:
            for c in (good, no_token):
                await c.close()
            await server.stop(0)
            servicer.close()

    info, result, codes = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert info.num_blocks == 32 and result.step_id == 1
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2


# -- CLI -------------------------------------------------------------------------------------
def test_cli_stats_with_tls_and_a_token(secure_stack, pki, capsys):
    stack = secure_stack(token=True)
    flags = ["--server", stack.address, "--tls-ca", pki["ca"]]
    assert main(["stats", *flags, "--auth-token-file", pki["token"]]) == 0
    assert "KV blocks free / total" in capsys.readouterr().out
    assert main(["stats", *flags]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["stats", *flags, "--auth-token-file", pki["dir"] + "/missing"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_server_flags_parse_on_worker_control_and_serve(pki):
    parser = build_parser()
    tls = ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tls-client-ca", pki["ca"]]
    tls += ["--auth-token-file", pki["token"]]
    for command in (["worker"], ["control"], ["serve"]):
        args = parser.parse_args([*command, *tls])
        assert ServerSecurity.from_args(args).describe() == {"tls": "mutual", "auth": "token"}
    control = parser.parse_args(
        ["control", "--worker-tls-ca", pki["ca"], "--worker-auth-token-file", pki["token"]]
    )
    worker_link = ClientSecurity.from_args(control, prefix="worker_")
    assert worker_link.tls and worker_link.metadata == (("authorization", f"Bearer {TOKEN}"),)


def test_serve_forwards_security_to_the_control_child_only_and_never_prints_the_token(pki, tmp_path):
    argv = ["serve", "--host", "0.0.0.0", "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"]]
    args = build_parser().parse_args([*argv, "--tls-ca", pki["ca"], "--auth-token-file", pki["token"]])
    worker, control, _ = child_commands(args, tmp_path)
    assert "--tls-cert" in control and "--auth-token-file" in control
    assert not any(a.startswith("--tls") or a.startswith("--auth") for a in worker)
    cli, curl = security_hints(args)
    assert f"--tls-ca {pki['ca']}" in cli and "--tls-server-name localhost" in cli
    assert f"-cacert {pki['ca']}" in curl and "authorization: Bearer $(cat" in curl
    assert TOKEN not in cli + curl


# -- validation ------------------------------------------------------------------------------
def test_bad_security_settings_say_what_is_wrong(pki, tmp_path):
    with pytest.raises(ValueError, match="--tls-cert is missing"):
        ServerSecurity.from_files(tls_key=pki["server_key"])
    with pytest.raises(ValueError, match="needs --tls-cert"):
        ServerSecurity.from_files(tls_client_ca=pki["ca"])
    with pytest.raises(ValueError, match="does not exist"):
        ServerSecurity.from_files(str(tmp_path / "nope.crt"), pki["server_key"])
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token(tmp_path / "empty")
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        ClientSecurity.from_files(tls_ca=pki["ca"], tls_cert=pki["client_cert"])
    interceptor = TokenAuthInterceptor(TOKEN)
    assert interceptor.check(f"Bearer {TOKEN}") is None and interceptor.check(f"bearer  {TOKEN} ") is None
    for bad in (None, TOKEN, "Basic abc", "Bearer ", f"Bearer {TOKEN}x"):
        reason = interceptor.check(bad)
        assert reason and TOKEN not in reason


def test_exposure_warning_only_for_open_non_loopback_listeners(pki):
    open_ = ServerSecurity()
    full = ServerSecurity.from_files(pki["server_cert"], pki["server_key"], None, pki["token"])
    assert open_.exposure_warning("127.0.0.1:50051") is None
    assert open_.exposure_warning(":50051") is None
    assert open_.exposure_warning("unix:///run/pagedkv/worker.sock") is None
    assert "TLS or a token" in open_.exposure_warning("0.0.0.0:50051")
    assert full.exposure_warning("0.0.0.0:50051") is None
