"""CPU time and peak memory of processes, from Linux's /proc (no extra dependency)."""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0.0 once it is gone)."""
    return _stat_cpu_s(Path(f"/proc/{pid}/stat"))


def main_thread_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``'s main thread alone (a server's
    event loop; 0.0 once it is gone)."""
    return _stat_cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))


def thread_cpu_s(pid: int, tid: int) -> tuple[float, float]:
    """User and system CPU seconds of thread ``tid`` of process ``pid`` ((0.0, 0.0) once
    it is gone)."""
    return _stat_times(Path(f"/proc/{pid}/task/{tid}/stat"))


def _stat_cpu_s(path: Path) -> float:
    return sum(_stat_times(path))


def _stat_times(path: Path) -> tuple[float, float]:
    try:
        stat = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0, 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK_S, int(fields[12]) * TICK_S  # utime, stime


def family(pid: int) -> list[int]:
    """``pid`` and every process below it (``serve --workers N``: the supervisor and
    its workers), whichever of a process's threads started them."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                found = (task / "children").read_text().split()
            except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
                continue  # the thread (or the process) ended meanwhile
            todo.extend(int(c) for c in found)
    return out


def peak_rss_mb(pid: int) -> float:
    """The most resident memory process ``pid`` has held since it started (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (all processes)."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in first]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) * TICK_S
