"""deploy/systemd: `systemd-analyze verify` accepts the units and drop-ins, every variable
the command lines use is set in pagedkv.env, and the commands parse with pagedkv's CLI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import build_parser
from tests.deploy.unit_files import (
    ENV_FILE,
    INSTALL_PREFIX,
    REPO,
    SYSTEMD_DIR,
    expand_command,
    read_env_file,
    setting,
)

UNITS = ("pagedkv-worker.service", "pagedkv-control.service")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _systemd_version() -> int:
    out = subprocess.run([SYSTEMD_ANALYZE, "--version"], capture_output=True, text=True, check=True).stdout
    return int(re.match(r"systemd (\d+)", out).group(1))


def _install_for_verify(tmp_path: Path, dropins: dict[str, list[str]]) -> list[Path]:
    """The units as installed, but under tmp_path: /opt/pagedkv is a prefix whose binaries
    exist (verify checks that ExecStart= is executable) and the env file is the shipped one."""
    prefix = tmp_path / "prefix"
    (prefix / ".venv" / "bin").mkdir(parents=True)
    (prefix / "deploy").mkdir()
    for name in ("pagedkv", "python"):
        (prefix / ".venv" / "bin" / name).symlink_to(Path(sys.executable).parent / name)
    (prefix / "deploy" / "healthcheck.py").symlink_to(REPO / "deploy" / "healthcheck.py")
    units_dir = tmp_path / "units"
    units_dir.mkdir()
    paths = []
    for unit in UNITS:
        text = (SYSTEMD_DIR / unit).read_text()
        text = text.replace(INSTALL_PREFIX, str(prefix)).replace(ENV_FILE, str(SYSTEMD_DIR / "pagedkv.env"))
        (units_dir / unit).write_text(text)
        paths.append(units_dir / unit)
        for conf in dropins.get(unit, []):
            d = units_dir / f"{unit}.d"
            d.mkdir(exist_ok=True)
            shutil.copy(SYSTEMD_DIR / "dropins" / conf, d / conf)
    return paths


def _verify(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", "--generators=no", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt install systemd)")
def test_units_and_jetson_dropin_verify_clean(tmp_path):
    paths = _install_for_verify(tmp_path, {"pagedkv-worker.service": ["jetson-devices.conf"]})
    result = _verify(paths)
    # verify exits 0 on unknown keys and only prints them: any output at all is a finding.
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt install systemd)")
def test_restart_backoff_dropin(tmp_path):
    dropin = ["restart-backoff.conf"]
    paths = _install_for_verify(tmp_path, {unit: dropin for unit in UNITS})
    result = _verify(paths)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    if _systemd_version() >= 254:
        assert output == ""
    else:  # install.sh installs it only on >= 254; older versions know exactly these two keys not
        unknown = set(re.findall(r"Unknown key '(\w+)'", output))
        assert unknown == {"RestartSteps", "RestartMaxDelaySec"}, output


def test_control_requires_and_follows_the_worker():
    control = SYSTEMD_DIR / "pagedkv-control.service"
    assert "pagedkv-worker.service" in setting(control, "Requires", "Unit")
    assert "pagedkv-worker.service" in " ".join(setting(control, "After", "Unit"))
    for unit in UNITS:
        path = SYSTEMD_DIR / unit
        assert setting(path, "User") == ["pagedkv"] and setting(path, "NoNewPrivileges") == ["yes"]
        assert setting(path, "ProtectSystem") == ["strict"] and setting(path, "PrivateTmp") == ["yes"]
        assert setting(path, "Restart") == ["on-failure"] and setting(path, "RuntimeDirectory") == ["pagedkv"]
        assert setting(path, "EnvironmentFile") == [ENV_FILE]
    sysusers = (SYSTEMD_DIR / "pagedkv.sysusers").read_text()
    assert re.search(r"^u pagedkv ", sysusers, re.MULTILINE)
    worker = SYSTEMD_DIR / "pagedkv-worker.service"
    assert setting(worker, "DevicePolicy") == ["closed"]
    jetson = (SYSTEMD_DIR / "dropins" / "jetson-devices.conf").read_text()
    assert "DeviceAllow=/dev/nvmap rw" in jetson and "DeviceAllow=/dev/nvhost-ctrl-gpu rw" in jetson


def test_exec_lines_use_only_settings_from_the_env_file_and_parse():
    env = read_env_file(SYSTEMD_DIR / "pagedkv.env")
    parser = build_parser()
    for unit, command in (("pagedkv-worker.service", "worker"), ("pagedkv-control.service", "control")):
        path = SYSTEMD_DIR / unit
        (start,) = setting(path, "ExecStart")
        argv = expand_command(start, env)  # KeyError names a variable pagedkv.env lacks
        assert argv[:2] == [f"{INSTALL_PREFIX}/.venv/bin/pagedkv", command]
        args = parser.parse_args(argv[1:])
        assert args.log_format == env["PAGEDKV_LOG_FORMAT"]
        (post,) = setting(path, "ExecStartPost")
        probe = expand_command(post, env)
        assert probe[1] == f"{INSTALL_PREFIX}/deploy/healthcheck.py"
        assert probe[-1] == (env["PAGEDKV_WORKER_ADDR"] if command == "worker" else env["PAGEDKV_LISTEN"])
    worker_args = parser.parse_args(expand_command(setting(SYSTEMD_DIR / UNITS[0], "ExecStart")[0], env)[1:])
    assert worker_args.listen == env["PAGEDKV_WORKER_ADDR"].strip() and worker_args.listen.startswith(
        "unix:///run/pagedkv/"
    )
    assert worker_args.kv_cache_memory == 2 * 2**30 and worker_args.device == "cuda"
