"""systemd/hlb-learn.service is a valid unit for the learner, hardened at least as well as
hlb.service by systemd 252's own score, running ``hlb learn --watch --publish`` as a dynamic user
with a state directory for its candidate, and below the daemon's CPU share."""

from __future__ import annotations

import argparse
from pathlib import Path

from hlb.export import learn_cli
from tests.systemd.test_unit import (
    HARDENING,
    UNIT,
    exposure,
    needs_systemd_analyze,
    run_analyze,
    unit_settings,
)
from tests.systemd.test_unit import verifiable_copy as unit_copy

LEARN_UNIT = UNIT.parent / "hlb-learn.service"
ARGUMENTS = "learn --config /etc/hlb/config.yaml --watch --interval-s 3600 --publish --out %S/hlb-learn/candidate"
INSTALLED_EXEC_START = f"ExecStart=/opt/hlb/venv/bin/hlb {ARGUMENTS}"


def verifiable_copy(tmp_path: Path) -> Path:
    return unit_copy(tmp_path, LEARN_UNIT, INSTALLED_EXEC_START)


@needs_systemd_analyze
def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    result = run_analyze("verify", str(verifiable_copy(tmp_path)))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@needs_systemd_analyze
def test_verify_catches_a_misspelt_key_in_the_learners_unit(tmp_path: Path) -> None:
    copy = verifiable_copy(tmp_path)
    copy.write_text(copy.read_text().replace("CPUWeight=20", "CPUWieght=20"))
    assert "Unknown key 'CPUWieght'" in run_analyze("verify", str(copy)).stderr


@needs_systemd_analyze
def test_security_exposure_is_no_worse_than_the_daemons() -> None:
    learner, daemon = exposure(LEARN_UNIT), exposure(UNIT)
    assert learner <= daemon, f"hlb-learn.service exposure {learner} is above hlb.service's {daemon}"


def test_required_settings_are_present() -> None:
    unit = unit_settings(LEARN_UNIT.read_text())
    service = unit["Service"]
    required = {
        "Type": ["exec"],
        "ExecStart": [INSTALLED_EXEC_START.removeprefix("ExecStart=")],
        "Restart": ["on-failure"],
        "RestartPreventExitStatus": ["78 2"],
        "DynamicUser": ["yes"],
        "StateDirectory": ["hlb-learn"],
        "ConfigurationDirectory": ["hlb"],
        "SyslogIdentifier": ["hlb-learn"],
        "Nice": ["10"],
        **HARDENING,
    }
    assert {key: service.get(key) for key in required} == required
    assert "User" not in service
    # The daemon's weight is systemd's default, 100: the learner yields to it on a shared host.
    assert int(service["CPUWeight"][-1]) < 100


def test_the_command_line_is_one_hlb_learn_accepts() -> None:
    parser = argparse.ArgumentParser()
    learn_cli.add_arguments(parser)
    args = parser.parse_args(ARGUMENTS.split()[1:])
    assert (args.watch, args.publish, args.interval_s) == (True, True, 3600.0)
    assert args.config == Path("/etc/hlb/config.yaml")
