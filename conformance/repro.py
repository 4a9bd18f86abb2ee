"""Reproductions: one script per failed rule, which reruns that rule's first failing test.

The test rebuilds the model through the adapter, repeats the calls, and computes the
expected values with the spec (the oracle, the recipe, the validation order), exactly as in
the run that failed: same profile, example count and seed, so the same examples. The script
exits 1 while the rule fails and 0 once it holds; ``--adapter NAME`` reruns the same test
against another backend (the reference, say). Its docstring carries the failure message
and the Python snippet of the failing call.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from conformance.report import first_line

__all__ = ["reproduction_script", "rerun", "script_name"]


def script_name(rule_id: str) -> str:
    """The file name of a rule's reproduction."""
    return f"reproduce-{rule_id}.py"


def reproduction_script(
    *,
    rule_id: str,
    message: str,
    test: str,
    adapter: str,
    backend_command: str | None,
    backend_timeout: float,
    profile: str,
    max_examples: int | None,
    seed: int | None,
) -> str:
    """The text of a script that reruns ``test`` and exits 1 while rule ``rule_id`` fails."""
    quoted = message.replace('"""', "'''").replace("\\", "\\\\")
    indented = "\n".join(f"    {line}" if line else "" for line in quoted.splitlines())
    return f'''#!/usr/bin/env python3
"""Reproduce {rule_id} against adapter {adapter!r}: exit 1 while the rule fails, 0 once it holds.

The failure:

{indented}

This reruns {test} with the run's profile {profile!r}
({"derandomized" if seed is None else f"seed {seed}"}), so hypothesis draws the same examples;
the test rebuilds the model, calls the backend and computes the expected values with the spec.
`--adapter NAME` runs the same test against another backend.
"""

import sys

from conformance.repro import rerun

sys.exit(
    rerun(
        {test!r},
        rule_id={rule_id!r},
        adapter={adapter!r},
        backend_command={backend_command!r},
        backend_timeout={backend_timeout!r},
        profile={profile!r},
        max_examples={max_examples!r},
        seed={seed!r},
        argv=sys.argv[1:],
    )
)
'''


def rerun(
    test: str,
    *,
    rule_id: str,
    adapter: str,
    backend_command: str | None,
    backend_timeout: float,
    profile: str,
    max_examples: int | None,
    seed: int | None,
    argv: Sequence[str] = (),
) -> int:
    """Rerun one conformance test; 1 while ``rule_id`` fails there, 0 once it holds."""
    from conformance.runner import run_suite

    parser = argparse.ArgumentParser(description=f"reproduce {rule_id}")
    parser.add_argument("--adapter", default=adapter, help=f"the backend (default {adapter!r})")
    parser.add_argument("--backend-command", default=backend_command)
    options = parser.parse_args(list(argv))
    report = run_suite(
        options.adapter,
        profile=profile,
        max_examples=max_examples,
        seed=seed,
        backend_command=options.backend_command,
        backend_timeout=backend_timeout,
        tests=[test],
        contract_check=False,
    )
    if report.status not in (0, 1):
        print(report.error or report.output[-2000:], file=sys.stderr)
        return report.status
    result = report.rule(rule_id)
    if result.status == "failed":
        print(result.message)
        return 1
    print(f"{rule_id} {result.status} for adapter {options.adapter!r} ({test})")
    return 0


def write_scripts(directory: Path, scripts: dict[str, str]) -> list[Path]:
    """Write ``{rule_id: script}`` into ``directory`` (created when missing)."""
    from conformance.files import write_atomically

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for rule_id, text in scripts.items():
        path = directory / script_name(rule_id)
        write_atomically(path, text)
        path.chmod(0o755)
        written.append(path)
    return written


def summary(rule_id: str, message: str) -> str:
    """One line for a reproduction's log."""
    return f"{rule_id}: {first_line(message, 100)}"
