"""Golden files for the suite: where they are, and one verified record each.

The files live in ``golden/`` at the top of the repository; the package reaches them through
the ``conformance/golden`` link, which a wheel turns into package data.
``DECODER_CONFORMANCE_GOLDEN_DIR`` points the suite at another copy. Writing and checking
them is maintainer work: :mod:`conformance.tools.golden`.
"""

from __future__ import annotations

import os
from pathlib import Path

from spec.golden import GoldenError, GoldenRecord, decode_record

__all__ = ["ENVIRONMENT_VARIABLE", "case_path", "golden_directory", "load_golden"]

ENVIRONMENT_VARIABLE = "DECODER_CONFORMANCE_GOLDEN_DIR"


def golden_directory() -> Path:
    """The golden directory: the environment variable's, else the one shipped with the suite."""
    configured = os.environ.get(ENVIRONMENT_VARIABLE)
    if configured:
        return Path(configured)
    return (Path(__file__).resolve().parent / "golden").resolve()


def case_path(directory: Path, name: str) -> Path:
    """Where one case's file lives."""
    return directory / "cases" / f"{name}.json"


def load_golden(name: str, directory: Path | None = None) -> GoldenRecord:
    """One case's verified golden record (a :class:`GoldenError` names what is wrong)."""
    path = case_path(directory or golden_directory(), name)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise GoldenError(str(path), name, f"cannot be read ({error.strerror or error})") from None
    return decode_record(text, str(path))
