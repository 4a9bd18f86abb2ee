"""The keeper of one subprocess backend: it starts the backend and, when told or orphaned,
kills the backend and every process the backend started, wherever those went.

The suite does not start a backend command directly. It starts this module in a new
session, with the backend's standard streams and one extra pipe, the *leash*, whose write
end only the suite holds::

    python -m conformance.supervisor LEASH_FD -- COMMAND...

The keeper makes itself a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), so a
descendant that detaches (double fork, ``setsid``) is re-parented to the keeper instead of
to init and stays findable; it then starts the command and lets go of its own copies of the
standard streams, so that only the backend holds them. It ends the whole tree, backend and
descendants, with SIGKILL, and exits, when:

- the leash reaches end of file: the suite closed it (a restart, the end of the run) or the
  suite died, however it died, SIGKILL included, since the kernel closes a dead process's
  descriptors;
- the keeper receives SIGTERM, SIGINT or SIGHUP;
- the backend exits: whatever it left running is an orphan with nobody to answer.

It then exits as the backend did (the same status, or the same signal), so the suite's
messages name the backend's own exit. Descendants are found by walking ``/proc`` for the
keeper's descendants; each process also inherits ``DECODER_CONFORMANCE_BACKEND_TOKEN``, which
the suite uses as a last sweep should the keeper itself be killed. A cgroup would be
stronger but needs a delegated hierarchy, which an unprivileged run rarely has. On a system
without ``/proc`` and subreapers only the process group is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

__all__ = [
    "TOKEN_VARIABLE",
    "descendants",
    "kill_tree",
    "processes_with_environment",
    "processes_with_token",
]

TOKEN_VARIABLE = "DECODER_CONFORMANCE_BACKEND_TOKEN"
_PR_SET_CHILD_SUBREAPER = 36
_POLL_SECONDS = 0.05
_KILL_DEADLINE_SECONDS = 3.0


def _make_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); False where the system has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """Every visible process and its parent, from ``/proc``."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                text = Path(entry.path, "stat").read_text(encoding="ascii", errors="replace")
            except OSError:
                continue  # gone meanwhile
            # The command name is in parentheses and may hold spaces or parentheses itself.
            fields = text[text.rfind(")") + 2 :].split()
            if len(fields) > 1 and fields[1].isdigit():
                found[int(entry.name)] = int(fields[1])
    return found


def descendants(root: int) -> list[int]:
    """The processes below ``root``, children first."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    below: list[int] = []
    frontier = [root]
    while frontier:
        nxt = [child for pid in frontier for child in children.get(pid, [])]
        below.extend(nxt)
        frontier = nxt
    return below


def processes_with_token(token: str) -> list[int]:
    """The processes (of this user) whose environment carries ``TOKEN_VARIABLE=token``."""
    return processes_with_environment(TOKEN_VARIABLE, token)


def processes_with_environment(variable: str, value: str) -> list[int]:
    """The processes (of this user, not this one) whose environment has ``variable=value``."""
    marker = f"{variable}={value}".encode()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environment = Path(entry.path, "environ").read_bytes()
            except OSError:
                continue  # gone, or not ours
            if marker in environment.split(b"\0"):
                found.append(int(entry.name))
    return found


def _reap(backend: int | None = None) -> int | None:
    """Collect every exited child (adopted orphans included), without waiting; the
    backend's exit status (negative: its signal) when the backend was among them."""
    status = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == backend:
            status = os.waitstatus_to_exitcode(wait_status)


def kill_tree(root: int, *, include_root: bool = False) -> None:
    """SIGKILL every descendant of ``root`` until none is left or the deadline passes (a
    forking process may add children while it is being killed)."""
    deadline = time.monotonic() + _KILL_DEADLINE_SECONDS
    while time.monotonic() < deadline:
        targets = descendants(root) + ([root] if include_root else [])
        if not targets:
            return
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if root == os.getpid():
            _reap()  # the backend is dead by now; its status no longer matters
        time.sleep(0.01)


class _Stop(Exception):
    """A signal asked the keeper to end the tree."""


def _on_signal(number: int, frame: FrameType | None) -> None:
    raise _Stop(number)


def _exit_like(status: int | None) -> None:
    """Exit with the backend's status, or by the backend's signal."""
    sys.stdout.flush()
    if status is None:
        os._exit(0)
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(1)  # a signal whose default is to ignore it: exit plainly instead
        os._exit(128 - status)
    os._exit(status)


def _release_standard_streams() -> None:
    """Only the backend holds the pipes: the suite sees end of file when the backend dies."""
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in (0, 1, 2):
        os.dup2(null, descriptor)
    os.close(null)


def main(arguments: list[str]) -> None:
    """``LEASH_FD -- COMMAND...``: keep the backend until the leash goes slack."""
    if len(arguments) < 3 or arguments[1] != "--" or not arguments[0].isdigit():
        sys.stderr.write("usage: python -m conformance.supervisor LEASH_FD -- COMMAND...\n")
        os._exit(2)
    leash = int(arguments[0])
    command = arguments[2:]
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, _on_signal)
    _make_subreaper()
    try:
        # Reaped here, not by Popen: adopted orphans and the backend share one waitpid.
        backend = subprocess.Popen(command, close_fds=True).pid
    except OSError as error:
        sys.stderr.write(f"cannot start backend command {command[0]!r}: {error}\n")
        os._exit(127)
    _release_standard_streams()
    status: int | None = None
    try:
        while status is None:
            readable, _, _ = select.select([leash], [], [], _POLL_SECONDS)
            status = _reap(backend)
            if readable and not os.read(leash, 4096):
                break  # the suite let go, or died
    except _Stop:
        pass
    kill_tree(os.getpid())
    deadline = time.monotonic() + 1
    while status is None and time.monotonic() < deadline:
        status = _reap(backend)
        time.sleep(0.01)
    _exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
