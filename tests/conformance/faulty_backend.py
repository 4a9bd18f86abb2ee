"""A reference server that misbehaves on one kind of request: crash, hang, garbage (a line
of text) or broken JSON.

Usage: ``python -m tests.faulty_backend MODE MARKER``. It also starts a child process that
would outlive it, carrying MARKER in its command line, so a test can check that the suite
kills the backend's whole process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conformance.adapters.reference_server import Server

TRIGGER = '"detach_head": true'  # only TIE-GRADIENT-SUM asks for the head-detached loss


def main() -> None:
    mode, marker = sys.argv[1], sys.argv[2]
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    server = Server()
    for line in sys.stdin:
        if TRIGGER in line:
            if mode == "crash":
                sys.stderr.write("faulty backend: crashing on purpose\n")
                sys.stderr.flush()
                os._exit(3)
            if mode == "hang":
                sys.stderr.write("faulty backend: hanging on purpose\n")
                sys.stderr.flush()
                time.sleep(600)
            if mode in ("garbage", "broken-json"):
                sys.stdout.write("this is not json\n" if mode == "garbage" else '{"id": oops\n')
                sys.stdout.flush()
                continue
        sys.stdout.write(json.dumps(server.answer(line)) + "\n")
        sys.stdout.flush()
        if not server.running:
            return


if __name__ == "__main__":
    main()
