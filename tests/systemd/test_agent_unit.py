"""systemd/hlb-agent.service is a valid notify unit, hardened at least as well as hlb.service by
systemd 252's own score, with no root and only the NVIDIA devices visible."""

from __future__ import annotations

from pathlib import Path

from tests.systemd.test_unit import (
    HARDENING,
    UNIT,
    exposure,
    needs_systemd_analyze,
    run_analyze,
    unit_settings,
)
from tests.systemd.test_unit import verifiable_copy as unit_copy

AGENT_UNIT = UNIT.parent / "hlb-agent.service"
INSTALLED_EXEC_START = "ExecStart=/opt/hlb/venv/bin/hlb agent --source host --config /etc/hlb/config.yaml"


def verifiable_copy(tmp_path: Path) -> Path:
    return unit_copy(tmp_path, AGENT_UNIT, INSTALLED_EXEC_START)


@needs_systemd_analyze
def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    result = run_analyze("verify", str(verifiable_copy(tmp_path)))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@needs_systemd_analyze
def test_verify_catches_a_misspelt_key_in_the_agents_unit(tmp_path: Path) -> None:
    copy = verifiable_copy(tmp_path)
    copy.write_text(copy.read_text().replace("DevicePolicy=closed", "DevicePolicyy=closed"))
    assert "Unknown key 'DevicePolicyy'" in run_analyze("verify", str(copy)).stderr


@needs_systemd_analyze
def test_security_exposure_is_no_worse_than_the_daemons() -> None:
    agent, daemon = exposure(AGENT_UNIT), exposure(UNIT)
    assert agent <= daemon, f"hlb-agent.service exposure {agent} is above hlb.service's {daemon}"


def test_required_settings_are_present() -> None:
    unit = unit_settings(AGENT_UNIT.read_text())
    service = unit["Service"]
    # The daemon's hardening set, but the devices: not hidden wholesale, closed to all but NVIDIA's.
    hardening = {key: values for key, values in HARDENING.items() if key != "PrivateDevices"}
    required = {
        "Type": ["notify"],
        "ExecStart": [INSTALLED_EXEC_START.removeprefix("ExecStart=")],
        "Restart": ["on-failure"],
        "WatchdogSec": ["60s"],
        "RestartPreventExitStatus": ["78"],
        "DynamicUser": ["yes"],
        "ConfigurationDirectory": ["hlb"],
        "SyslogIdentifier": ["hlb-agent"],
        "PrivateDevices": ["no"],
        "DevicePolicy": ["closed"],
        "DeviceAllow": ["/dev/nvidiactl rw", "char-nvidia-frontend rw", "char-nvidia rw"],
        **hardening,
    }
    assert {key: service.get(key) for key in required} == required
    assert "User" not in service  # no root, and no fixed account either
    assert "StateDirectory" not in service  # the agent keeps no state
