"""Known failures shipped with the adapters: ``<adapter>.txt``, one rule or test-id prefix
per line, each with its reason after ``#``. ``decoder-conformance run --known-failures``
lists them as expected failures; every other rule must pass."""

from __future__ import annotations

from pathlib import Path

__all__ = ["FOLDER", "known_failures_file", "shipped"]

FOLDER = Path(__file__).parent


def shipped() -> list[str]:
    """The adapters that ship known failures."""
    return sorted(path.stem for path in FOLDER.glob("*.txt"))


def known_failures_file(adapter: str) -> Path:
    """The known-failures file of a registered adapter; a ``LookupError`` names the ones
    that ship one."""
    path = FOLDER / f"{adapter}.txt"
    if not path.is_file():
        raise LookupError(
            f"adapter {adapter!r} ships no known failures (those that do: "
            f"{', '.join(shipped()) or 'none'}); without --known-failures every rule must pass"
        )
    return path
