"""The suite's judge: one message shape, comparisons that see NaN, refusals, reproductions."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapter import Refusal
from conformance.adapters.reference import ReferenceBackend
from conformance.checks import Case, Judge
from spec.config import FIXTURE
from spec.errors import ErrorKind

Failed = pytest.fail.Exception


def judge(case: Case | None = None) -> Judge:
    backend = ReferenceBackend()
    plain = Judge("SHAPE-LOGITS", backend, "reference")
    return plain if case is None else plain.on(case)


def failure(action: object) -> str:
    with pytest.raises(Failed) as caught:
        action()  # type: ignore[operator]
    return str(caught.value)


def test_a_failure_has_the_one_message_shape() -> None:
    message = failure(lambda: judge().fail("logits shape", (1, 3), (1, 3, 5)))
    assert message == "[SHAPE-LOGITS] logits shape=(1, 3), but should be (1, 3, 5)"
    judge().check(True, "never shown", 1, 2)
    assert failure(lambda: judge().check(False, "x", 1, 2)) == "[SHAPE-LOGITS] x=1, but should be 2"


def test_close_names_the_worst_element_and_how_many_are_over() -> None:
    exact = np.array([[1.0, 2.0, 3.0]])
    judge().close("values", exact + 1e-13, exact, 1e-12)  # within tolerance: silent
    got = exact.copy()
    got[0, 1] += 0.5
    got[0, 2] += 0.1
    message = failure(lambda: judge().close("values", got, exact, 1e-12))
    assert message.startswith("[SHAPE-LOGITS] values[0, 1]=2.5 (scaled error 2.500e-01; 2 of 3")
    assert message.endswith("but should be 2.0 within 1e-12")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_close_fails_on_a_value_that_is_not_finite(bad: float) -> None:
    exact = np.array([1.0, 2.0])
    got = np.array([1.0, bad])
    message = failure(lambda: judge().close("loss", got, exact, 1.0))
    assert message == (
        f"[SHAPE-LOGITS] loss[1]={bad!r} (not finite; 1 of 2 elements), but should be finite"
    )


def test_a_hint_ends_the_message_of_a_value_that_is_not_finite() -> None:
    message = failure(
        lambda: judge().close("loss", np.array([np.nan]), np.array([1.0]), 1.0, hint="why")
    )
    assert message.endswith("(not finite; 1 of 1 elements), but should be finite; why")


def test_a_hint_given_as_a_function_is_called_on_a_failure_only() -> None:
    calls: list[int] = []

    def hint() -> str:
        calls.append(1)
        return "what it looks like"

    exact = np.array([1.0, 2.0])
    judge().close("values", exact, exact, 1e-12, hint=hint)
    assert calls == []
    assert failure(lambda: judge().close("values", exact + 1, exact, 1e-12, hint=hint)).endswith(
        "; what it looks like"
    )
    each = {"a": exact}
    judge().close_each("stage", each, [("a", exact)], 1e-12, hint=lambda g, e: hint())
    assert calls == [1]
    message = failure(
        lambda: judge().close_each("stage", {"a": exact * 3}, [("a", exact)], 1e-12,
                                   hint=lambda g, e: f"{float(g[0])} for {float(e[0])}")
    )  # fmt: skip
    assert message.endswith("; 3.0 for 1.0")


def test_same_bits_compares_bits_and_sees_nan() -> None:
    judge().same_bits("loss", np.float64(0.5), np.float64(0.5))
    nan = failure(lambda: judge().same_bits("loss", np.float64("nan"), np.float64("nan")))
    assert nan == "[SHAPE-LOGITS] loss=nan (not finite; 1 of 1 elements), but should be finite"
    moved = failure(lambda: judge().same_bits("logits", np.ones(3) + 1e-16 * 2, np.ones(3)))
    assert moved.startswith("[SHAPE-LOGITS] logits=different (by up to 2.220e-16)")


def test_same_bits_says_what_differs_when_no_value_does() -> None:
    signs = failure(
        lambda: judge().same_bits("gradient", np.array([0.0, -0.0, 1.0]), np.array([0.0, 0.0, 1.0]))
    )
    assert "gradient=different (the same values, 1 zero of the other sign)" in signs
    widened = failure(lambda: judge().same_bits("loss", np.float32(0.5), np.float64(0.5)))
    assert "loss=different (dtype float32 against float64, the same values)" in widened
    shaped = failure(lambda: judge().same_bits("logits", np.zeros((1, 2)), np.zeros(2)))
    assert "logits=different (shape [1, 2] against [2])" in shaped


def test_a_failure_hypothesis_could_not_replay_keeps_its_message() -> None:
    """A backend whose answers change between identical calls makes hypothesis raise a group
    of tracebacks; the report keeps the check's own message and says why it could not."""
    from hypothesis.errors import FlakyFailure

    from conformance.plugin import _first_failure

    first = Failed("[DET-REPEAT] loss=different")
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = Failed("[DET-REPEAT] second")
    group = FlakyFailure("Inconsistent results", [ValueError("other"), first, wrapped])
    assert _first_failure(group) == "[DET-REPEAT] loss=different"
    assert _first_failure(FlakyFailure("x", [wrapped])) == "[DET-REPEAT] second"
    assert _first_failure(FlakyFailure("x", [ValueError("no check")])) is None


