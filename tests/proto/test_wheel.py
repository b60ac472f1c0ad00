"""The wheel carries the ``.proto`` files, laid out so that a client in another language compiles
them straight from the installed package (``-I site-packages``)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTOS = ("hlb/v1/events.proto", "hlb/v1/scheduler.proto")


def test_the_wheel_ships_the_proto_files_and_they_compile_from_where_it_puts_them(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    built = subprocess.run(
        [*pip, "-w", str(tmp_path), str(REPO)],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("hlb-*.whl")
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        assert set(PROTOS) <= set(archive.namelist())
        archive.extractall(site)
    out = tmp_path / "out"
    out.mkdir()
    compiled = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{site}", f"--python_out={out}", *PROTOS],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
    assert (out / "hlb" / "v1" / "scheduler_pb2.py").is_file()
