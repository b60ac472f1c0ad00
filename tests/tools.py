"""External tools some tests drive (grpcurl, ghz, promtool, go, node): found on PATH or where
``make tools`` installs them (``.cache/tools/bin``); a test without one skips saying what is
missing and how to get it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS_BIN = REPO / ".cache" / "tools" / "bin"

HOW = {
    "grpcurl": "`make tools` builds it with Go (github.com/fullstorydev/grpcurl)",
    "ghz": "`make tools` builds it with Go (github.com/bojand/ghz)",
    "promtool": "`make tools` installs Debian's prometheus package, which ships it",
    "go": "install Go 1.22 or later",
    "node": "install Node.js 18 or later",
    "npm": "install Node.js 18 or later (npm comes with it)",
}


def tool(name: str) -> str:
    """The path of ``name``, or skip the test naming what is missing."""
    found = shutil.which(name, path=str(TOOLS_BIN)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found on PATH or in {TOOLS_BIN}: {HOW.get(name, 'install it')}")
    return found
