"""Generate the Python code of hlb's wire contracts from ``proto/hlb/v1/*.proto``.

The generated modules are checked in beside the ``.proto`` files (``proto/hlb/v1``), where the
``hlb.v1`` package imports them, so that installing hlb needs no protoc. Run after editing a
``.proto`` file::

    python proto/generate.py

``tests/proto/test_generated.py`` regenerates into a temporary folder and fails when the
checked-in code differs. The generator versions are pinned in ``pyproject.toml`` (``dev`` extra):
the code is produced by the oldest grpcio-tools the runtime pins allow, so that it imports under
every supported grpcio and protobuf.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "hlb" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed beside this interpreter (mypy-protobuf's)."""
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    found = next((p for p in candidates if p.exists()), None) or shutil.which(name)
    if found is None:
        raise SystemExit(f"protoc plugin {name!r} not found: install hlb's dev extra")
    return str(found)


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules for every ``.proto`` under ``hlb/v1`` below ``out_root``.

    Returns the generated files, sorted.
    """
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    out = str(out_root)
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out}", f"--grpc_python_out={out}",
        f"--mypy_out={out}", f"--mypy_grpc_out={out}",
        *protos,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return sorted(p for p in (out_root / "hlb" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> None:
    for path in generate(PROTO_ROOT):
        print(path.relative_to(PROTO_ROOT.parent))


if __name__ == "__main__":
    main()
