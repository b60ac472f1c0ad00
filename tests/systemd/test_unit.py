"""systemd/hlb.service is a valid, hardened notify unit, as systemd 252 itself judges it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hlb.daemon.runtime.sdnotify import START_EXTEND_EVERY_S, START_EXTENSION_S

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "hlb.service"
INSTALLED_EXEC_START = "ExecStart=/opt/hlb/venv/bin/hlb serve --config /etc/hlb/config.yaml"

# Exposure score x10 that the unit must not exceed. Measured: 1.4 ("OK") with systemd 252, i.e.
# 14; one notch of headroom for scoring changes between releases. Losing the system-call filter
# or the empty capability set (3.0, 3.2) fails it; single settings worth 0.1-0.5 may not, so
# HARDENING below checks those one by one.
SECURITY_THRESHOLD = 15

# The hardening set of the engineering notes (section 4.2). MemoryDenyWriteExecute= is left out
# on purpose (see the unit and the last test).
HARDENING = {
    "NoNewPrivileges": ["yes"],
    "ProtectSystem": ["strict"],
    "ProtectHome": ["yes"],
    "PrivateTmp": ["yes"],
    "PrivateDevices": ["yes"],
    "ProtectKernelTunables": ["yes"],
    "ProtectKernelModules": ["yes"],
    "ProtectKernelLogs": ["yes"],
    "ProtectControlGroups": ["yes"],
    "ProtectClock": ["yes"],
    "ProtectHostname": ["yes"],
    "ProtectProc": ["invisible"],
    "ProcSubset": ["pid"],
    "RestrictAddressFamilies": ["AF_UNIX AF_INET AF_INET6"],
    "RestrictNamespaces": ["yes"],
    "RestrictRealtime": ["yes"],
    "RestrictSUIDSGID": ["yes"],
    "LockPersonality": ["yes"],
    "SystemCallArchitectures": ["native"],
    "SystemCallFilter": ["@system-service", "~@privileged @resources"],
    "CapabilityBoundingSet": [""],
    "AmbientCapabilities": [""],
    "UMask": ["0077"],
}

# Resident memory the design allows at 100,000 devices (docs/design.md §7, `hlb bench scale`'s
# target; measured 543 MB, docs/performance.md).
DESIGN_RSS_BYTES = 1024 * 1024**2
# A full queue: scheduler.max_pending's default (config.yaml) times the memory of a queued task
# (`hlb bench queue`: 2.0 KB from 10,000 to 1,000,000 queued, docs/performance.md).
FULL_QUEUE_BYTES = 1_000_000 * 2 * 1024

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian package: systemd)"
)


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values in file order; enough of systemd's syntax for this unit."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def size_bytes(value: str) -> int:
    """A systemd size (``512M``, ``2G``; K, M, G and T are powers of 1024) in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT]?)", value)
    assert match is not None, f"not a plain size: {value!r}"
    return int(match[1]) << 10 * " KMGT".index(match[2] or " ")


def seconds(value: str) -> float:
    """A systemd time span in plain seconds or minutes (``120s``, ``120``, ``10min``) in seconds."""
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match is not None, f"not a plain time span: {value!r}"
    return int(match[1]) * (60 if match[2] == "min" else 1)


def start_timeout_s() -> float:
    """The unit's TimeoutStartSec=, in seconds."""
    return seconds(unit_settings(UNIT.read_text())["Service"]["TimeoutStartSec"][-1])


def verifiable_copy(tmp_path: Path, unit: Path = UNIT, installed: str = INSTALLED_EXEC_START) -> Path:
    """``unit`` with its ExecStart= (``installed``) pointing at an executable that exists here.

    `systemd-analyze verify` fails when ExecStart='s binary is missing, and /opt/hlb/venv is the
    production install, absent on a development or CI machine. The interpreter running the tests
    has the same package importable, so `python -m hlb.cli` stands in for the `hlb` script.
    Only that line changes; the file keeps its name, which verify reads as the unit name.
    """
    text = unit.read_text()
    assert text.count(installed + "\n") == 1, "ExecStart= changed; update this test"
    stand_in = installed.replace("/opt/hlb/venv/bin/hlb ", f"{sys.executable} -m hlb.cli ", 1)
    copy = tmp_path / unit.name
    copy.write_text(text.replace(installed, stand_in))
    return copy


