"""Golden files, for maintainers: regenerate them from the reference, and check them.

``decoder-conformance golden regen`` and ``golden check`` run these. Only the reference may
write golden files; a check reports a file as hand-edited, stale, missing, unknown, or of
the wrong provenance.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import shutil
import sys
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
from spec.tolerances import scaled_error

__all__ = [
    "STALE_THRESHOLD",
    "GoldenDirectoryError",
    "GoldenProblem",
    "check_golden",
    "compute_record",
    "regenerate",
]

# The reference must reproduce its own goldens to this scaled error; below it a difference is
# reported as last-bit drift (another BLAS, another numpy), not as a stale file.
STALE_THRESHOLD = 1e-13
REFERENCE = "reference"
CASES = "cases"
# Temporary directories beside cases/: the set being written, the set just replaced (portable
# fallback), and the staging directory of the file-by-file regeneration this one replaced.
STAGING_PREFIX = ".cases-new-"
OLD_PREFIX = ".cases-old-"
LEFTOVER_PREFIXES = (STAGING_PREFIX, OLD_PREFIX, ".cases-regen-")
_LOG = logging.getLogger(__name__)


def compute_record(backend: Backend, case: GoldenCase) -> GoldenRecord:
    """Run ``backend`` on ``case`` and record every stage, the logits, loss and gradients."""
    model = backend.build(case.config, case.parameters())
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

    The whole case set is replaced in one step. Every file is written and flushed to disk in
    a staging directory ``.cases-new-*`` beside ``cases`` (the same filesystem), and the two
    directories are then exchanged atomically with Linux ``renameat2(RENAME_EXCHANGE)``; the
    old set, now under the staging name, is deleted. A kill at any instant leaves ``cases``
    holding either the whole old set or the whole new one, perhaps beside a leftover
    ``.cases-new-*`` or ``.cases-old-*`` directory, which ``check_golden`` notes and the next
    regeneration deletes. Where the exchange is unavailable (macOS, an old kernel, a
    filesystem without it) ``cases`` is renamed to ``.cases-old-*`` and the staging directory
    to ``cases``: a kill between those two renames leaves no ``cases`` at all, and both this
    function and ``check_golden`` restore the old set from ``.cases-old-*``.

    Two regenerations of one directory at once are not supported: any leftover present when
    one starts belongs to an interrupted run and is deleted. Raises PermissionError for a
    backend other than the reference, and :class:`GoldenDirectoryError` (a PermissionError)
    when the directory cannot be created or written, both before any case is computed.
    """
    if not _is_reference(backend):
        raise PermissionError(
            f"only the reference backend may regenerate golden files, not {backend.name!r}"
        )
    root = directory or golden_directory()
    staging = _make_staging(root)
    try:
        restored = _restore_interrupted_swap(root)
        if restored is not None:
            _LOG.warning("%s", restored)
        for leftover in _leftovers(root):
            # The one this run writes is not stale; every other one is (see the docstring).
            if leftover.name != staging.name:
                shutil.rmtree(leftover, ignore_errors=True)
        for case in GOLDEN_CASES:
            _write_durably(
                staging / f"{case.name}.json", encode_record(compute_record(backend, case))
            )
        _fsync_directory(staging)
        previous_set = _swap_into_place(staging, root / CASES)
        _fsync_directory(root)
        if previous_set is not None:
            shutil.rmtree(previous_set, ignore_errors=True)
    finally:
        # Gone after a plain rename or the fallback; a partial set after an exception.
        shutil.rmtree(staging, ignore_errors=True)
    return [case.name for case in GOLDEN_CASES]


class GoldenDirectoryError(PermissionError):
    """The golden directory cannot be created or written; raised before any work is done.

    A PermissionError, like the refusal of a backend other than the reference, so a caller
    that reports one as a usage error (the command line: one line, exit status 2) reports
    the other the same way. The OSError that caused it is its ``__cause__``.
    """


def _make_staging(root: Path) -> Path:
    """Create ``root`` if needed and the staging directory in it: the up-front write check."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    except OSError as error:
        raise GoldenDirectoryError(
            f"cannot create or write the golden directory {root}: {error.strerror or error}"
        ) from error
    try:
        # mkdtemp makes it private (0700); once swapped in it must read like the old cases/.
        model = root / CASES if (root / CASES).is_dir() else root
        staging.chmod(model.stat().st_mode & 0o777)
    except BaseException:
        staging.rmdir()
        raise
    return staging


def _write_durably(path: Path, text: str) -> None:
    """Write a new file and flush it to disk, so the swap never publishes an unwritten one."""
    with open(path, "x", encoding="utf-8") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())


def _fsync_directory(path: Path) -> None:
    """Flush a directory's entries (files created or renamed in it) to disk."""
    if os.name == "nt":  # Windows cannot open a directory; NTFS journals its entries itself.
        return
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _swap_into_place(staging: Path, cases: Path) -> Path | None:
    """Make ``staging`` the new ``cases``; the path that now holds the old set, if any."""
    if not cases.exists():
        os.rename(staging, cases)  # nothing to replace: a single rename is atomic
        return None
    if _exchange(staging, cases):
        return staging  # the exchange left the old set under the staging name
    # Portable fallback, two renames: a kill between them leaves no cases/ directory, only
    # the old set under .cases-old-*, which _restore_interrupted_swap puts back.
    previous_set = Path(tempfile.mkdtemp(prefix=OLD_PREFIX, dir=cases.parent))
    previous_set.rmdir()  # only its unique name is wanted; Windows cannot rename onto it
    os.rename(cases, previous_set)
    os.rename(staging, cases)
    return previous_set


