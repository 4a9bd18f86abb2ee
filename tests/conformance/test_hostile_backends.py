"""Issue 18's attacks, one test a row: hostile subprocess backends, interrupts and bad
command lines. Each is bounded in time; each checks the outcome and that nothing survives.

A probe (a fresh interpreter running the subprocess adapter against a hostile backend)
reports its wall time and peak memory, so the figures are the suite side's alone.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conformance.adapters import reference_server
from conformance.files import write_atomically
from conformance.protocol import encode_config
from conformance.runner import run_suite
from spec.parameters import parameter_layout
from spec.scale import SCALE_SHAPES

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = f"{sys.executable} -m tests.conformance.hostile_backend"
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")

PROBE = r"""
import json, sys, time
from conformance.adapter import BackendOptions, Refusal
from conformance.adapters.subprocess_backend import SubprocessBackend
from conformance.backend_process import BackendFault
from spec.config import FIXTURE
from spec.recipe import initial_parameters

def peak_mib():
    # VmHWM starts afresh at exec; ru_maxrss would carry the forking test worker's peak.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024


command, timeout, steps = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(",")
started = time.perf_counter()
results = []
backend = SubprocessBackend(BackendOptions(backend_command=command, timeout=timeout))
config = FIXTURE.config
for step in steps:
    backend.begin_test()
    began = time.perf_counter()
    try:
        if step == "big":  # a request of about 350 KB, more than a pipe holds
            from spec.config import DecoderConfig
            big = DecoderConfig(64, 64, 4, 64, 1, 4)
            backend.build(big, initial_parameters(big, 0))
        model = backend.build(config, initial_parameters(config, 0))
        if step == "forward":
            backend.forward(model, [[0, 1, 2]])
        results.append({"step": step, "outcome": "ok", "seconds": time.perf_counter() - began})
    except BackendFault as fault:
        results.append({"step": step, "outcome": "fault", "message": str(fault),
                        "seconds": time.perf_counter() - began})
closing = time.perf_counter()
backend.close()
print(json.dumps({
    "seconds": time.perf_counter() - started,
    "close_seconds": time.perf_counter() - closing,
    "peak_mib": peak_mib(),
    "name": backend.name, "generations": backend._generation, "results": results,
}))
"""


def survivors(marker: str) -> list[str]:
    """Processes whose command line or environment carries ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in command:
            found.append(command.replace(b"\0", b" ").decode(errors="replace"))
    return found


