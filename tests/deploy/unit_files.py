"""Reading deploy/systemd the way systemd does, for tests: unit settings (with `\\`
continuation lines), the EnvironmentFile, and ExecStart= variable expansion
(systemd.service(5), "Command lines": `${VAR}` is one argument, a bare `$VAR` word is split
at whitespace and may vanish when empty)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYSTEMD_DIR = REPO / "deploy" / "systemd"
INSTALL_PREFIX = "/opt/pagedkv"
ENV_FILE = "/etc/pagedkv/pagedkv.env"


def unit_settings(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) in file order; continuation lines joined, comments dropped."""
    settings, section, pending = [], "", ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a KEY=VALUE line: {line!r}"
        settings.append((section, key.strip(), value.strip()))
    return settings


def setting(path: Path, key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in unit_settings(path) if (s, k) == (section, key)]


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"bad env line {line!r}"
        assert " #" not in value, f"{key}: a trailing comment would become part of the value"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key] = value
    return env


def expand_command(line: str, env: dict[str, str]) -> list[str]:
    """argv of an Exec*= line. Unknown variables raise KeyError (systemd would silently
    substitute nothing, which is exactly the typo a test must catch)."""
    argv = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$\{(\w+)\}", word)
        split = re.fullmatch(r"\$(\w+)", word)
        if whole:
            argv.append(env[whole.group(1)])
        elif split:
            argv.extend(env[split.group(1)].split())
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv
