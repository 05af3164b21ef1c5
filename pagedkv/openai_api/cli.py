"""`pagedkv openai`: the OpenAI-compatible HTTP front as its own process, and the hooks that
let `pagedkv serve --http-port P` run it as a third supervised child.

    pagedkv openai --engine 127.0.0.1:50051 --port 8000 [--model DIR | --chat-template FILE]

Security mirrors the gRPC side: `--api-key-file` requires `Authorization: Bearer <key>` (what
the openai SDK sends as api_key), `--tls-cert/--tls-key [--tls-client-ca]` serve HTTPS, and
`--engine-*` flags say how to reach a secured Engine. `serve` passes its own TLS files and
token to both sides, so `--http-port` never opens an unauthenticated door beside a secured
gRPC port. Exit status: 0 after SIGINT/SIGTERM, 1 when it cannot start (port in use), 2 for
bad flags or unreadable files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from pagedkv.cli_flags import (
    add_client_security_flags,
    add_lifecycle_flags,
    own_tls_server_name,
    port_number,
)

DEFAULT_ENGINE = os.environ.get("PAGEDKV_SERVER", "127.0.0.1:50051")
DEFAULT_HTTP_PORT = 8000
HTTP_CHILD = "openai"  # the supervisor's name for the front's process
RANDOM_MODEL_PREFIX = "random:"  # `--model random:PRESET`: a random-weight model, byte tokenizer, no dir


def add_openai_parser(sub) -> argparse.ArgumentParser:
    """The `openai` subcommand (cli.py calls this while building its parser)."""
    p = sub.add_parser(
        "openai",
        help="run the OpenAI-compatible HTTP front (a client of the Engine)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="The OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) "
        "over a running Engine; see docs/OPENAI.md.",
    )
    p.add_argument("--engine", default=DEFAULT_ENGINE, help="the Engine's address (HOST:PORT, unix:///path)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen host")
    p.add_argument(
        "--port", type=port_number, default=DEFAULT_HTTP_PORT, help="HTTP listen port (0: any free port)"
    )
    p.add_argument("--model", metavar="DIR", help="the served checkpoint dir: its chat template (and name)")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template (instead of the model dir's)")
    p.add_argument("--api-key-file", metavar="FILE", help="require 'Authorization: Bearer <key in FILE>'")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM certificate: serve HTTPS")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", metavar="FILE", help="HTTPS with client certificates signed by this CA")
    add_client_security_flags(p, prefix="engine-", what="the Engine")
    p.add_argument(
        "--engine-tls-server-name", metavar="NAME", help="name to verify in the Engine's certificate"
    )
    add_lifecycle_flags(p)
    return p


def add_serve_http_flags(s: argparse.ArgumentParser) -> None:
    """`serve`'s flags for the front (none given: no HTTP)."""
    s.add_argument(
        "--http-port",
        type=port_number,
        metavar="P",
        help="also run the OpenAI-compatible HTTP front on P (0: any free port); default: no HTTP",
    )
    s.add_argument("--http-host", metavar="HOST", help="HTTP listen host (default: --host)")
    s.add_argument("--chat-template", metavar="FILE", help="HTTP chat template (default: the model dir's)")


def build_front(args):
    """The Front and the uvicorn.Config for parsed `openai` flags (ValueError: bad flags/files)."""
    from base.security import ClientSecurity, read_token
    from pagedkv.openai_api.chat_template import load_chat_template
    from pagedkv.openai_api.front import Front

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("HTTPS needs both --tls-cert and --tls-key")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    security = ClientSecurity.from_files(
        args.engine_tls_ca,
        args.engine_tls_cert,
        args.engine_tls_key,
        args.engine_tls_server_name,
        args.engine_auth_token_file,
    )
    model_dir = args.model if args.model and not args.model.startswith(RANDOM_MODEL_PREFIX) else None
    aliases = (args.model, args.model.rstrip("/")) if args.model else ()
    return Front(
        args.engine,
        security=security,
        chat_template=load_chat_template(model_dir, args.chat_template),
        model_aliases=aliases,
        api_key=read_token(args.api_key_file) if args.api_key_file else None,
    )


def uvicorn_config(app, args):
    import ssl

    import uvicorn

    tls = {}
    if args.tls_cert:
        tls = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
        if args.tls_client_ca:
            tls.update(ssl_ca_certs=args.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # uvicorn's records go through base.logs like every other line
        access_log=False,
        timeout_graceful_shutdown=args.shutdown_grace,
        **tls,
    )


