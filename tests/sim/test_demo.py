"""``hlb demo`` end to end on the in-memory bus (the Kafka variant is what `make demo` runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_demo_on_the_memory_bus_shows_placements_and_stops_after_its_duration(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "demo", "--memory", "--duration", "6", "--rate", "4",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.strip()[:1].isdigit()]
    assert len(rows) >= 3, result.stdout
    assert [int(row.split()[0]) for row in rows] == list(range(1, len(rows) + 1))
    assert "placements" in lines[-1]
    assert (tmp_path / "hlb.log").read_text().count('"event": "serving"') == 1
