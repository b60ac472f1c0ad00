"""``hlb broker`` (``python -m hlb.sim.kafka_local``): its options work after the action, as the
README writes them, and before it; ``exec`` hands everything after ``--`` to the command. A fake
broker stands in for Kafka's: these tests are about the command line, not the broker."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hlb.cli import main
from hlb.daemon.errors import BrokerError
from hlb.sim import kafka_local
from hlb.sim.kafka_local import LocalBroker as RealBroker  # the fixture below replaces the module's
from hlb.sim.kafka_local import running_pid, stop_by_pid_file


class FakeBroker:
    """Records what ``LocalBroker`` was given; starts nothing."""

    def __init__(self, work_dir: Path, port: int, cache_dir: Path) -> None:
        self.work_dir, self.port, self.cache_dir = work_dir, port or 39092, cache_dir
        self.process: object = None
        self.started = self.stopped = False

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.started = True
        self.process = object()

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture(autouse=True)
def brokers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[FakeBroker]:
    """The brokers the command makes, in order. Every test runs with it, so that a command line
    read wrongly can neither start a real broker nor stop one outside ``tmp_path``."""
    made: list[FakeBroker] = []

    def make(work_dir: Path, port: int, cache_dir: Path) -> FakeBroker:
        made.append(FakeBroker(work_dir, port, cache_dir))
        return made[-1]

    def stop_in_tmp_path(work_dir: Path, timeout_s: float = 30.0) -> bool:
        assert work_dir.resolve().is_relative_to(tmp_path.resolve()), f"would stop the broker of {work_dir}"
        return stop_by_pid_file(work_dir, timeout_s)

    monkeypatch.setattr(kafka_local, "LocalBroker", make)
    monkeypatch.setattr(kafka_local, "stop_by_pid_file", stop_in_tmp_path)
    return made


def test_start_takes_its_options_after_the_action(
    brokers: list[FakeBroker], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["broker", "start", "--dir", str(tmp_path), "--port", "19092", "--cache", str(tmp_path / "c")]) == 0
    (broker,) = brokers
    assert (broker.work_dir, broker.port, broker.cache_dir) == (tmp_path, 19092, tmp_path / "c")
    assert broker.started
    assert not broker.stopped  # left running in the background
    assert capsys.readouterr().out == "127.0.0.1:19092\n"


def test_options_before_the_action_still_work_and_later_ones_win(brokers: list[FakeBroker], tmp_path: Path) -> None:
    assert main(["broker", "--dir", str(tmp_path / "a"), "--port", "19093", "start"]) == 0
    assert main(["broker", "--dir", str(tmp_path / "a"), "start", "--dir", str(tmp_path / "b")]) == 0
    first, second = brokers
    assert (first.work_dir, first.port) == (tmp_path / "a", 19093)
    assert (second.work_dir, second.port) == (tmp_path / "b", 39092)


def test_exec_runs_the_command_after_the_separator_with_the_brokers_address(
    brokers: list[FakeBroker], tmp_path: Path
) -> None:
    """As `make test` calls it: ``exec -- $(PY) -m pytest $(PYTEST_ARGS)``; the command's own
    options (here ``--dir``, ``-c``) are the command's, not the broker's."""
    check = "import os, sys; sys.exit(0 if os.environ['HLB_TEST_KAFKA_BOOTSTRAP'] == sys.argv[2] else 3)"
    assert main(["broker", "exec", "--", sys.executable, "-c", check, "--dir", "127.0.0.1:39092"]) == 0
    assert main(["broker", "exec", "--port", "19094", "--", sys.executable, "-c", "raise SystemExit(7)"]) == 7
    first, second = brokers
    assert first.work_dir == kafka_local.DEFAULT_CACHE / "run"
    assert second.port == 19094
    assert [first.stopped, second.stopped] == [True, True]


def test_stop_with_nothing_to_stop_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["broker", "stop", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == f"hlb broker: nothing to stop: no broker runs from {tmp_path} (no broker.pid there)\n"


def test_stop_with_a_pid_file_that_holds_no_pid_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broker.pid").write_text("not a pid\n")
    assert main(["broker", "stop", "--dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"hlb broker: {tmp_path / 'broker.pid'} holds no process id")


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["start", "--port", "70000"], "argument --port: 70000 is out of range"),
        (["stop", "--port", "9092"], "unrecognized arguments: --port 9092"),
        ([], "the following arguments are required: ACTION"),
    ],
)
def test_bad_command_lines_are_refused(capsys: pytest.CaptureFixture[str], args: list[str], error: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["broker", *args])
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_a_broker_running_from_a_folder_is_not_wiped_by_a_second_start(tmp_path: Path) -> None:
    """A second ``start`` on the folder of a running broker would format its storage: refused."""
    # A stand-in process whose command line names the broker's main class, as a real broker's does.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "kafka.Kafka"])
    try:
        _wait_for_exec(stand_in.pid, b"kafka.Kafka")
        (tmp_path / "broker.pid").write_text(f"{stand_in.pid}\n")
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "meta.properties").write_text("kept")
        assert running_pid(tmp_path) == stand_in.pid
        with pytest.raises(BrokerError, match=f"a broker already runs from {tmp_path} \\(pid {stand_in.pid}\\)"):
            RealBroker(tmp_path, 0, tmp_path / "cache").start()
        assert (tmp_path / "data" / "meta.properties").read_text() == "kept"
    finally:
        stand_in.kill()
        stand_in.wait()
    assert running_pid(tmp_path) is None  # a stale pid file is no running broker


def test_a_pid_file_naming_another_program_is_no_running_broker(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _wait_for_exec(other.pid, b"time.sleep")
        (tmp_path / "broker.pid").write_text(f"{other.pid}\n")
        assert running_pid(tmp_path) is None
    finally:
        other.kill()
        other.wait()


def _wait_for_exec(pid: int, marker: bytes) -> None:
    """Until the child's command line (read where ``running_pid`` reads it) is its own, not the
    forking parent's: right after ``Popen`` it may not have executed its program yet."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    deadline = time.monotonic() + 10.0
    while cmdline.exists() and marker not in cmdline.read_bytes():
        assert time.monotonic() < deadline, f"process {pid} did not start its program"
        time.sleep(0.01)


