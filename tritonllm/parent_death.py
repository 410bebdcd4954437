"""Tie a process's life to its parent's, so nothing outlives a crashed or killed server.

`die_with_parent` arms the kernel's parent-death signal (Linux `PR_SET_PDEATHSIG`), for a child forked by a
thread that lives as long as its process (the launcher forking tritonserver). The signal follows the *thread*
that forked, and tritonserver forks its Python-backend stub from a model-loading thread that exits once the model
is loaded, so the stub would die right after loading. Nor can the stub watch with a thread of its own: a call into
the dead server can block while holding the GIL. `watch_parent` therefore starts a small watchdog *process*
(this file run as a script): it sleeps on a pidfd of the server and SIGKILLs the stub when the server exits; the
stub's own death ends it too (its parent-death signal, armed from the stub's main thread, and a check)."""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_CHECK_INTERVAL_S = 0.5


def die_with_parent(signum: int) -> None:
    """Have the kernel send `signum` to this process when the thread that forked it exits."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def watch_parent() -> subprocess.Popen:
    """Start the watchdog that kills this process (SIGKILL: no cleanup, its threads may be stuck) once its parent
    process is gone."""
    python = sys.executable if os.path.basename(sys.executable).startswith("python") else shutil.which("python3")
    return subprocess.Popen([python, os.path.abspath(__file__), str(os.getppid()), str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)


def _server_exited(server: int, pidfd: int | None) -> bool:
    """Wait up to one check interval; True once the server has exited."""
    if pidfd is None:  # no pidfd (old kernel or Python): poll the server's /proc entry
        time.sleep(_CHECK_INTERVAL_S)
        return not os.path.exists(f"/proc/{server}")
    return bool(select.select([pidfd], [], [], _CHECK_INTERVAL_S)[0])


def _watch(server: int, stub: int) -> None:
    die_with_parent(signal.SIGKILL)
    try:
        pidfd = os.pidfd_open(server)  # readable once the server has exited
    except ProcessLookupError:
        pidfd, server_gone = None, True
    except (AttributeError, OSError):
        pidfd, server_gone = None, False
    else:
        server_gone = False
    while os.getppid() == stub:  # else the stub has ended: nothing to do
        if server_gone or _server_exited(server, pidfd):
            os.kill(stub, signal.SIGKILL)
            try:  # (the server's log pipe may be gone with it)
                sys.stderr.write(f"tritonllm watchdog: tritonserver (pid {server}) is gone; killed its stub {stub}\n")
            except OSError:
                pass
            return


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]))
