"""conformance.coverage: what a run records of the inputs it sent."""

from __future__ import annotations

import numpy as np

from conformance.adapter import ForwardOutput
from conformance.coverage import InputCoverage, render_coverage
from spec.config import DecoderConfig
from spec.errors import ADAPTER_KINDS, ErrorKind
from spec.recipe import initial_parameters
from spec.variants import scenario_parameters

CONFIG = DecoderConfig(5, 4, 1, 4, 1, 6)


def test_token_inputs_are_told_apart() -> None:
    record = InputCoverage()
    for tokens in (
        np.zeros((1, 2), dtype=np.int8),
        np.zeros((1, 2), dtype=bool),
        [[0, 1]],
        [[0, 1], [0]],
        np.array([["0", "1"]]),
        [["a", "b"]],
    ):
        record.call("forward", ("model", tokens))
    assert record.token_inputs == {
        "int8": 1, "bool": 1, "list of int64": 1, "ragged": 1, "strings": 2,
    }  # fmt: skip


def test_gains_dtypes_logits_and_lengths_are_counted() -> None:
    record = InputCoverage()
    record.call("build", (CONFIG, initial_parameters(CONFIG, 0)))
    record.call("build", (CONFIG, scenario_parameters(CONFIG, 0, "varied")))
    record.built("build", (CONFIG,))
    tokens = np.zeros((2, 6), dtype=np.int64)
    logits = np.array([[[1.0, -7.5, np.inf]]])
    record.answered("forward", ("model", tokens), ForwardOutput(logits))
    assert (record.models_with_unit_gains, record.models_with_other_gains) == (1, 1)
    assert record.parameter_dtypes == {"float64": 2 * len(initial_parameters(CONFIG, 0))}
    assert record.largest_logit == 7.5  # the largest finite one
    assert record.longest_sequence == 6
    assert record.size_ranges["context"] == [6, 6]
    assert record.size_ranges["head_width"] == [4, 4]


def test_a_config_a_backend_should_have_refused_is_recorded_without_a_head_width() -> None:
    record = InputCoverage()
    for accepted in (  # by a faulty backend
        DecoderConfig(5, 4, 0, 4, 1, 6),  # no heads
        DecoderConfig(5, 10, 4, 4, 1, 6),  # a width that heads do not divide
        DecoderConfig(5, True, True, 4, 1, 6),  # bools, not counts
        DecoderConfig(5, "8", 2, 4, 1, 6),  # type: ignore[arg-type]
    ):
        record.built("build", (accepted,))
    assert record.size_ranges["heads"] == [0, 4]
    assert "head_width" not in record.size_ranges


def test_shares_merge_into_the_same_figures() -> None:
    one, two, whole = InputCoverage(), InputCoverage(), InputCoverage()
    for record in (one, whole):
        record.requested(ErrorKind.TOKEN_DTYPE)
        record.built("build", (CONFIG,))
    for record in (two, whole):
        record.requested(ErrorKind.TOKEN_DTYPE)
        record.answered(
            "forward",
            ("m", np.zeros((1, 3), dtype=np.int64)),
            ForwardOutput(np.ones((1, 3, 5)) * 3),
        )
    merged = InputCoverage()
    merged.merge(one.take())
    merged.merge(two.take())
    assert merged.as_dict() == whole.as_dict()
    assert one.as_dict() == InputCoverage().as_dict()  # take() starts afresh


def test_the_section_names_the_kinds_never_requested() -> None:
    record = InputCoverage()
    for kind in ADAPTER_KINDS[1:]:
        record.requested(kind)
    text = render_coverage(record.as_dict())
    total = len(ADAPTER_KINDS)
    assert f"error kinds requested: {total - 1} of {total}; never: config-field-type" in text
    record.requested(ADAPTER_KINDS[0])
    assert "(every kind an adapter refuses)" in render_coverage(record.as_dict())
    assert record.missing_kinds() == []


def test_a_profile_that_asks_for_no_refusals_does_not_list_them_as_missing() -> None:
    text = render_coverage(InputCoverage().as_dict(), refusals_asked=False)
    total = len(ADAPTER_KINDS)
    assert f"error kinds requested: 0 of {total} (this profile's rules ask for none)" in text
    assert "never:" not in text