def exposure(unit: Path) -> float:
    """systemd-analyze's offline exposure score of ``unit`` (lower is better hardened)."""
    result = run_analyze("security", "--offline=yes", str(unit))
    score = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\S+)", result.stdout)
    assert score is not None, result.stdout + result.stderr
    return float(score[1])


def run_analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=60, check=False)


@needs_systemd_analyze
def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    # Exit code alone is not enough: systemd 252 exits 0 for unknown keys and values
    # ("Unknown key 'NoNewPrivilegs' ... ignoring"), so any output at all is a failure.
    result = run_analyze("verify", str(verifiable_copy(tmp_path)))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_a_misspelt_key(tmp_path: Path) -> None:
    # Guards the check above: the verifier must actually see our file and complain.
    copy = verifiable_copy(tmp_path)
    copy.write_text(copy.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilegs=yes"))
    result = run_analyze("verify", str(copy))
    assert "Unknown key 'NoNewPrivilegs'" in result.stderr


@needs_systemd_analyze
def test_security_exposure_stays_within_threshold() -> None:
    result = run_analyze("security", "--offline=yes", f"--threshold={SECURITY_THRESHOLD}", str(UNIT))
    score = re.search(r"Overall exposure level for hlb\.service: (\S+)", result.stdout)
    assert score is not None, result.stdout + result.stderr
    assert result.returncode == 0, f"exposure {score[1]} is above {SECURITY_THRESHOLD / 10}"


def test_required_settings_are_present() -> None:
    unit = unit_settings(UNIT.read_text())
    service = unit["Service"]
    required = {
        "Type": ["notify"],
        "ExecStart": [INSTALLED_EXEC_START.removeprefix("ExecStart=")],
        "ExecReload": ["/bin/kill -HUP $MAINPID"],
        "Restart": ["on-failure"],
        "WatchdogSec": ["30s"],
        "RestartPreventExitStatus": ["78"],
        "DynamicUser": ["yes"],
        "StateDirectory": ["hlb"],
        "ConfigurationDirectory": ["hlb"],
        "SyslogIdentifier": ["hlb"],
        "MemoryHigh": ["3G"],
        "MemoryMax": ["4G"],
        **HARDENING,
    }
    assert {key: service.get(key) for key in required} == required
    for key in ["RestartSec", "TimeoutStartSec", "TimeoutStopSec", "LimitNOFILE"]:
        assert key in service, key
    for key in ["StartLimitIntervalSec", "StartLimitBurst"]:
        assert key in unit["Unit"], key


def test_memory_deny_write_execute_is_not_set() -> None:
    # It would break libffi and JIT users at run time, where no test here would notice.
    assert "MemoryDenyWriteExecute" not in unit_settings(UNIT.read_text())["Service"]


def test_memory_is_bounded_above_the_design_size_with_a_full_queue() -> None:
    service = unit_settings(UNIT.read_text())["Service"]
    high, limit = size_bytes(service["MemoryHigh"][-1]), size_bytes(service["MemoryMax"][-1])
    # A daemon of the design's size with a full queue is not throttled, let alone killed...
    assert high >= DESIGN_RSS_BYTES + FULL_QUEUE_BYTES
    # ...and between throttling and the OOM kill there is room for a peak to pass.
    assert high <= 0.8 * limit


def test_start_timeout_extension_is_what_the_unit_says() -> None:
    # Each EXTEND_TIMEOUT_USEC= asks for the whole start timeout again, often enough that a late
    # message costs nothing; the unit's comment names both numbers.
    assert start_timeout_s() == START_EXTENSION_S
    assert START_EXTEND_EVERY_S <= START_EXTENSION_S / 4
    text = UNIT.read_text()
    assert f"EXTEND_TIMEOUT_USEC={int(START_EXTENSION_S * 1_000_000)}" in text
    assert f"every {START_EXTEND_EVERY_S:g} s" in text
