"""``hlb agent --source ...`` on the command line: wrong combinations and missing NVML are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlb.cli import main


@pytest.fixture(autouse=True)
def no_logging_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hlb agent`` sets up logging to stdout, which here is the test's captured stream, closed
    after it: later tests would log into it. The commands below run without that setup."""
    monkeypatch.setattr("hlb.daemon.logs.configure_logging", lambda *args, **kwargs: None)


def config(tmp_path: Path) -> str:
    path = tmp_path / "config.yaml"
    path.write_text("cell: c\nlog:\n  format: json\n")
    return str(path)


def test_the_simulator_is_not_combined_with_a_hosts_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agent", "--config", config(tmp_path), "--source", "sim", "--source", "node"]) == 64
    assert "--source sim simulates a whole cluster" in capsys.readouterr().out


def test_an_unknown_source_is_refused_by_the_parser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["agent", "--config", config(tmp_path), "--source", "telegraf"])
    assert exited.value.code == 2
    assert "invalid choice: 'telegraf'" in capsys.readouterr().err


def test_nvml_without_a_driver_or_the_library_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """This machine has no NVIDIA driver (nor, in CI, nvidia-ml-py): the agent exits 1 naming what is missing."""
    if Path("/proc/driver/nvidia").exists():
        pytest.skip("an NVIDIA driver is loaded here: NVML would start")
    assert main(["agent", "--config", config(tmp_path), "--source", "nvml", "--once"]) == 1
    out = capsys.readouterr().out
    assert "hlb agent: NVML: " in out
    assert "nvidia-ml-py is not installed" in out or "is the NVIDIA driver loaded?" in out
