"""The reference's evidence record, for ``decoder-conformance report`` and ``trace``.

Course authors and maintainers of the reference print it: the seed's learner report, and
the ``DECODER_MODEL_TRACE_V1`` trace (or its JSON) for any configuration.
"""

from __future__ import annotations

from collections.abc import Sequence

from impl.errors import DecoderModelError
from impl.evidence import collect_evidence, run_fixture
from spec.config import FIXTURE, DecoderConfig
from spec.evidence import fixture_for
from spec.trace import render_report, render_trace, trace_json

__all__ = ["TraceRefused", "seed_report", "trace"]


class TraceRefused(ValueError):
    """The reference refused the trace's configuration or inputs; the message says why."""


def seed_report() -> str:
    """The seed chapter's 14-line learner report, computed by the reference."""
    return render_report(collect_evidence(FIXTURE))


def trace(
    config: DecoderConfig,
    seed: int,
    tokens: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    *,
    as_json: bool = False,
) -> str:
    """The evidence trace of one run of the reference (or, ``as_json``, every number)."""
    fixture = fixture_for(config, seed, tokens, targets)
    try:
        if as_json:
            return trace_json(run_fixture(fixture))
        return render_trace(collect_evidence(fixture))
    except DecoderModelError as error:
        raise TraceRefused(f"{error} [{error.kind}]") from error
