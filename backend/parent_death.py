"""Tie a process's life to its parent's, so nothing outlives a crashed or killed server.

`die_with_parent` arms the kernel's parent-death signal (Linux `PR_SET_PDEATHSIG`), for a child forked by a
thread that lives as long as its process (the launcher forking tritonserver). The signal follows the *thread*
that forked: tritonserver forks its Python-backend stub from a model-loading thread that exits once the model is
loaded, so the stub would be killed right after loading. The stub uses `watch_parent` instead: a thread that
checks the parent pid and nothing else (no IPC, no locks), so a hung call to the dead server cannot stall it."""

from __future__ import annotations

import ctypes
import os
import signal
import threading

_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL_S = 0.5


def die_with_parent(signum: int) -> None:
    """Have the kernel send `signum` to this process when the thread that forked it exits."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def watch_parent(what: str) -> None:
    """Exit this process at once (no cleanup: its threads may be stuck) when its parent process is gone."""
    parent = os.getppid()

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(_WATCH_INTERVAL_S):
            if os.getppid() != parent:
                os.write(2, f"{what}: parent process {parent} is gone; exiting\n".encode())
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