# renameat2(2): AT_FDCWD resolves relative paths from the working directory as rename does;
# RENAME_EXCHANGE swaps two existing paths in one step. Its system call numbers, for a libc
# too old (before glibc 2.28) to export the function.
_AT_FDCWD = -100
_RENAME_EXCHANGE = 1 << 1
_RENAMEAT2_SYSCALL = {"x86_64": 316, "aarch64": 276}
# Errors that mean "this kernel or filesystem cannot exchange", not "the exchange failed".
_EXCHANGE_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths atomically with renameat2(RENAME_EXCHANGE).

    True when swapped; False where the system cannot (not Linux, no renameat2 in libc nor a
    known system call number, a kernel or filesystem without it). Any other failure raises.
    """
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    paths = os.fsencode(first), os.fsencode(second)
    status = _renameat2_from_libc(libc, *paths)
    if status is None:
        status = _renameat2_by_syscall(libc, *paths)
    if status is None or status in _EXCHANGE_UNSUPPORTED:
        return False
    if status != 0:
        raise OSError(status, os.strerror(status), str(first), None, str(second))
    return True


def _renameat2_from_libc(libc: ctypes.CDLL, first: bytes, second: bytes) -> int | None:
    """renameat2 through glibc (2.28 and later): 0 or the errno; None if libc lacks it."""
    try:
        renameat2 = libc.renameat2
    except AttributeError:
        return None
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    result = int(renameat2(_AT_FDCWD, first, _AT_FDCWD, second, _RENAME_EXCHANGE))
    return 0 if result == 0 else ctypes.get_errno()


def _renameat2_by_syscall(libc: ctypes.CDLL, first: bytes, second: bytes) -> int | None:
    """renameat2 as a raw system call: 0 or the errno; None on an unknown architecture."""
    number = _RENAMEAT2_SYSCALL.get(platform.machine())
    # A 32-bit Python on a 64-bit kernel reports the kernel's machine but uses other numbers.
    if number is None or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        syscall = libc.syscall
    except AttributeError:
        return None
    syscall.restype = ctypes.c_long
    # syscall() is variadic and reads every argument as a long: pass them as longs.
    result = int(
        syscall(
            ctypes.c_long(number),
            ctypes.c_long(_AT_FDCWD),
            ctypes.c_char_p(first),
            ctypes.c_long(_AT_FDCWD),
            ctypes.c_char_p(second),
            ctypes.c_long(_RENAME_EXCHANGE),
        )
    )
    return 0 if result == 0 else ctypes.get_errno()


def _leftovers(root: Path) -> list[Path]:
    """Temporary directories that interrupted regenerations left in ``root``, by name."""
    if not root.is_dir():
        return []
    return sorted(
        path
        for path in root.iterdir()
        if path.name.startswith(LEFTOVER_PREFIXES) and path.is_dir() and not path.is_symlink()
    )


def _restore_interrupted_swap(root: Path) -> str | None:
    """Undo a fallback swap killed between its two renames; a note saying so, else None.

    That state is a ``.cases-old-*`` directory (the whole old set) and no ``cases``; the old
    set goes back. A ``.cases-new-*`` beside it may be incomplete, so it is never promoted.
    """
    cases = root / CASES
    if cases.exists() or cases.is_symlink():
        return None
    candidates = [path for path in _leftovers(root) if path.name.startswith(OLD_PREFIX)]
    if not candidates:
        return None
    # Normally one: a regeneration sweeps older ones before its swap. Else the last renamed.
    previous_set = max(candidates, key=lambda path: path.stat().st_ctime_ns)
    os.rename(previous_set, cases)
    _fsync_directory(root)
    return (
        f"restored {cases} from {previous_set}, where a golden regen killed in the middle of "
        "its swap had left the previous case set"
    )


def _leftover_note(path: Path, cases: Path) -> str:
    what = "the previous case set, " if path.name.startswith(OLD_PREFIX) else ""
    return (
        f"leftover temporary directory {path} ({what}from an interrupted regen): the case set "
        f"in {cases} does not depend on it; delete it or run golden regen"
    )


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
    """Problems with the golden files, and notes that are not problems: last-bit drift, the
    leftovers of an interrupted regeneration, and the old set restored after a fallback swap
    killed half-way (see :func:`regenerate`)."""
    root = directory or golden_directory()
    problems: list[GoldenProblem] = []
    notes: list[str] = []
    try:
        restored = _restore_interrupted_swap(root)
    except OSError as error:
        restored = f"cannot restore the case set an interrupted golden regen moved aside: {error}"
    if restored is not None:
        notes.append(restored)
    notes.extend(_leftover_note(path, root / CASES) for path in _leftovers(root))
    defined = {case.name: case for case in GOLDEN_CASES}
    for path in sorted((root / CASES).glob("*.json")):
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