def no_survivors(marker: str, within: float = 5.0) -> list[str]:
    deadline = time.monotonic() + within
    while (left := survivors(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def probe(mode: str, steps: str = "forward", timeout: float = 10.0, **environment: str) -> dict:
    """Run the subprocess adapter against ``hostile_backend MODE`` in a fresh interpreter."""
    marker = f"hostile-{uuid.uuid4().hex}"
    # The backends that tamper once remember it in a file of the temporary folder.
    with tempfile.TemporaryDirectory() as scratch:
        result = subprocess.run(
            [sys.executable, "-c", PROBE, f"{HOSTILE} {mode} {marker}", str(timeout), steps],
            capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
            env={**os.environ, "TMPDIR": scratch, **environment},
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["survivors"] = no_survivors(marker)
    return report


# Row 1 and row 3: descendants that leave the backend's process group and session.
@pytest.mark.parametrize("mode", ["grandchild-holds-stdout", "grandchild-detached"])
def test_detached_descendants_do_not_outlive_the_backend(mode: str) -> None:
    report = probe(mode, "forward,forward")
    assert [r["outcome"] for r in report["results"]] == ["ok", "ok"], report
    assert report["close_seconds"] < 5, report
    assert report["survivors"] == [], report


def test_detached_descendants_do_not_outlive_a_two_worker_run() -> None:
    marker = f"hostile-{uuid.uuid4().hex}"
    report = run_suite(
        "subprocess", profile="ci", workers=2, rules=["SHAPE-LOGITS", "PARAM-COUNT"],
        backend_command=f"{HOSTILE} grandchild-detached {marker}", cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert report.status == 0, report.output[-3000:]
    assert no_survivors(marker) == []


# Row 2: a backend that stops reading; the request is larger than a pipe holds.
def test_a_backend_that_stops_reading_costs_one_timeout() -> None:
    report = probe("stops-reading", "big,big", timeout=2)
    first, second = report["results"]
    assert first["outcome"] == "fault" and "did not read the 'build' request" in first["message"]
    assert first["seconds"] < 4, first
    assert second["outcome"] == "fault" and second["seconds"] < 4  # a fresh process, same fate
    assert report["survivors"] == []


# Row 4: the suite itself is terminated or killed; the backend ignores SIGTERM and EOF.
@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_run_leaves_no_backend_behind(signal_number: int, tmp_path: Path) -> None:
    """... and, stopped by SIGTERM, no temporary folder (SIGKILL gives it no chance)."""
    marker = f"hostile-{uuid.uuid4().hex}"
    with subprocess.Popen(
        [sys.executable, "-m", "conformance.cli", "run", "--profile", "ci", "--adapter",
         "subprocess", "--backend-command", f"{HOSTILE} ignores-sigterm {marker}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    ) as run:  # fmt: skip
        assert run.stdout is not None
        deadline = time.monotonic() + 60
        for line in run.stdout:  # wait until the suite runs against the backend
            if "checking" in line or time.monotonic() > deadline:
                break
        time.sleep(1)
        assert survivors(marker), "the backend should be running by now"
        run.send_signal(signal_number)
        run.wait(timeout=30)
    assert no_survivors(marker, within=10) == []
    if signal_number == signal.SIGTERM:
        assert list(tmp_path.glob("decoder-conformance-*")) == []


# Row 5: Ctrl-C during a run that writes reports.
def test_an_interrupted_run_leaves_the_old_reports_untouched(tmp_path: Path) -> None:
    json_path, markdown_path = tmp_path / "a.json", tmp_path / "a.md"
    json_path.write_text("old json\n")
    markdown_path.write_text("old markdown\n")
    # A test run started in the background (`cmd &`) has SIGINT ignored, which a child
    # would inherit across exec; a handler is not inherited, so the command meets the
    # default disposition a terminal's Ctrl-C does.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "conformance.cli", "run", "--profile", "default",
             "--json", str(json_path), "--markdown", str(markdown_path)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert run.stdout is not None
    for line in run.stdout:
        if "checking" in line:
            break
    time.sleep(2)
    run.send_signal(signal.SIGINT)
    rest = run.communicate(timeout=60)[0]
    assert run.returncode == 130, rest[-2000:]
    assert json_path.read_text() == "old json\n"
    assert markdown_path.read_text() == "old markdown\n"
    assert "interrupted: no report or reproduction written" in rest, rest[-2000:]


# Row 7: a 1 GiB answer line.
def test_a_huge_answer_is_cut_off_at_the_limit_in_bounded_memory() -> None:
    report = probe("huge-response", "forward,forward")
    first, second = report["results"]
    assert first["outcome"] == "fault", first
    assert "exceeds the limit of 1048576 bytes" in first["message"], first["message"][:500]
    assert second["outcome"] == "fault"  # the restarted backend does it again
    assert report["peak_mib"] < 200, report["peak_mib"]
    assert report["survivors"] == []


# Row 8: stderr floods, without newlines or with enormous lines.
@pytest.mark.parametrize("mode", ["stderr-flood", "stderr-long-lines"])
def test_a_stderr_flood_is_kept_as_a_bounded_tail(mode: str) -> None:
    report = probe(mode, "forward", timeout=60)
    assert report["results"][0]["outcome"] == "ok", report
    assert report["peak_mib"] < 200, report["peak_mib"]


def test_the_stderr_tail_is_bounded_and_shown_once(tmp_path: Path) -> None:
    """A crash after 40 lines of 2 MiB: the failure shows a bounded tail, once, also in the
    JSON report (which also holds the reproduction)."""
    path = tmp_path / "r.json"
    report = run_suite(
        "subprocess", profile="ci", rules=["VALUE-LOGITS"], json_report=path, contract_check=False,
        backend_command=f"{HOSTILE} stderr-long-lines-crash", cwd=ROOT, timeout=300,
    )  # fmt: skip
    message = report.rule("VALUE-LOGITS").message
    assert "exited with status 3" in message and message.count("backend stderr") == 1
    assert "... (2095152 more bytes)" in message
    assert len(message) < 100_000
    assert path.stat().st_size < 400_000


# Row 9: a symlink planted where a report's temporary file might go.
def test_reports_are_written_through_unpredictable_names_never_through_a_link(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    target = tmp_path / "r.json"
    for name in (".r.json.partial", ".r.json.tmp", "r.json.partial", ".r.json"):
        (tmp_path / name).symlink_to(victim)
    write_atomically(target, "report\n")
    assert victim.read_text() == "precious\n"
    assert target.read_text() == "report\n" and not target.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == [
        "r.json",
        "victim.txt",
    ]


# Row 10: float16 arrays from a backend that declares float32.
def test_a_dtype_below_the_declared_precision_fails_saying_so() -> None:
    """The contract check meets it first; without it, every rule that reads logits fails."""
    expected = "logits has dtype float16, but the backend declares float32"
    command = f"{HOSTILE} float16"
    checked = run_suite("subprocess", profile="ci", backend_command=command, cwd=ROOT)
    assert checked.status == 1 and expected in checked.rule("ADAPTER-CONTRACT").message
    report = run_suite(
        "subprocess", profile="ci", rules=["VALUE-LOGITS", "SHAPE-LOGITS", "CAUSAL-*"],
        backend_command=command, cwd=ROOT, timeout=300, contract_check=False,
    )  # fmt: skip
    ran = [rule for rule in report.rules if rule.status != "untested"]
    assert len(ran) == 5  # the three causality rules among them
    for result in ran:
        assert result.status == "failed" and expected in result.message, result


# Row 11: malformed answers are protocol faults naming the field, and the process restarts.
@pytest.mark.parametrize(
    ("mode", "named"),
    [
        ("deep-nesting", "nested too deeply"),
        ("long-id", "digits"),
        ("huge-shape", "outside the float64 range"),
        ("short-base64", "logits.data holds 4 base64 characters, but shape [1, 3, 5]"),
        ("model-not-int", "result.model must be an integer handle, got 'abc'"),
        ("unreadable-build", "could not read the 'build' request"),
    ],
)
def test_a_malformed_answer_fails_only_its_call_and_restarts_the_backend(
    mode: str, named: str
) -> None:
    report = probe(mode, "forward,forward")
    first, second = report["results"]
    assert first["outcome"] == "fault" and named in first["message"], first
    assert second["outcome"] == "ok", second
    assert report["generations"] == 2, report
    assert report["survivors"] == []


# Row 12: the same malformed lines sent to the reference server.
def test_the_reference_server_answers_every_malformed_request() -> None:
    hello = json.dumps({"id": 1, "op": "hello", "protocol": "decoder-conformance", "version": 1})
    forward = {"id": 2, "op": "forward", "model": 1}
    lines = [
        "[" * 100000,
        '{"id": ' + "7" * 5000 + ', "op": "hello"}',
        json.dumps({**forward, "tokens": {"dtype": "int64", "shape": [1], "data": ""}}).replace(
            '"shape": [1]', '"shape": [1e400]'
        ),
        json.dumps({**forward, "tokens": {"dtype": "int64", "shape": [1, 3], "data": "AAAA"}}),
        json.dumps({"id": 3, "op": "parameters", "model": "abc"}),
        json.dumps({"id": 4, "op": ["not", "a", "name"]}),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "conformance.adapters.reference_server"],
        input="\n".join([hello, *lines, hello]) + "\n",
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == len(lines) + 2
    assert answers[0]["ok"] and answers[-1]["ok"]
    for answer in answers[1:-1]:
        assert answer["ok"] is False and answer["error"]["kind"] == "protocol", answer
        assert answer["error"]["message"]


def test_a_request_over_the_line_cap_is_refused_and_the_next_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reference_server, "MAX_REQUEST_BYTES", 1000)
    hello = json.dumps({"id": 1, "op": "hello", "protocol": "decoder-conformance", "version": 1})
    oversized = json.dumps({"id": 2, "op": "hello", "padding": "x" * 5000})
    sink = io.BytesIO()
    reference_server.Server().serve(io.BytesIO(f"{oversized}\n\n{hello}\n".encode()), sink)
    first, second = (json.loads(line) for line in sink.getvalue().splitlines())
    assert first["error"] == {
        "kind": "protocol",
        "message": "request line longer than 1000 bytes",
        "details": {},
    }
    assert second["id"] == 1 and second["ok"], second


def test_the_line_cap_holds_the_largest_request_the_suite_sends_twice() -> None:
    """A build at every scale shape (its float64 parameters as base64, and its envelope)."""
    for shape in SCALE_SHAPES.values():
        config = shape.config
        envelope = len(json.dumps({"id": 2**40, "op": "build", "config": encode_config(config)}))
        arrays = [
            len(json.dumps([name, {"dtype": "float64", "shape": list(dims), "data": ""}]))
            + 4 * math.ceil(8 * math.prod(dims) / 3)
            for name, dims in parameter_layout(config)
        ]
        request = envelope + sum(arrays) + len(arrays) * len(", ")
        assert 2 * request <= reference_server.MAX_REQUEST_BYTES, (shape.name, request)


# Row 13: a backend name and version with newlines and terminal escapes.
def test_backend_strings_are_escaped_in_the_table_and_the_markdown(tmp_path: Path) -> None:
    markdown = tmp_path / "r.md"
    report = run_suite(
        "subprocess", profile="ci", rules=["SHAPE-LOGITS"], markdown_report=markdown,
        backend_command=f"{HOSTILE} escapes-in-name", cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert report.status == 0, report.output[-3000:]
    for text in (report.output, markdown.read_text()):
        assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert "backend evil\\n| `SHAPE-LOGITS` | shapes | passed |\\x1b[2J" in report.output
    assert "# Conformance report: evil\\n\\| `SHAPE-LOGITS` \\| shapes" in markdown.read_text()
    rows = [line for line in markdown.read_text().splitlines() if "`SHAPE-LOGITS`" in line]
    assert len(rows) == 1 + sum("evil" in line for line in rows), rows  # no forged row


# Row 14: a stray stdout line after an answer.
def test_a_stray_line_after_an_answer_does_not_fail_the_next_test() -> None:
    report = run_suite(
        "subprocess", profile="ci", rules=["SHAPE-LOGITS", "VALUE-LOGITS", "PARAM-COUNT"],
        backend_command=f"{HOSTILE} stray-line", cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert report.status == 0, report.output[-3000:]


# Row 15: command-line mistakes are one line and exit 2, before any work.
@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["run", "--pytest-args", "'unclosed"], "--pytest-args: No closing quotation"),
        (["run", "--pytest-args", "--collect-only"], "--pytest-args --collect-only"),
        (["run", "--json", "X.out", "--markdown", "X.out"], "name the same file"),
        (["run", "--json", "."], "is a folder, not a file"),
        (["run", "--xfails-file", sys.executable], "is not a text file"),
        (["run", "--skips-file", "no-such-file.txt"], "no such file"),
        (["golden", "regen", "--directory", "/proc/x"], "/proc/x"),
        (["bench", "--json", "missing/f.json"], "no folder"),
        (["run", "--adapter", "subprocess", "--backend-command", "'unclosed"], "cannot be split"),
    ],
)
def test_command_line_mistakes_are_one_line_and_exit_2(
    arguments: list[str], expected: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", *arguments],
        capture_output=True, text=True, cwd=tmp_path, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert time.monotonic() - started < 15  # refused before any work
    assert list(tmp_path.iterdir()) == []  # nothing written


# Row 19: slow answers, dead backends and a silent shutdown.
def test_a_run_has_a_limit_of_its_own() -> None:
    marker = f"hostile-{uuid.uuid4().hex}"
    started = time.monotonic()
    report = run_suite(
        "subprocess", profile="ci", backend_command=f"{HOSTILE} slow {marker}",
        backend_timeout=1, timeout=8, cwd=ROOT, environment={"HOSTILE_DELAY": "0.8"},
    )  # fmt: skip
    assert report.status == 124 and "longer than 8 s" in report.error
    assert time.monotonic() - started < 25
    assert no_survivors(marker) == []


def test_three_timeouts_in_a_row_end_the_waiting() -> None:
    marker = f"hostile-{uuid.uuid4().hex}"
    started = time.monotonic()
    report = run_suite(
        "subprocess", profile="ci", backend_command=f"{HOSTILE} hangs {marker}",
        backend_timeout=1, contract_check=False, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert report.status == 1
    assert time.monotonic() - started < 60
    messages = " ".join(rule.message for rule in report.failed())
    assert "backend stopped answering: 3 requests in a row took longer than 1 s" in messages
    assert no_survivors(marker) == []


def test_a_backend_computing_the_roomy_pass_is_told_why_it_timed_out() -> None:
    """A correct port whose attention streams over keys computes ERR-RESOURCES' 2^18
    positions instead of refusing them; the timeout names the way out."""
    marker = f"hostile-{uuid.uuid4().hex}"
    report = run_suite(
        "subprocess", profile="ci", backend_command=f"{HOSTILE} streams-long {marker}",
        backend_timeout=2, rules=["ERR-RESOURCES"], cwd=ROOT, timeout=300,
    )  # fmt: skip
    rule = report.rule("ERR-RESOURCES")
    assert rule.status == "failed"
    first_line = rule.message.splitlines()[0]
    assert "did not answer 'forward' within 2 s" in first_line
    assert "streams over keys" in rule.message and "--skips-file" in rule.message
    assert no_survivors(marker) == []


def test_a_silent_shutdown_costs_two_seconds_at_most() -> None:
    report = probe("silent-shutdown", "forward", timeout=30)
    assert report["results"][0]["outcome"] == "ok"
    assert report["close_seconds"] < 5, report
    assert report["survivors"] == []