async def _serve(server, args) -> None:
    """Run uvicorn; once it listens, write the ready file with the real address."""
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started and args.ready_file:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        scheme = "https" if args.tls_cert else "http"
        ready = {"address": f"{host}:{port}", "url": f"{scheme}://{host}:{port}/v1", "pid": os.getpid()}
        tmp = Path(args.ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(ready))
        os.replace(tmp, args.ready_file)
    await serving


def run_openai(args) -> int:
    from base.logs import configure_logging, get_logger
    from pagedkv.supervisor import die_with_parent

    die_with_parent()
    configure_logging(args.log_format, args.log_level)
    log = get_logger("pagedkv.openai")
    try:
        import uvicorn

        from pagedkv.openai_api.app import create_app
    except ImportError as e:
        log.error("openai.missing_dependency", error=str(e), fix="pip install 'pagedkv[http]'")
        return 2
    try:
        front = build_front(args)
    except ValueError as e:
        log.error("openai.start_failed", error=str(e))
        return 2
    server = uvicorn.Server(uvicorn_config(create_app(front), args))
    log.info(
        "openai.starting",
        host=args.host,
        port=args.port,
        engine=args.engine,
        api_key=front.api_key is not None,
    )
    asyncio.run(_serve(server, args))
    return 0 if server.started else 1


# -- serve --http-port ---------------------------------------------------------------------
def serve_child_command(args, engine_address: str, ready_file: Path) -> list[str]:
    """The `pagedkv openai` command line `serve` runs: its model dir, chat template, TLS files
    and token on the HTTP side, and the same ones as a client of its own Engine port."""
    cmd = [sys.executable, "-m", "pagedkv.cli", "openai", "--engine", engine_address]
    cmd += [
        "--host",
        args.http_host or args.host,
        "--port",
        str(args.http_port),
        "--ready-file",
        str(ready_file),
    ]
    cmd += ["--log-format", args.log_format, "--log-level", args.log_level]
    cmd += ["--shutdown-grace", str(args.shutdown_grace)]
    for flag, value in (("--model", args.model), ("--chat-template", args.chat_template)):
        if value:
            cmd += [flag, value]
    if args.tls_cert:
        cmd += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
        cmd += ["--engine-tls-ca", args.tls_ca or args.tls_cert]
        name = own_tls_server_name(args)
        if name:
            cmd += ["--engine-tls-server-name", name]
        if args.tls_client_ca:
            cmd += ["--tls-client-ca", args.tls_client_ca]
            cmd += ["--engine-tls-cert", args.tls_cert, "--engine-tls-key", args.tls_key]
    if args.auth_token_file:
        cmd += ["--api-key-file", args.auth_token_file, "--engine-auth-token-file", args.auth_token_file]
    return cmd


def _wait_http_ready(sup, ready_file: Path, timeout_s: float) -> str | None:
    """The front's base URL once it listens; None if a child died, we were stopped, or time ran out."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not sup.stop_requested.is_set():
        if sup.first_exited() is not None:
            return None
        if ready_file.exists():
            return json.loads(ready_file.read_text())["url"]
        sup.stop_requested.wait(0.05)
    return None


def start_http_front(sup, args, engine_address: str, tmpdir: Path, timeout_s: float = 120.0) -> bool:
    """serve --http-port: start the front as the supervisor's third child, wait until it
    listens and print its URL and a curl line; False (reason on stderr) if it did not start."""
    ready = tmpdir / "openai.json"
    sup.add(HTTP_CHILD, serve_child_command(args, engine_address, ready))
    url = _wait_http_ready(sup, ready, timeout_s)
    if url is None:
        if not sup.stop_requested.is_set():
            exited = sup.first_exited()
            why = (
                f"exited ({exited[0]}: status {exited[1]})"
                if exited
                else f"did not start in {timeout_s:.0f}s"
            )
            print(f"[serve] the OpenAI HTTP front {why}; see its log above; stopping", file=sys.stderr)
        return False
    auth = ' -H "authorization: Bearer $(cat KEYFILE)"' if args.auth_token_file else ""
    body = json.dumps({"prompt": "Hello, pagedkv", "max_tokens": 16})
    print(f"OpenAI-compatible HTTP API: {url}  (docs/OPENAI.md)", flush=True)
    print(f"  curl -s {url}/completions -H 'content-type: application/json'{auth} -d '{body}'", flush=True)
    return True
