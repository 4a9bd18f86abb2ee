"""One running subprocess backend, spoken to under deadlines and within memory bounds.

Every wait has a deadline: writing a request (a backend that stops reading cannot block the
suite), reading its answer, and stopping the process. Everything the backend sends is
bounded: an answer line longer than the request's limit ends the process with a message
giving both sizes; standard error keeps a tail of at most :data:`STDERR_LINES` lines of at
most :data:`STDERR_LINE_BYTES` bytes each. The backend runs under
:mod:`conformance.supervisor`, which kills it and everything it started when this side lets
go or dies.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import queue
import re
import secrets
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from conformance.adapter import BackendLoadError
from conformance.protocol import ProtocolError, line_pieces, parse_message, printable
from conformance.supervisor import TOKEN_VARIABLE, processes_with_token

__all__ = [
    "MIN_RESPONSE_BYTES",
    "STDERR_LINES",
    "STDERR_LINE_BYTES",
    "BackendFault",
    "BackendProcess",
    "Tail",
]

STDERR_LINES = 40
STDERR_LINE_BYTES = 2000
MIN_RESPONSE_BYTES = 1 << 20  # hello, refusals, handles: small answers get a 1 MiB floor
_STRAY_LINES = 5
_CHUNK = 1 << 16
_POLL_SECONDS = 0.05
_STOP_SECONDS = 3.0


class BackendFault(RuntimeError):
    """The backend process crashed, hung, or broke the protocol."""


class Tail:
    """The last lines of a stream, bounded in lines and in bytes per line (the rest of a
    long line is counted, not kept)."""

    def __init__(self, lines: int, line_bytes: int) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        self.line_bytes = line_bytes
        self._partial = bytearray()
        self._dropped = 0
        self._lock = threading.Lock()

    def feed(self, data: bytes | bytearray) -> None:
        """Take a chunk of the stream."""
        with self._lock:
            while data:
                cut = data.find(b"\n")
                piece, data = (data, b"") if cut < 0 else (data[:cut], data[cut + 1 :])
                room = self.line_bytes - len(self._partial)
                self._partial += piece[: max(room, 0)]
                self._dropped += max(len(piece) - max(room, 0), 0)
                if cut >= 0:
                    self._close_line()

    def feed_line(self, head: bytes, size: int) -> None:
        """Take a whole line of ``size`` bytes of which only ``head`` was kept."""
        content, newline, _ = head.partition(b"\n")
        self.feed(content)
        if not newline:  # only its start was kept: the rest, less the newline, is counted
            with self._lock:
                self._dropped += max(size - len(head) - 1, 0)
        self.feed(b"\n")

    def _close_line(self) -> None:
        text = printable(self._partial.decode("utf-8", errors="replace"))
        if self._dropped:
            text += f" ... ({self._dropped} more bytes)"
        self.lines.append(text)
        self._partial.clear()
        self._dropped = 0

    def text(self) -> str:
        """The kept lines, the unfinished one last."""
        with self._lock:
            kept = list(self.lines)
            if self._partial or self._dropped:
                partial = printable(self._partial.decode("utf-8", errors="replace"))
                kept.append(
                    partial + (f" ... ({self._dropped} more bytes)" if self._dropped else "")
                )
        return "\n".join(kept)


@dataclass(frozen=True)
class _Oversized:
    """An answer line that passed the limit: how much arrived before it was cut off."""

    received: int
    limit: int


@dataclass(frozen=True)
class _Line:
    """One line of output and when it arrived (a line that arrived before a request was
    fully sent cannot be its answer)."""

    data: bytearray | _Oversized
    arrived: float


# An answer's first non-blank byte (matched in place: a line can be gigabytes).
_ANSWER_START = re.compile(rb"\s*[{\[]")
# What is kept of an answer line once it is parsed, for the messages that quote it.
_QUOTED_BYTES = 400


def _may_be_an_answer(data: bytearray | _Oversized) -> bool:
    """Every answer is a JSON object, so a line that starts with neither ``{`` nor ``[`` (a
    malformed attempt at one) is a print, not an answer; an oversized line counts as one."""
    return not isinstance(data, bytearray) or _ANSWER_START.match(data) is not None


class BackendProcess:
    """One backend process under its keeper; requests go out one at a time."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.token = secrets.token_hex(8)
        leash_read, leash = os.pipe()
        self._leash: int | None = leash
        environment = dict(os.environ)
        environment[TOKEN_VARIABLE] = self.token
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "conformance.supervisor", str(leash_read), "--", *command],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(leash_read,),
                env=environment,
                bufsize=0,
                start_new_session=True,  # its own process group and session
            )
        except OSError as error:
            os.close(leash)
            raise BackendLoadError(
                f"cannot start backend command {shlex.join(command)}: {error}"
            ) from error
        finally:
            os.close(leash_read)
        assert self.popen.stdin and self.popen.stdout and self.popen.stderr
        self._stdin = self.popen.stdin.fileno()
        os.set_blocking(self._stdin, False)
        self.limit = MIN_RESPONSE_BYTES
        self.lines: queue.Queue[_Line | None] = queue.Queue()
        self.stderr_tail = Tail(STDERR_LINES, STDERR_LINE_BYTES)
        self.stray = Tail(_STRAY_LINES, 200)
        self._strays_while_waiting = 0
        self._stopping = threading.Event()
        self._readers = [
            threading.Thread(target=self._read_answers, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    # ------------------------------------------------------------------ readers
    def _chunks(self, stream: Any) -> Any:
        """Chunks of ``stream`` until end of file or until the process is being stopped."""
        descriptor = stream.fileno()
        while not self._stopping.is_set():
            try:
                ready, _, _ = select.select([descriptor], [], [], _POLL_SECONDS)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                chunk = os.read(descriptor, _CHUNK)
            except OSError:
                return
            if not chunk:
                return
            yield chunk

    def _read_answers(self) -> None:
        assert self.popen.stdout is not None
        line = bytearray()
        skipping = 0  # bytes of an oversized line still being thrown away
        for received in self._chunks(self.popen.stdout):
            chunk = received
            while chunk:
                cut = chunk.find(b"\n")
                piece, chunk = (chunk, b"") if cut < 0 else (chunk[: cut + 1], chunk[cut + 1 :])
                if skipping:
                    skipping += len(piece)
                    if cut >= 0:
                        skipping = 0
                    continue
                line += piece
                if len(line) > self.limit:
                    self.lines.put(_Line(_Oversized(len(line), self.limit), time.monotonic()))
                    line.clear()
                    skipping = 1 if cut < 0 else 0
                    continue
                if cut >= 0:
                    # Handed over, not copied: an answer can be gigabytes.
                    self.lines.put(_Line(line, time.monotonic()))
                    line = bytearray()
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.popen.stderr is not None
        for chunk in self._chunks(self.popen.stderr):
            self.stderr_tail.feed(chunk)

    # ----------------------------------------------------------------- messages
    def stderr(self) -> str:
        """The backend's last stderr lines (and stray stdout lines), or a note of none."""
        parts = []
        text = self.stderr_tail.text().rstrip()
        parts.append(
            f"\nbackend stderr (last {STDERR_LINES} lines):\n{text}"
            if text
            else "\n(backend wrote nothing to stderr)"
        )
        stray = self.stray.text()
        if stray:
            parts.append(f"\nstray lines the backend wrote to stdout between answers:\n{stray}")
        return "".join(parts)

    def _exit_status(self) -> str:
        status = self.popen.returncode
        if status is not None and status < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-status).name}"
        return f"exited with status {status}"

    # ----------------------------------------------------------------- exchange
    def exchange(
        self, message: dict[str, Any], timeout: float, limit: int = MIN_RESPONSE_BYTES
    ) -> dict[str, Any]:
        """Send one request line and wait for its one response line, ``timeout`` seconds in
        all; an answer longer than ``limit`` bytes is a fault."""
        operation = message.get("op")
        deadline = time.monotonic() + timeout
        self._drain_stray()
        self._strays_while_waiting = 0
        self.limit = max(limit, MIN_RESPONSE_BYTES)
        # Written piece by piece (a build at a scale shape is a line of 1.58 GB); a message
        # JSON cannot hold is refused here, before a byte is sent.
        pieces = line_pieces(message)
        try:
            sent, length = self._write(pieces, deadline)
        except TimeoutError as timeout_error:
            self.stop()
            raise BackendFault(
                f"backend did not read the '{operation}' request within {timeout:g} s "
                f"({timeout_error.args[0]} bytes of it sent; killed){self.stderr()}"
            ) from None
        except OSError:
            self._wait_briefly()
            raise BackendFault(
                f"backend process {self._exit_status()} before '{operation}'{self.stderr()}"
            ) from None
        except BaseException:
            # Part of a line is in the pipe: nothing after it would be read right.
            self.stop()
            raise
        while True:
            response, quoted, size = self._answer(operation, timeout, deadline, sent)
            answered = response.get("id")
            if (
                isinstance(answered, int)
                and not isinstance(answered, bool)
                and answered < message["id"]
            ):
                # A late repeat of an earlier answer: not this one.
                self.stray.feed_line(quoted, size)
                continue
            break
        error = response.get("error")
        if answered is None and response.get("ok") is False and isinstance(error, dict):
            # The backend could not read the request far enough to know its id.
            self.stop()
            raise BackendFault(
                f"backend could not read the '{operation}' request ({length} bytes): "
                f"{printable(str(error.get('message')), one_line=True)!s:.500}{self.stderr()}"
            )
        if answered != message["id"] or not isinstance(response.get("ok"), bool):
            self.stop()
            raise BackendFault(
                f"backend answered '{operation}' with a malformed response "
                f"{printable(quoted.decode('utf-8', errors='replace').strip())!r:.300}"
                f"{self.stderr()}"
            )
        return response

    def _answer(
        self, operation: object, timeout: float, deadline: float, sent: float
    ) -> tuple[dict[str, Any], bytes, int]:
        """The next answer line, parsed; a BackendFault for a timeout, an exit, an answer
        over the limit, or a line that is no JSON object."""
        try:
            line = self._next_line(deadline, sent)
        except TimeoutError:
            self.stop()
            printed = self._strays_while_waiting
            raise BackendFault(
                f"backend did not answer '{operation}' within {timeout:g} s (killed)"
                + (
                    f"; meanwhile it wrote {printed} line{'s' if printed > 1 else ''} to stdout "
                    "that cannot be an answer (an answer is a JSON object on one line)"
                    if printed
                    else ""
                )
                + self.stderr()
            ) from None
        if line is None:
            self._wait_briefly()  # the keeper exits as the backend did: let it say how
            raise BackendFault(
                f"backend process {self._exit_status()} while answering '{operation}'"
                f"{self.stderr()}"
            )
        if isinstance(line, _Oversized):
            self.stop()
            raise BackendFault(
                f"backend's response to '{operation}' of at least {line.received} bytes exceeds "
                f"the limit of {line.limit} bytes (twice the largest legitimate answer, 1 MiB at "
                f"least; killed){self.stderr()}"
            )
        quoted, size = bytes(line[:_QUOTED_BYTES]), len(line)
        text = line.decode("utf-8", errors="replace")
        del line  # parsed from its text alone: the bytes of a line of gigabytes can go
        try:
            return parse_message(text), quoted, size
        except ProtocolError as error:
            self.stop()
            raise BackendFault(
                f"backend answered '{operation}' with {error}{self.stderr()}"
            ) from None

    def _drain_stray(self) -> None:
        """Lines that arrived between answers break the protocol but answer nothing: they
        are kept for the diagnostics, not read as the next answer."""
        while True:
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self.lines.put(None)  # the end of output stays visible to the next read
                return
            self._keep_stray(item)

    def _keep_stray(self, item: _Line) -> None:
        if isinstance(item.data, bytearray):
            self.stray.feed(item.data)
        else:
            self.stray.feed(f"(a stray line of {item.data.received}+ bytes)\n".encode())

    def _write(self, pieces: Iterable[bytes], deadline: float) -> tuple[float, int]:
        """Write every piece before ``deadline``: when the last write began (no answer can
        arrive before the request's last byte is sent) and how many bytes went. At the
        deadline, ``TimeoutError(bytes sent)``."""
        began, sent = time.monotonic(), 0
        for piece in pieces:
            view = memoryview(piece)
            while view:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(sent)
                ready = select.select([], [self._stdin], [], min(remaining, _POLL_SECONDS))
                if not ready[1]:
                    if self.popen.poll() is not None:
                        raise BrokenPipeError(errno.EPIPE, "backend exited")
                    continue
                began = time.monotonic()
                try:
                    written = os.write(self._stdin, view)
                except BlockingIOError:
                    continue
                view = view[written:]
                sent += written
        return began, sent

    def _next_line(self, deadline: float, sent: float) -> bytearray | _Oversized | None:
        """The next output line that arrived after the request was ``sent`` and may be an
        answer, or None once the process has exited; TimeoutError at the deadline. Other lines
        are stray (a debug print after the previous answer) and kept for the diagnostics: the
        time a line arrives cannot tell a late print from an answer, its first byte can."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            try:
                item = self.lines.get(timeout=min(remaining, _POLL_SECONDS))
            except queue.Empty:
                if self.popen.poll() is None:
                    continue
                try:  # a last answer may still be on its way through the pipe
                    item = self.lines.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    return None
            if item is None:
                return None
            if item.arrived < sent or not _may_be_an_answer(item.data):
                self._keep_stray(item)
                self._strays_while_waiting += item.arrived >= sent
                continue
            return item.data

    def _wait_briefly(self) -> None:
        try:
            self.popen.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.stop()

    # --------------------------------------------------------------------- end
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.popen.poll() is None

    def stop(self) -> None:
        """End the backend and everything it started, within a few seconds at most.

        Letting go of the leash makes the keeper kill the whole tree and exit; if the keeper
        does not, its process group is killed, and last every process still carrying this
        backend's token.
        """
        if self._leash is not None:
            # Closed once only: the number may belong to another file afterwards.
            leash, self._leash = self._leash, None
            with contextlib.suppress(OSError):
                os.close(leash)
        try:
            self.popen.wait(timeout=_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=_STOP_SECONDS)
        for pid in processes_with_token(self.token):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._stopping.set()
        for reader in self._readers:
            reader.join(timeout=1)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
