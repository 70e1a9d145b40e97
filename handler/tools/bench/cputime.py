"""CPU time (user + system) a server's whole process tree spends over a measured run.

A server is a tree: our gunicorn master, its worker and tensor-parallel ranks; vLLM's API
server and its engine-core process. A sampler thread walks the tree (psutil,
children(recursive=True)) every `interval` seconds and remembers each process's latest
cpu_times, keyed by (pid, create_time) so a reused pid is a new process. The run's CPU time
is the sum over processes of (last value - value at start), a process born mid-run counting
from its own start (0) and a process that died mid-run with its last sampled value (at most
`interval` of its CPU is missed). children_user/children_system are not read: every
descendant is counted on its own, and reaped children would be counted twice.
"""
from __future__ import annotations

import threading

import psutil


def _own_cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


class TreeCpu:
    """with TreeCpu(pid) as m: ...run...;  m.seconds -> CPU seconds of the tree in the block."""

    def __init__(self, pid: int, interval: float = 0.5):
        self.pid, self.interval = pid, interval
        self.start: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], float] = {}
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> dict[tuple[int, float], float]:
        try:
            root = psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
        now = {}
        for p in procs:
            try:
                with p.oneshot():
                    now[(p.pid, p.create_time())] = _own_cpu(p)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue   # gone between listing and reading: its last sample stands
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.last.update(self._sample())

    def __enter__(self) -> TreeCpu:
        self.start = self._sample()
        self.last = dict(self.start)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tree-cpu")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.last.update(self._sample())
        self.seconds = sum(v - self.start.get(k, 0.0) for k, v in self.last.items())

    @property
    def processes(self) -> int:
        """How many distinct processes the tree had over the block."""
        return len(self.last)
