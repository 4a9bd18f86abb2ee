"""Golden cases: every backend against the reference's recorded results, case by case."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapter import Backend
from conformance.cases import LargeScales, large_scales
from conformance.checks import Case, Judge
from conformance.golden import case_path, golden_directory, load_golden
from spec.golden import GOLDEN_CASES, GoldenCase, GoldenError, GoldenRecord, case_by_name
from spec.parameters import EMBEDDING_NAME
from spec.tolerances import ToleranceModel

NAMES = [case.name for case in GOLDEN_CASES]


def _record(judge: Judge, case: GoldenCase) -> GoldenRecord:
    try:
        return load_golden(case.name)
    except GoldenError as error:
        judge.fail("golden file", str(error), "intact (see decoder-conformance golden check)")


def _judge(judge: Judge, case: GoldenCase, call: str) -> Judge:
    return judge.on(
        Case(
            case.config,
            case.seed,
            [list(r) for r in case.tokens],
            [list(r) for r in case.targets],
            call,
        )
    )


def _scales(case: GoldenCase, record: GoldenRecord) -> LargeScales | None:
    """The ``large`` variant's cases are judged like VALUE-LARGE-LOGITS (its scales)."""
    if case.variant != "large":
        return None
    table = dict(case.parameters())[EMBEDDING_NAME]
    final = dict(record.stages)["final-norm"]
    return large_scales(table, final, [value for _, value in record.gradients])


def _setup(judge: Judge, name: str, call: str) -> tuple[GoldenCase, GoldenRecord, Judge, str]:
    """The case, its verified record, a judge bound to it, and the file name for messages."""
    case = case_by_name(name)
    record = _record(judge, case)
    return case, record, _judge(judge, case, call), case_path(golden_directory(), name).name


@pytest.mark.rule("GOLDEN-VALUES")
@pytest.mark.parametrize("name", NAMES)
def test_values_match_the_golden_case(
    backend: Backend, judge: Judge, tolerance: ToleranceModel, name: str
) -> None:
    """Stages are compared in order, so a failure names the first stage that deviates."""
    case, record, check, source = _setup(judge, name, "backend.forward(model, tokens)")
    bound = tolerance.at(case.config, len(case.tokens[0]), case=f"golden:{name}")
    scales = _scales(case, record)
    model = backend.build(case.config, case.parameters())
    output = backend.forward(model, case.tokens)
    if output.stages is not None:
        check.close_each(
            f"{source}: stage",
            dict(output.stages),
            record.stages,
            bound.stages,
            scale=None if scales is None else scales.stage,
        )
    check.close(
        f"{source}: logits",
        output.logits,
        record.logits,
        bound.logits,
        scale=None if scales is None else scales.logits,
    )
    loss = backend.loss(model, case.tokens, case.targets).loss
    check.close(
        f"{source}: loss",
        np.asarray(loss),
        np.asarray(record.loss),
        bound.loss,
        scale=None if scales is None else scales.loss,
    )


@pytest.mark.rule("GOLDEN-GRADIENTS")
@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_the_golden_case(
    backend: Backend, judge: Judge, tolerance: ToleranceModel, name: str
) -> None:
    call = "backend.loss(model, tokens, targets).gradients"
    case, record, check, source = _setup(judge, name, call)
    bound = tolerance.at(case.config, len(case.tokens[0]), case=f"golden:{name}").gradients
    scales = _scales(case, record)
    model = backend.build(case.config, case.parameters())
    check.close_each(
        f"{source}: gradient of",
        backend.loss(model, case.tokens, case.targets).gradients,
        record.gradients,
        bound,
        scale=None if scales is None else scales.gradients,
    )
