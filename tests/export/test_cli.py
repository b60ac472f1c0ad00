"""``hlb export`` and ``hlb train`` on an install without the export extra: one clear line, exit 1
(no torch needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hlb.export.cli import MISSING_EXTRA as MISSING_FOR_EXPORT
from hlb.export.train_cli import MISSING_EXTRA as MISSING_FOR_TRAIN


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "--random", "--out", "unused"], MISSING_FOR_EXPORT),
        (["train", "--preset", "tiny", "--out", "unused"], MISSING_FOR_TRAIN),
    ],
    ids=["export", "train"],
)
def test_a_command_without_torch_says_which_extra_to_install(args: list[str], message: str) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # what an install without the extra looks like
        "from hlb.cli import main\n"
        f"sys.exit(main({args!r}))"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert message in result.stderr
