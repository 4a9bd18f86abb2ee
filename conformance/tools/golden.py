"""Golden files, for maintainers: regenerate them from the reference, and check them.

``decoder-conformance golden regen`` and ``golden check`` run these. Only the reference may
write golden files; a check reports a file as hand-edited, stale, missing, unknown, or of
the wrong provenance.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conformance import __version__
from conformance.adapter import Backend, Capability
from conformance.adapters.reference import ReferenceBackend
from conformance.golden import case_path, golden_directory
from spec.golden import (
    GOLDEN_CASES,
    GoldenCase,
    GoldenError,
    GoldenRecord,
    decode_record,
    encode_record,
)
from spec.recipe import initial_parameters
from spec.tolerances import scaled_error

__all__ = ["STALE_THRESHOLD", "GoldenProblem", "check_golden", "compute_record", "regenerate"]

# The reference must reproduce its own goldens to this scaled error; below it a difference is
# reported as last-bit drift (another BLAS, another numpy), not as a stale file.
STALE_THRESHOLD = 1e-13
REFERENCE = "reference"


def compute_record(backend: Backend, case: GoldenCase) -> GoldenRecord:
    """Run ``backend`` on ``case`` and record every stage, the logits, loss and gradients."""
    model = backend.build(case.config, initial_parameters(case.config, case.seed))
    output = backend.forward(model, case.tokens)
    loss = backend.loss(model, case.tokens, case.targets)
    if output.stages is None or loss.gradients is None:
        raise ValueError(
            f"backend {backend.name} cannot produce stages and gradients for a golden file"
        )
    gradients = [(name, loss.gradients[name]) for name, _ in backend.parameters(model)]
    provenance = {
        "generator": f"decoder-conformance {__version__} golden regen",
        "backend": f"{backend.name} {backend.version} ({backend.precision})",
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    return GoldenRecord(case, output.stages, output.logits, loss.loss, gradients, provenance)


def _is_reference(backend: Backend) -> bool:
    return type(backend) is ReferenceBackend and Capability.GRADIENTS in backend.capabilities


def regenerate(backend: Backend, directory: Path | None = None) -> list[str]:
    """Rewrite every golden file from ``backend``, which must be the reference.

    All files are written beside the directory first and moved into place only when every
    one is complete, so an interrupted run leaves each old file intact.
    """
    if not _is_reference(backend):
        raise PermissionError(
            f"only the reference backend may regenerate golden files, not {backend.name!r}"
        )
    target = (directory or golden_directory()) / "cases"
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".cases-regen-", dir=target.parent))
    try:
        written = []
        for case in GOLDEN_CASES:
            path = staging / f"{case.name}.json"
            path.write_text(encode_record(compute_record(backend, case)), encoding="utf-8")
            written.append(path)
        for path in written:
            os.replace(path, target / path.name)
        defined = {f"{case.name}.json" for case in GOLDEN_CASES}
        for leftover in target.glob("*.json"):
            if leftover.name not in defined:
                leftover.unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [case.name for case in GOLDEN_CASES]


@dataclass
class GoldenProblem:
    """One thing wrong with the golden files: which file, which case, what."""

    path: str
    case: str
    kind: str  # "hand-edited", "stale", "missing", "unknown", "provenance"
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.path}: case {self.case}: {self.detail}"


def first_difference(record: GoldenRecord, fresh: GoldenRecord) -> tuple[str, float]:
    """The array whose values moved most, and by how much (scaled)."""
    pairs = [
        *((f"stage {n}", a, b) for (n, a), (_, b) in zip(record.stages, fresh.stages, strict=True)),
        ("logits", record.logits, fresh.logits),
        ("loss", np.asarray(record.loss), np.asarray(fresh.loss)),
        *(
            (f"gradient of {n}", a, b)
            for (n, a), (_, b) in zip(record.gradients, fresh.gradients, strict=True)
        ),
    ]
    worst_name, worst = "", 0.0
    for name, stored, computed in pairs:
        if stored.shape != computed.shape:
            return f"{name} (shape {list(stored.shape)} vs {list(computed.shape)})", float("inf")
        error = float(np.max(scaled_error(computed, stored), initial=0.0))
        if error > worst:
            worst_name, worst = name, error
    return worst_name, worst


def check_golden(
    directory: Path | None = None, *, recompute: Backend | None = None
) -> tuple[list[GoldenProblem], list[str]]:
    """Problems with the golden files, and notes (last-bit drift) that are not problems."""
    root = directory or golden_directory()
    problems: list[GoldenProblem] = []
    notes: list[str] = []
    defined = {case.name: case for case in GOLDEN_CASES}
    for path in sorted((root / "cases").glob("*.json")):
        if path.stem not in defined:
            problems.append(GoldenProblem(str(path), path.stem, "unknown", "no such golden case"))
    for name, case in defined.items():
        path = case_path(root, name)
        problem = _check_one(path, case, recompute, notes)
        if problem is not None:
            problems.append(GoldenProblem(str(path), name, *problem))
    return problems, notes


def _check_one(
    path: Path, case: GoldenCase, recompute: Backend | None, notes: list[str]
) -> tuple[str, str] | None:
    """``(kind, detail)`` of the first thing wrong with one golden file, or None."""
    if not path.is_file():
        return "missing", "run decoder-conformance golden regen"
    try:
        record = decode_record(path.read_text(encoding="utf-8"), str(path))
    except GoldenError as error:
        return "hand-edited", error.what
    if record.case != case:
        return "stale", "its inputs differ from the case definition in spec/golden.py"
    generator = record.provenance.get("backend", "")
    if not generator.startswith(f"{REFERENCE} "):
        return "provenance", f"generated by {generator!r}, not the reference"
    if recompute is not None:
        where, drift = first_difference(record, compute_record(recompute, case))
        if drift > STALE_THRESHOLD:
            return "stale", f"the reference now differs in {where} by {drift:.2e} (scaled)"
        if drift > 0:
            notes.append(
                f"{path}: last-bit drift in {where} ({drift:.1e}), within {STALE_THRESHOLD:g}"
            )
    return None
