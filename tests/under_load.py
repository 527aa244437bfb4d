"""The emulator-backed tests with the machine busy: two CPU-bound processes beside them, the
tests in reverse order. Part of `make test`, so that a bus test that only passes on an idle
machine, or after another test, fails here first.

    python tests/under_load.py [pytest args]       # default: the tests marked `bus`
"""

import multiprocessing as mp
import os
import subprocess
import sys
import time

HOGS = 2
MAX_S = 1800.0          # a hog never outlives this, whatever happens to its parent


def hog(parent: int) -> None:
    end = time.monotonic() + MAX_S
    x = 0
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main() -> int:
    hogs = [mp.Process(target=hog, args=(os.getpid(),), daemon=True) for _ in range(HOGS)]
    for h in hogs:
        h.start()
    args = sys.argv[1:] or ["-m", "bus"]
    print(f"under_load: {HOGS} CPU-bound processes beside `pytest {' '.join(args)}`, tests in reverse order",
          flush=True)
    try:
        env = dict(os.environ, SOARM_TEST_ORDER="reverse")
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], env=env)
    finally:
        for h in hogs:
            h.terminate()
            h.join()


if __name__ == "__main__":
    sys.exit(main())