FAKE_MAVEN = """#!/bin/sh
# Maven's batch-mode lines for two downloads, then the jar where copy-dependencies puts it.
echo "[INFO] Downloading from central: https://repo.example/org/apache/kafka/kafka-clients-4.1.1.jar"
echo "[INFO] Downloaded from central: https://repo.example/org/apache/kafka/kafka-clients-4.1.1.jar (12 MB at 3.1 MB/s)"
echo "[INFO] Downloaded from central: https://repo.example/org/apache/kafka/kafka-4.1.1.pom (4.2 kB at 90 kB/s)"
echo "[INFO] Downloaded from central: https://repo.example/org/apache/kafka/kafka_2.13-4.1.1.jar (6.1 MB at 2 MB/s)"
for arg in "$@"; do
  case "$arg" in -DoutputDirectory=*) touch "${arg#-DoutputDirectory=}/kafka_2.13-4.1.1.jar" ;; esac
done
"""


def test_fetch_says_what_maven_downloads_while_it_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hlb broker fetch`` was silent for the minutes a cold Maven cache takes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    maven = bin_dir / "mvn"
    maven.write_text(FAKE_MAVEN)
    maven.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    lines: list[str] = []
    libs = kafka_local.fetch(tmp_path / "cache", progress=lines.append)
    assert lines[0].startswith(f"fetching Apache Kafka {kafka_local.KAFKA_VERSION}'s jars with Maven into ")
    assert lines[1:3] == ["  [1] kafka-clients-4.1.1.jar (12 MB)", "  [2] kafka_2.13-4.1.1.jar (6.1 MB)"]
    assert lines[3] == f"Kafka's jars are in {libs} (2 downloaded, 1 in all)"
    assert kafka_local.fetch(tmp_path / "cache", progress=lines.append) == libs  # fetched once: nothing more said
    assert len(lines) == 4
