"""The ``hlb`` entry point: one command with subcommands, each with --help, loaded lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hlb.cli import COMMANDS, main


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"  {name}" in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    assert f"usage: hlb {name}" in capsys.readouterr().out


def test_an_unknown_command_fails_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_the_place_client_does_not_load_kafka_or_the_simulator() -> None:
    code = (
        "import sys; from hlb.cli import main\n"
        "try: main(['place', '--help'])\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('confluent_kafka', 'sim', 'torch')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip().splitlines()[-1] == "[]"
