"""Stopping a run: a lost interrupt is sent again before the run is killed."""

from __future__ import annotations

import signal
import subprocess
import sys

from conformance.runner import _stop

# A run whose first interrupt is lost (Python drops one that lands in a __del__), and that
# ends cleanly, with the status of an interrupted run, on the second.
LOSES_THE_FIRST_INTERRUPT = """
import signal, sys, time
seen = []
def on_interrupt(number, frame):
    seen.append(number)
    if len(seen) > 1:
        sys.exit(130)
signal.signal(signal.SIGINT, on_interrupt)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_lost_interrupt_is_sent_again_before_the_kill() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", LOSES_THE_FIRST_INTERRUPT],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    _stop(process, signal.SIGINT)
    process.stdout.close()
    assert process.returncode == 130  # ended by the second interrupt, not killed (-9)
