"""``bench/procstat.py``: a process's family holds the children any of its threads
started (a server that starts a helper process from a worker thread), and CPU is read
from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import procstat


def test_the_family_holds_children_started_by_any_thread() -> None:
    started: list[subprocess.Popen[bytes]] = []
    release = threading.Event()

    def start_one() -> None:  # a worker thread starts a child, and stays alive
        started.append(subprocess.Popen(["sleep", "30"]))
        release.wait(30)

    worker = threading.Thread(target=start_one)
    worker.start()
    main_child = subprocess.Popen(["sleep", "30"])
    try:
        while not started:
            threading.Event().wait(0.01)
        family = procstat.family(os.getpid())  # with whatever else this process runs
        assert {os.getpid(), main_child.pid, started[0].pid} <= set(family)
        assert len(family) == len(set(family))
    finally:
        release.set()
        worker.join()
        for child in (main_child, *started):
            child.kill()
            child.wait()


def test_cpu_seconds_grow_with_work_and_are_zero_once_gone() -> None:
    before = procstat.cpu_s(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert procstat.cpu_s(os.getpid()) > before
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert procstat.cpu_s(gone.pid) == 0.0


def test_the_main_threads_cpu_is_told_apart_from_the_others() -> None:
    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    main0, all0 = procstat.main_thread_cpu_s(os.getpid()), procstat.cpu_s(os.getpid())
    worker = threading.Thread(target=spin, args=(0.4,))
    worker.start()
    worker.join()
    main1, all1 = procstat.main_thread_cpu_s(os.getpid()), procstat.cpu_s(os.getpid())
    assert all1 - all0 >= 0.3
    assert main1 - main0 < 0.1  # the main thread only waited
    spin(0.3)
    assert procstat.main_thread_cpu_s(os.getpid()) - main1 >= 0.2


def test_a_threads_user_cpu_is_its_own_and_zero_once_it_ended() -> None:
    tids: list[int] = []
    spun = threading.Event()
    release = threading.Event()

    def spin() -> None:
        tids.append(threading.get_native_id())
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait(30)

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        assert spun.wait(30)
        user, system = procstat.thread_cpu_s(os.getpid(), tids[0])
        assert user + system >= 0.2  # reading the thread's clock is a system call
        assert user > 0.0
        main_user, _ = procstat.thread_cpu_s(os.getpid(), os.getpid())
        assert procstat.main_thread_cpu_s(os.getpid()) >= main_user
    finally:
        release.set()
        worker.join()
    assert procstat.thread_cpu_s(os.getpid(), tids[0]) == (0.0, 0.0)