def test_close_reports_a_shape_mismatch_before_values() -> None:
    message = failure(lambda: judge().close("logits", np.zeros((1, 5, 3)), np.zeros((1, 3, 5)), 1))
    assert message == "[SHAPE-LOGITS] logits shape=[1, 5, 3], but should be [1, 3, 5]"


def test_refused_checks_kind_details_and_says_why() -> None:
    def refuse() -> None:
        raise Refusal(ErrorKind.TOKEN_ID_OUT_OF_BOUNDS, "bad", {"position": 2})

    assert judge().refused(refuse, ErrorKind.TOKEN_ID_OUT_OF_BOUNDS, position=2).details == {
        "position": 2
    }
    wrong_kind = failure(
        lambda: judge().refused(
            refuse, ErrorKind.TARGET_COUNT_MISMATCH, what="refusal kind for x", reason="order"
        )
    )
    assert wrong_kind == (
        "[SHAPE-LOGITS] refusal kind for x=token-id-out-of-bounds (bad), "
        "but should be target-count-mismatch (order)"
    )
    wrong_detail = failure(lambda: judge().refused(refuse, refuse_kind(), position=0))
    assert wrong_detail == "[SHAPE-LOGITS] refusal detail position=2, but should be 0"


def refuse_kind() -> ErrorKind:
    return ErrorKind.TOKEN_ID_OUT_OF_BOUNDS


def test_refused_reports_a_crash_and_an_accepted_input() -> None:
    def crash() -> None:
        raise IndexError("list index out of range")

    crashed = failure(lambda: judge().refused(crash, ErrorKind.EMPTY_BATCH))
    assert crashed == (
        "[SHAPE-LOGITS] refusal=IndexError: list index out of range, "
        "but should be a Refusal of kind empty-batch"
    )
    accepted = failure(lambda: judge().refused(lambda: None, ErrorKind.EMPTY_BATCH))
    assert accepted == (
        "[SHAPE-LOGITS] refusal=none (the call succeeded), but should be a Refusal of kind "
        "empty-batch"
    )


def test_a_bound_case_adds_a_reproduction_that_runs() -> None:
    case = Case(
        FIXTURE.config,
        FIXTURE.seed,
        np.asarray(FIXTURE.tokens),
        call="output = backend.forward(model, tokens)",
        notes={"changed_row": 3},
    )
    message = failure(lambda: judge(case).fail("logits", 1, 2))
    first, _, snippet = message.partition("\n")
    assert first == "[SHAPE-LOGITS] logits=1, but should be 2"
    assert snippet.startswith("the failing call, outside the suite:\n")
    assert "    changed_row = 3" in snippet
    namespace: dict[str, object] = {}
    exec("\n".join(line[4:] for line in snippet.splitlines()[1:]), namespace)
    assert np.asarray(namespace["output"].logits).shape == (1, 3, 5)  # type: ignore[attr-defined]


def test_a_passing_close_records_how_much_of_its_bound_it_used() -> None:
    from conformance.margins import RECORDER

    RECORDER.take()
    judge().close("logits", [1.0, 2.0], [1.0, 2.0 + 2.5e-4], 1e-3)  # 2.5e-4 / 2: 12.5%
    judge().close("stage block-0", [0.5], [0.5 + 4e-4], 1e-3)
    closest = RECORDER.take()
    assert closest is not None and closest["fraction"] == pytest.approx(0.4)
    assert closest["check"] == "stage block-0: scaled error 4.00e-04 of 1.00e-03"
    assert RECORDER.take() is None  # taken: the next test starts afresh


def test_a_failing_close_records_no_margin() -> None:
    from conformance.margins import RECORDER

    RECORDER.take()
    failure(lambda: judge().close("logits", [1.0], [1.5], 1e-3))
    assert RECORDER.take() is None
