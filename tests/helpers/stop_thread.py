"""Stops one thread of a Python process, by its thread name, and leaves the others running: a wedged scheduler in a
live process (its endpoint still answers), which SIGSTOP cannot make (it stops every thread).

    stop_thread.py PID THREAD_NAME PY_SPY

py-spy names each thread with its kernel thread id; ptrace (PTRACE_SEIZE, then PTRACE_INTERRUPT) stops that thread
alone. It stays stopped while this helper lives (killing the helper detaches it and it runs on); when the process is
killed, the helper reaps the traced thread, as a tracer must, and exits. Standard library only: any python3 runs it.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
WALL = 0x40000000  # waitpid(__WALL): the os module does not name it


def thread_id(pid: int, name: str, py_spy: str) -> int:
    dump = subprocess.run([py_spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=30).stdout
    found = re.search(rf'^Thread (\d+) \([^)]*\): "{re.escape(name)}"', dump, re.MULTILINE)
    if found is None:
        sys.exit(f"no thread named {name!r} in process {pid}:\n{dump}")
    return int(found.group(1))


def main() -> None:
    pid, name, py_spy = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    tid = thread_id(pid, name, py_spy)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    for request in (PTRACE_SEIZE, PTRACE_INTERRUPT):
        if libc.ptrace(request, tid, None, None) != 0:
            sys.exit(f"ptrace {request:#x} on thread {tid}: {os.strerror(ctypes.get_errno())}")
    os.waitpid(tid, WALL)  # until the thread is in its ptrace stop
    print(f"stopped thread {tid} ({name}) of process {pid}", flush=True)
    while True:  # never resumed; but when the process is killed, its traced thread is ours to reap, or it stays a zombie
        _, status = os.waitpid(tid, WALL)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            print(f"thread {tid} ended with its process", flush=True)
            return


if __name__ == "__main__":
    main()
