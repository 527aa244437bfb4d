"""The test suite with the machine busy: the emulator-backed tests (marked `bus`) must hold
under CPU load and in any order, so `make test` never runs them on an idle machine:

    python tests/under_load.py --beside-suite     # the bus tests in order, the rest of the
                                                  # suite (CPU-bound: training, fits) beside them
    python tests/under_load.py [pytest args]      # the bus tests in reverse order beside two
                                                  # CPU-bound processes (default args: -m bus)

A bus test that only passes on an idle machine, or after another test, fails here first. The
first pass also gives the real-time tests' waiting to the CPU-bound ones (minutes off CI).
"""

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

HOGS = 2
MAX_S = 1800.0          # a hog never outlives this, whatever happens to its parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def hog(parent: int) -> None:
    end = time.monotonic() + MAX_S
    x = 0
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def beside_hogs(args: list[str]) -> int:
    hogs = [mp.Process(target=hog, args=(os.getpid(),), daemon=True) for _ in range(HOGS)]
    for h in hogs:
        h.start()
    args = args or ["-m", "bus"]
    print(f"under_load: {HOGS} CPU-bound processes beside `pytest {' '.join(args)}`, tests in reverse order",
          flush=True)
    try:
        return subprocess.call([*PYTEST, *args], env=dict(os.environ, SOARM_TEST_ORDER="reverse"))
    finally:
        for h in hogs:
            h.terminate()
            h.join()


def beside_suite() -> int:
    """The bus tests live; the rest of the suite at the same time, its report printed after."""
    print("under_load: `pytest -m bus` beside `pytest -m 'not bus'` (its report follows)", flush=True)
    with tempfile.TemporaryFile("w+") as report:
        rest = subprocess.Popen([*PYTEST, "-m", "not bus"], stdout=report, stderr=subprocess.STDOUT)
        try:
            bus = subprocess.call([*PYTEST, "-m", "bus"])
        finally:
            others = rest.wait()
        report.seek(0)
        print("\nunder_load: the rest of the suite, `pytest -m 'not bus'`:\n" + report.read(), flush=True)
    return bus or others


if __name__ == "__main__":
    sys.exit(beside_suite() if sys.argv[1:] == ["--beside-suite"] else beside_hogs(sys.argv[1:]))
