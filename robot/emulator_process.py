"""`soarm emulate` in a process of its own, for tests and benchmarks: the machine-readable
handshake is the ready file the emulator writes once it serves (`--ready-file`)."""

from __future__ import annotations

import os
import time


class EmulatorProcess:
    """`soarm emulate` in a process of its own, calibrated, for tests and benchmarks. The
    code under test then meets the bus as on the arm: a device driven by someone else,
    not a thread of its own process competing for the GIL on every reply.

        with EmulatorProcess(tmp / "cal.json") as emu:
            FeetechBus(emu.port, ids) ...; emu.unplug(); emu.kill()
    """

    def __init__(self, calibration: str | os.PathLike | None, seed: int = 0, args: tuple[str, ...] = (),
                 timeout: float = 300.0, calibrate: bool = True):
        """args: more `soarm emulate` options, e.g. ("--no-compile",) or ("--drop", "0.02").
        calibrate: write `calibration` (a new file); False: assemble the arm as that existing
        file describes (the same arm again, e.g. after a simulated replug). `calibration` None:
        an arm no one has calibrated yet."""
        import json
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        self.calibration = calibration
        self._dir = tempfile.TemporaryDirectory(prefix="soarm-emulator-")
        ready = Path(self._dir.name) / "ready.json"
        self._log = open(Path(self._dir.name) / "output.log", "w+")
        cal_args = () if calibration is None else ("--calibrate" if calibrate else "--calibration", str(calibration))
        cmd = [sys.executable, "-m", "soarm.cli", "emulate", "--quiet", "--seed", str(seed), *cal_args,
               "--ready-file", str(ready), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("emulator did not start: " + " | ".join(self.output[-5:]))
            time.sleep(0.02)
        self.port = json.loads(ready.read_text())["port"]

    @property
    def output(self) -> list[str]:
        """What the emulator process printed so far (all of it, once stopped)."""
        if self._log.closed:
            return self._printed
        self._log.flush()
        with open(self._log.name) as f:
            return f.read().splitlines()

    def unplug(self) -> None:
        import signal
        self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        import subprocess
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._printed = self.output
        self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> "EmulatorProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
