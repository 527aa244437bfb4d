"""The emulator's end of the line: a pseudo-terminal in raw mode whose other end is the
"USB adapter" the host opens (`PtyLink.port`, e.g. /dev/pts/5)."""

from __future__ import annotations

import os
import select
import termios
import tty


class PtyLink:
    def __init__(self):
        self.master, self.slave = os.openpty()
        tty.setraw(self.master)
        self.port = os.ttyname(self.slave)
        self.unplugged = False

    def read(self, timeout: float) -> bytes | None:
        """What the host sent within `timeout` s (b"" if nothing); None once the host's end
        is gone (unplugged, closed)."""
        try:
            ready, _, _ = select.select([self.master], [], [], timeout)
            return os.read(self.master, 4096) if ready else b""
        except OSError:
            return None

    def write(self, data: bytes) -> None:
        """One write for everything to send: one wake-up for the host. Lost if nobody listens."""
        try:
            os.write(self.master, data)
        except OSError:
            pass

    def line_speed(self) -> int | None:
        """The termios speed constant the host set on the port (e.g. termios.B1000000)."""
        try:
            return termios.tcgetattr(self.master)[4]
        except termios.error:
            return None

    def unplug(self) -> None:
        """Pull the adapter: the host's port stops answering and its reads fail."""
        self.unplugged = True
        self._close(self.slave)

    def close(self) -> None:
        for fd in (self.master, self.slave):
            self._close(fd)

    @staticmethod
    def _close(fd: int) -> None:
        try:
            os.close(fd)
        except OSError:
            pass
