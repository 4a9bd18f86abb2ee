"""A reference server that attacks the suite in one way, chosen by MODE.

Usage: ``python -m tests.conformance.hostile_backend MODE [MARKER]``. MARKER, when given, is
put on the command line of every process the backend starts, so a test can look for
survivors. Each mode is one row of issue 18's table of attacks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conformance.adapters.reference_server import Server

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def _detached_grandchild(marker: str, *, keep_stdout: bool) -> None:
    """A process in a session of its own, its parent gone (a double fork), so it belongs to
    no process group the backend's killer knows about."""
    streams: dict[str, Any] = (
        {}
        if keep_stdout
        else {
            "stdin": subprocess.DEVNULL,
            "stdout": subprocess.DEVNULL,
            "stderr": subprocess.DEVNULL,
        }
    )
    middle = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; "
            f"subprocess.Popen({[*SLEEP, marker]!r}, start_new_session=True, "
            f"stdout=None if {keep_stdout} else subprocess.DEVNULL, "
            f"stderr=None if {keep_stdout} else subprocess.DEVNULL, "
            f"stdin=None if {keep_stdout} else subprocess.DEVNULL)",
        ],
        **streams,
    )
    middle.wait()


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main() -> None:
    mode = sys.argv[1]
    marker = sys.argv[2] if len(sys.argv) > 2 else "hostile-backend"
    server = Server()
    _before_serving(mode, marker)
    tamper: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = TAMPERS.get(mode)
    _serve(mode, server, tamper)
    if mode == "ignores-sigterm":
        time.sleep(600)


def _before_serving(mode: str, marker: str) -> None:
    if mode in ("grandchild-holds-stdout", "grandchild-detached"):
        _detached_grandchild(marker, keep_stdout=mode == "grandchild-holds-stdout")
    if mode == "ignores-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([*SLEEP, marker], start_new_session=True)
    if mode == "stderr-flood":
        chunk = "e" * (1 << 20)
        for _ in range(512):  # 512 MiB without a newline
            sys.stderr.write(chunk)
        sys.stderr.flush()
    if mode in ("stderr-long-lines", "stderr-long-lines-crash"):
        for _ in range(40):
            sys.stderr.write("l" * (2 << 20) + "\n")
        sys.stderr.flush()


def _serve(
    mode: str,
    server: Server,
    tamper: Callable[[dict[str, Any], dict[str, Any]], str | None] | None,
) -> None:
    for line in sys.stdin:
        request = json.loads(line)
        operation = request.get("op")
        if mode == "slow" and operation != "hello":
            time.sleep(float(os.environ.get("HOSTILE_DELAY", "0.8")))
        if mode == "hangs" and operation not in ("hello",):
            time.sleep(600)
        if mode == "streams-long" and operation == "forward" and len(line) > 2**19:
            time.sleep(600)  # computing ERR-RESOURCES' 2^18 positions, as a streaming port does
        if mode == "stderr-long-lines-crash" and operation == "forward":
            os._exit(3)
        if mode == "silent-shutdown" and operation == "shutdown":
            time.sleep(600)
        if mode == "huge-response" and operation == "forward":
            block = "x" * (1 << 20)
            for _ in range(1024):  # 1 GiB on one line
                sys.stdout.write(block)
            _write("\n")
            continue
        answer = server.answer(line)
        if mode == "escapes-in-name" and operation == "hello":
            answer["result"]["backend"] = (
                "evil\n| `SHAPE-LOGITS` | shapes | passed |\x1b[2J\x1b]0;x\x07"
            )
            answer["result"]["backend_version"] = "1\r\n\x1b[31mred"
        if mode == "float16" and operation == "hello":
            answer["result"]["precision"] = "float32"
        if tamper is not None and operation != "hello":
            replaced = tamper(request, answer)
            if replaced is not None:
                _write(replaced + "\n")
                continue
        _write(json.dumps(answer) + "\n")
        if mode == "stops-reading":
            time.sleep(600)  # reads nothing more after its hello
        if mode == "stray-line" and operation == "forward":
            _write("debug: forward done\n")  # one line too many, after the answer
        if mode == "ignores-sigterm" and operation == "shutdown":
            time.sleep(600)  # neither shutdown nor the end of input stops it
        if not server.running:
            return


def _float16(request: dict[str, Any], answer: dict[str, Any]) -> str | None:
    result = answer.get("result") or {}
    if "logits" in result:
        import base64

        import numpy as np

        logits = result["logits"]
        raw = np.frombuffer(base64.b64decode(logits["data"]), dtype=np.float64)
        result["logits"] = {
            "dtype": "float16",
            "shape": logits["shape"],
            "data": base64.b64encode(raw.astype("<f2").tobytes()).decode(),
        }
    return json.dumps(answer)


def _once(
    replacement: Callable[[dict[str, Any]], str], operation: str = "forward"
) -> Callable[..., str | None]:
    """Tamper with the first answer to ``operation`` only (one call fails, the next works,
    after the suite has started the backend afresh)."""

    def tamper(request: dict[str, Any], answer: dict[str, Any]) -> str | None:
        # Remembered in a file: the restarted process must not tamper again.
        done = (
            Path(tempfile.gettempdir())
            / f"hostile-once-{sys.argv[2] if len(sys.argv) > 2 else 'x'}"
        )
        if done.exists() or request.get("op") != operation:
            return None
        done.touch()
        return replacement(request)

    return tamper


TAMPERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], str | None]] = {
    "float16": _float16,
    "deep-nesting": _once(lambda request: "[" * 100000),
    "long-id": _once(lambda request: '{"id": ' + "7" * 5000 + ', "ok": true, "result": {}}'),
    "huge-shape": _once(
        lambda request: json.dumps(
            {
                "id": request["id"],
                "ok": True,
                "result": {
                    "logits": {"dtype": "float64", "shape": [1], "data": ""},
                    "stages": None,
                },
            }
        ).replace('"shape": [1]', '"shape": [1e400]')
    ),
    "short-base64": _once(
        lambda request: json.dumps(
            {
                "id": request["id"],
                "ok": True,
                "result": {
                    "logits": {"dtype": "float64", "shape": [1, 3, 5], "data": "AAAA"},
                    "stages": None,
                },
            }
        )
    ),
    # What a server answers to a request line it could not read (one over its length cap).
    "unreadable-build": _once(
        lambda request: json.dumps(
            {
                "id": None,
                "ok": False,
                "error": {"kind": "protocol", "message": "request line too long", "details": {}},
            }
        ),
        "build",
    ),
    "model-not-int": _once(
        lambda request: json.dumps({"id": request["id"], "ok": True, "result": {"model": "abc"}}),
        "build",
    ),
}


if __name__ == "__main__":
    main()
