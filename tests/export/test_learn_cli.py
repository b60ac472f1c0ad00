"""``hlb learn``'s command line: its exit statuses and messages, publishing only what validation
accepted, and ``--watch`` learning again only when new rows arrived."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hlb.cli import main
from hlb.daemon.config import DEFAULT_MODEL_DIR, load_settings
from hlb.daemon.errors import BrokerError
from hlb.export import learn_cli
from tests.export.learn_rows import synthetic_rows

CONFIG = Path(__file__).resolve().parents[2] / "config.yaml"
SHIPPED_HIDDEN = 32  # the shipped model's embedding width


def shipped_version() -> str:
    """The shipped model's version, from its encoder's ONNX metadata."""
    onnx = pytest.importorskip("onnx", reason="reading ONNX metadata needs the export extra")
    model = onnx.load(str(DEFAULT_MODEL_DIR / "encoder.onnx"), load_external_data=False)
    version = {p.key: p.value for p in model.metadata_props}["hlb.model_version"]
    assert version.startswith("hlb-gnn-")
    return str(version)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_without_torch_it_says_which_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # what an install without the extra looks like
        "from hlb.cli import main\n"
        "sys.exit(main(['learn', '--rows', 'pyproject.toml', '--out', 'unused']))"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert learn_cli.MISSING_EXTRA in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--validation-share", "1.5"], "--validation-share must be between 0 and 1"),
        (["--rows", "no-such-file.jsonl"], "--rows no-such-file.jsonl: no such file"),
        (["--model", "no-such-folder"], "--model no-such-folder: no such folder"),
        (["--watch", "--interval-s", "0"], "--interval-s must be positive"),
        (["--watch", "--model-version", "v1"], "--model-version names one candidate"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["learn", "--out", str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_rows_file_that_is_not_json_lines_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch", reason="hlb learn needs the export extra: pip install 'hlb[export]'")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"cell": "default"}\n\n[1, 2]\n')
    assert main(["learn", "--rows", str(rows), "--model", str(DEFAULT_MODEL_DIR), "--out", str(tmp_path / "o")]) == 2
    assert f"{rows}:3: not a training row" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_rows_without_the_heads_inputs_exit_2_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="hlb learn needs the export extra: pip install 'hlb[export]'")
    rows = [{**row, "device_embedding": None, "context": None} for row in synthetic_rows(20, SHIPPED_HIDDEN)]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    assert main(["learn", "--rows", str(path), "--model", str(DEFAULT_MODEL_DIR), "--out", str(tmp_path / "o")]) == 2
    assert "no rows to train on (0 usable; left out: {'no_embedding': 20})" in capsys.readouterr().err


def test_the_memory_bus_has_no_rows_to_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="hlb learn needs the export extra: pip install 'hlb[export]'")
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.read_text().replace("\nbus: kafka", "\nbus: memory", 1))
    assert load_settings(config).bus == "memory"
    assert main(["learn", "--config", str(config), "--out", str(tmp_path / "o")]) == 1
    assert "hlb learn reads a Kafka broker (or --rows)" in capsys.readouterr().err


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, dict[str, Any]]]:
    """What --publish handed to the models topic (the publisher itself is tested with the topic)."""
    calls: list[tuple[Path, dict[str, Any]]] = []

    def publish(settings: Any, directory: Path, card: dict[str, Any]) -> str:
        calls.append((directory, card))
        return str(card["model_version"])

    monkeypatch.setattr(learn_cli, "publish_candidate", publish)
    return calls


def test_a_refused_candidate_exits_3_and_is_not_published(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], published: list[tuple[Path, dict[str, Any]]]
) -> None:
    pytest.importorskip("torch", reason="hlb learn needs the export extra: pip install 'hlb[export]'")
    path = write_rows(tmp_path / "rows.jsonl", synthetic_rows(600, SHIPPED_HIDDEN, "noise"))
    out = tmp_path / "candidate"
    args = ["learn", "--config", str(CONFIG), "--rows", str(path), "--model", str(DEFAULT_MODEL_DIR)]
    assert main([*args, "--out", str(out), "--epochs", "3", "--publish"]) == learn_cli.EX_REFUSED
    err = capsys.readouterr().err
    assert "refused, not published: not better than the running model" in err
    assert published == []
    card = json.loads((out / "card.json").read_text())
    assert card["accepted"] is False
    assert card["parent_version"] == shipped_version()


def test_an_accepted_candidate_is_published_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], published: list[tuple[Path, dict[str, Any]]]
) -> None:
    pytest.importorskip("torch", reason="hlb learn needs the export extra: pip install 'hlb[export]'")
    path = write_rows(tmp_path / "rows.jsonl", synthetic_rows(1000, SHIPPED_HIDDEN, "corunners"))
    out = tmp_path / "candidate"
    args = ["learn", "--config", str(CONFIG), "--rows", str(path), "--model", str(DEFAULT_MODEL_DIR)]
    assert main([*args, "--out", str(out), "--model-version", "learned-1", "--publish"]) == 0
    assert "candidate learned-1 accepted" in capsys.readouterr().out
    assert [(d, c["model_version"]) for d, c in published] == [(out, "learned-1")]


def test_watch_learns_again_only_when_new_rows_arrived() -> None:
    batches: list[Any] = [
        [{"decided_at_ms": 1}],
        [{"decided_at_ms": 1}],  # nothing new
        BrokerError("broker down"),  # logged, tried again
        [{"decided_at_ms": 1}, {"decided_at_ms": 2}],
        [{"decided_at_ms": 2}, {"decided_at_ms": 3}],  # as many rows, newer (retention dropped one)
    ]

    def read() -> list[dict[str, Any]]:
        batch = batches.pop(0)
        if isinstance(batch, Exception):
            raise batch
        return list(batch)

    learned: list[int] = []

    def learn_rows(rows: list[dict[str, Any]]) -> int:
        learned.append(len(rows))
        return learn_cli.EX_REFUSED

    slept: list[float] = []
    status = learn_cli.watch(read, learn_rows, 60.0, sleep=slept.append, rounds=5)
    assert status == 0
    assert learned == [1, 2, 2]
    assert slept == [60.0] * 4


def test_rows_decided_before_since_ms_are_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="hlb learn needs the export extra: pip install 'hlb[export]'")
    rows = synthetic_rows(30, SHIPPED_HIDDEN, start_ms=1_000_000)  # decided up to 1,029,000
    path = write_rows(tmp_path / "rows.jsonl", rows)
    args = ["learn", "--rows", str(path), "--model", str(DEFAULT_MODEL_DIR), "--out", str(tmp_path / "o")]
    assert main([*args, "--since-ms", "2000000"]) == 2
    assert "no rows to train on (0 usable; left out: {'before_since': 30})" in capsys.readouterr().err
