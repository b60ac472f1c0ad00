"""A full disk for the files under one directory, made by failing their writes (no mount needed)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest


class DiskFull:
    """While ``full`` (or, for fsyncs only, ``fsync_fails``) is set, ``os.write`` on a file under
    ``directory`` raises ENOSPC (``os.fsync``/``os.fdatasync`` on such a file likewise), as a full
    disk does; every other file, and every other call, is untouched. ``refused`` counts the calls
    that failed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = str(directory.resolve())
        self.full = False
        self.fsync_fails = False
        self.refused = 0
        self._lock = threading.Lock()
        write, fsync, fdatasync = os.write, os.fsync, os.fdatasync

        def failing_write(fd: int, data: Any) -> int:
            if self.full and self._under(fd):
                self._refuse()
            return write(fd, data)

        def failing(sync: Any) -> Any:
            def call(fd: int) -> None:
                if (self.full or self.fsync_fails) and self._under(fd):
                    self._refuse()
                sync(fd)

            return call

        monkeypatch.setattr(os, "write", failing_write)
        monkeypatch.setattr(os, "fsync", failing(fsync))
        monkeypatch.setattr(os, "fdatasync", failing(fdatasync))

    def _under(self, fd: int) -> bool:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return path.startswith(self.directory + os.sep) and os.path.isfile(path.removesuffix(" (deleted)"))

    def _refuse(self) -> None:
        with self._lock:
            self.refused += 1
        raise OSError(errno.ENOSPC, "No space left on device")
