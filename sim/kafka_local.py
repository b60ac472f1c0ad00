"""A real, single-node Apache Kafka broker (KRaft) on loopback, for tests and the demo.

The broker runs from Apache Kafka's own jars, resolved with Maven from Maven Central into an
ignored cache folder (``.cache/kafka``), so a fresh machine needs only Java 17 and Maven::

    python -m hlb.sim.kafka_local fetch                 # resolve the jars once
    python -m hlb.sim.kafka_local exec -- pytest        # start a broker, run a command, stop it
    python -m hlb.sim.kafka_local start --dir .cache/kafka/run --port 9092   # in the background
    python -m hlb.sim.kafka_local stop --dir .cache/kafka/run

(``hlb broker ...`` is the same command.) The options go after the action, or before it; with
``exec`` the command to run comes last, after ``--``. ``exec`` sets ``HLB_TEST_KAFKA_BOOTSTRAP``
and ``HLB_KAFKA__BOOTSTRAP_SERVERS`` for the command.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from hlb.daemon.errors import BrokerError

PACKAGE_DIR = Path(__file__).resolve().parent / "kafka"
DEFAULT_CACHE = Path(os.environ.get("HLB_KAFKA_CACHE", ".cache/kafka"))
KAFKA_VERSION = "4.1.1"  # keep in step with sim/kafka/pom.xml


def java_available() -> bool:
    return shutil.which("java") is not None


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# Maven's line for each file it has downloaded: "Downloaded from <repo>: <url> (<size> at <speed>)".
_DOWNLOADED = re.compile(r"^(?:\[INFO\] )?Downloaded from [^:]+: (\S+) \(([^)]*?)(?: at [^)]*)?\)")


def fetch(cache_dir: Path = DEFAULT_CACHE, progress: Callable[[str], None] = _to_stderr) -> Path:
    """Resolve the broker's jars into ``cache_dir/<version>/libs`` (once); returns that folder.

    ``progress`` is told what happens while Maven downloads: a line when it starts, one per jar
    downloaded (with its size), and one at the end (a cold cache takes minutes, and a silent
    command looks hung)."""
    libs = cache_dir / KAFKA_VERSION / "libs"
    stamp = libs / ".complete"
    if stamp.exists():
        return libs
    if shutil.which("mvn") is None:
        raise BrokerError("Maven (mvn) is needed to fetch Kafka's jars from Maven Central")
    libs.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mvn", "-B", "-f", str(PACKAGE_DIR / "pom.xml"), "dependency:copy-dependencies",
        "-DincludeScope=runtime", f"-DoutputDirectory={libs.resolve()}",
    ]  # fmt: skip
    progress(f"fetching Apache Kafka {KAFKA_VERSION}'s jars with Maven into {libs} (once)")
    tail: deque[str] = deque(maxlen=200)  # Maven's last lines, for the error
    jars = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as maven:
        assert maven.stdout is not None
        for line in maven.stdout:
            tail.append(line)
            downloaded = _DOWNLOADED.match(line)
            if downloaded and downloaded[1].endswith(".jar"):
                jars += 1
                progress(f"  [{jars}] {downloaded[1].rsplit('/', 1)[-1]} ({downloaded[2]})")
    if maven.returncode != 0:
        raise BrokerError(f"mvn failed ({maven.returncode}):\n{''.join(tail)[-8000:]}")
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"mvn ran but no kafka_2.13 jar is in {libs}")
    stamp.write_text(KAFKA_VERSION + "\n")
    progress(f"Kafka's jars are in {libs} ({jars} downloaded, {len(list(libs.glob('*.jar')))} in all)")
    return libs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _cluster_id() -> str:
    # Kafka's Uuid text form: 16 random bytes, URL-safe base64 without padding.
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


class LocalBroker:
    """One KRaft broker+controller process with its data under ``work_dir``."""

    def __init__(self, work_dir: Path, port: int = 0, cache_dir: Path = DEFAULT_CACHE, heap_mb: int = 512) -> None:
        self.work_dir = work_dir.resolve()
        self.port = port or free_port()
        self.controller_port = free_port()
        self.cache_dir = cache_dir
        self.heap_mb = heap_mb
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.work_dir / "broker.log"

    def _write_config(self) -> Path:
        data = self.work_dir / "data"
        config = self.work_dir / "server.properties"
        config.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                    f"log.dirs={data}",
                    "num.partitions=1",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=4",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    "auto.create.topics.enable=true",
                    "",
                ]
            )
        )
        return config

    def _java(self, libs: Path, main_class: str, *args: str) -> list[str]:
        return [
            "java", f"-Xmx{self.heap_mb}m", "-Xms128m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={PACKAGE_DIR / 'log4j2.properties'}",
            f"-Dkafka.log.file={self.log_file}",
            "-cp", f"{libs}/*", main_class, *args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 90.0, keep_data: bool = False) -> None:
        """Format storage, start the broker and wait until it accepts clients.

        With ``keep_data`` a broker stopped earlier restarts on its existing data (same port, same
        topics and offsets), as after a broker outage; storage is formatted only when there is none.
        """
        running = running_pid(self.work_dir)
        if running is not None:  # formatting would wipe the data of the broker running there
            raise BrokerError(
                f"a broker already runs from {self.work_dir} (pid {running}); stop it first: "
                f"hlb broker stop --dir {self.work_dir}"
            )
        if not java_available():
            raise BrokerError("Java 17 or newer is needed to run the Kafka broker")
        libs = fetch(self.cache_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        if not (keep_data and (self.work_dir / "data" / "meta.properties").exists()):
            self._format(libs, config)
        out = (self.work_dir / "broker.out").open("wb")
        self.process = subprocess.Popen(
            self._java(libs, "kafka.Kafka", str(config)), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        (self.work_dir / "broker.pid").write_text(f"{self.process.pid}\n")
        self._wait_ready(timeout_s)

    def _format(self, libs: Path, config: Path) -> None:
        shutil.rmtree(self.work_dir / "data", ignore_errors=True)
        fmt = subprocess.run(
            self._java(libs, "kafka.tools.StorageTool", "format", f"--cluster-id={_cluster_id()}", "-c", str(config)),
            capture_output=True,
            text=True,
            check=False,
        )
        if fmt.returncode != 0:
            raise BrokerError(f"formatting KRaft storage failed:\n{fmt.stdout}{fmt.stderr}")

    def _wait_ready(self, timeout_s: float) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout_s
        # Wait for the port first: librdkafka would log every refused connection.
        while not _accepts(self.port):
            if self.process is not None and self.process.poll() is not None:
                raise BrokerError(f"broker exited with {self.process.returncode}; see {self.log_file}")
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"broker not listening after {timeout_s:.0f} s; see {self.log_file}")
            time.sleep(0.2)
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        remaining = max(1.0, deadline - time.monotonic())
        try:
            if admin.list_topics(timeout=remaining).brokers:
                return
        except Exception as exc:  # librdkafka raises KafkaException when it gets no metadata
            self.stop()
            raise BrokerError(f"broker accepts connections but answers no metadata: {exc}") from None
        self.stop()
        raise BrokerError(f"broker listed no brokers; see {self.log_file}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the broker cleanly (SIGTERM), killing it if it does not exit in time."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        (self.work_dir / "broker.pid").unlink(missing_ok=True)

    def __enter__(self) -> LocalBroker:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def running_pid(work_dir: Path) -> int | None:
    """The process id in ``work_dir/broker.pid`` while that process is alive and (where ``/proc``
    tells) a Kafka broker; None otherwise (no file, a stale one, or a reused id)."""
    try:
        pid = int((work_dir / "broker.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists() and b"kafka.Kafka" not in cmdline.read_bytes():
        return None
    return pid


def stop_by_pid_file(work_dir: Path, timeout_s: float = 30.0) -> bool:
    """Stop a broker started in the background by ``start``; False when none was running."""
    pid_file = work_dir / "broker.pid"
    if not pid_file.exists():
        return False
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError) as exc:
        raise BrokerError(f"{pid_file} holds no process id ({exc}); remove it if no broker runs there") from None
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file.unlink(missing_ok=True)
    return True


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is out of range: expected a port from 1 to 65535, or 0 for a free one"
        )
    return port


# option -> (type, default, help); every action takes some of them, before or after its name.
OPTIONS: dict[str, tuple[Callable[[str], object], object, str]] = {
    "dir": (Path, DEFAULT_CACHE / "run", f"broker work folder (default: {DEFAULT_CACHE / 'run'})"),
    "port": (_port, 0, "client port on 127.0.0.1 (default: a free one)"),
    "cache": (Path, DEFAULT_CACHE, f"where the jars are cached (default: {DEFAULT_CACHE})"),
}


# action -> (the options it takes, one-line help)
ACTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "fetch": (("cache",), "resolve the broker's jars with Maven (once)"),
    "start": (("dir", "port", "cache"), "start a broker in the background and print its address"),
    "stop": (("dir",), "stop the broker started in the background from --dir"),
    "exec": (("dir", "port", "cache"), "start a broker, run the command after --, stop the broker"),
}


def _add_options(parser: argparse.ArgumentParser, names: Iterable[str], defaults: bool) -> None:
    """The options ``names``; without ``defaults`` an option not given stays out of the namespace,
    so that an action's options do not undo the same ones given before the action."""
    for name in names:
        kind, default, text = OPTIONS[name]
        parser.add_argument(f"--{name}", type=kind, default=default if defaults else argparse.SUPPRESS, help=text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Fetch, start or stop a local single-node Kafka broker (KRaft) for tests and the demo."
    _add_options(parser, OPTIONS, defaults=True)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, (options, summary) in ACTIONS.items():
        action = actions.add_parser(name, help=summary, description=summary)
        _add_options(action, options, defaults=False)
        if name == "exec":
            action.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    parser.set_defaults(command=[])


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "fetch":
            print(fetch(args.cache))
            return 0
        if args.action == "stop":
            if stop_by_pid_file(args.dir):
                return 0
            print(f"hlb broker: nothing to stop: no broker runs from {args.dir} (no broker.pid there)", file=sys.stderr)
            return 1
        broker = LocalBroker(args.dir, args.port, args.cache)
        broker.start()
        if args.action == "start":
            broker.process = None  # leave it running; `stop` finds it by its pid file
            print(broker.bootstrap)
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        env = {
            **os.environ,
            "HLB_TEST_KAFKA_BOOTSTRAP": broker.bootstrap,
            "HLB_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap,
        }
        try:
            print(f"kafka broker ready on {broker.bootstrap}", file=sys.stderr, flush=True)
            return subprocess.call(command, env=env) if command else 0
        finally:
            broker.stop()
    except BrokerError as exc:
        print(f"hlb broker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m hlb.sim.kafka_local")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
