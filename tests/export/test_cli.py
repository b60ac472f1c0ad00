"""``hlb export`` on an install without the export extra: one clear line, exit 1 (no torch needed)."""

from __future__ import annotations

import subprocess
import sys

from hlb.export.cli import MISSING_EXTRA


def test_export_without_torch_says_which_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # what an install without the extra looks like
        "from hlb.cli import main\n"
        "sys.exit(main(['export', '--random', '--out', 'unused']))"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert MISSING_EXTRA in result.stderr
