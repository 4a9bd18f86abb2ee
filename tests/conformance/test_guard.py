"""The guard's one-line adapter errors, and the advice an escaped allocation failure gets."""

from __future__ import annotations

from typing import Any

import pytest

from conformance.adapters.reference import ReferenceBackend
from conformance.guard import AdapterFault, GuardedBackend, allocation_hint
from spec.config import FIXTURE
from spec.recipe import initial_parameters


class _Failing(ReferenceBackend):
    """The reference, except that the chosen method raises the chosen error."""

    def __init__(self, method: str, error: Exception) -> None:
        super().__init__()
        self._method, self._error = method, error

    def build(self, *arguments: Any, **keywords: Any) -> Any:
        if self._method == "build":
            raise self._error
        return super().build(*arguments, **keywords)

    def forward(self, *arguments: Any, **keywords: Any) -> Any:
        if self._method == "forward":
            raise self._error
        return super().forward(*arguments, **keywords)


def _fault(method: str, error: Exception) -> str:
    guarded = GuardedBackend(_Failing(method, error))
    with pytest.raises(AdapterFault) as caught:
        model = guarded.build(FIXTURE.config, initial_parameters(FIXTURE.config, 0))
        guarded.forward(model, [[0, 1]])
    return str(caught.value)


@pytest.mark.parametrize(
    ("method", "error", "kind"),
    [
        ("forward", MemoryError("Unable to allocate 512. GiB for an array"), "ACTIVATION"),
        ("forward", RuntimeError("DefaultCPUAllocator: can't allocate memory"), "ACTIVATION"),
        ("build", ValueError("array is too big; `arr.size * arr.itemsize` is larger"), "PARAMETER"),
        ("build", RuntimeError("backend failed 'build' ('internal'): std::bad_alloc"), "PARAMETER"),
    ],
)
def test_an_escaped_allocation_failure_is_told_which_refusal_it_should_be(
    method: str, error: Exception, kind: str
) -> None:
    first, advice = _fault(method, error).splitlines()[:2]
    assert first.startswith(f"adapter error in {method}: {type(error).__name__}: "), first
    assert f"raise Refusal(ErrorKind.{kind}_ALLOCATION_FAILED, message)" in advice, advice


def test_other_adapter_errors_get_no_allocation_advice() -> None:
    message = _fault("forward", IndexError("index 5 is out of bounds for axis 0 with size 3"))
    assert message.startswith("adapter error in forward: IndexError: index 5 is out of bounds")
    assert "Refusal" not in message
    assert allocation_hint("forward", ValueError("token 9 is too big for a table of 5")) == ""
    assert allocation_hint("parameters", MemoryError()) == ""  # no refusal kind for a read


def test_the_call_shows_few_ids_and_only_the_shape_of_many() -> None:
    """The IDs a backend failed on are what its author looks at; a long sequence is a shape."""
    error = IndexError("index 5 is out of bounds for axis 0 with size 3")
    guarded = GuardedBackend(_Failing("forward", error))
    model = guarded.build(FIXTURE.config, initial_parameters(FIXTURE.config, 0))
    for tokens, shown in (([[0, 1]], "tokens [1, 2] [[0, 1]])"), ([[0] * 25], "tokens [1, 25])")):
        with pytest.raises(AdapterFault) as caught:
            guarded.forward(model, tokens)
        assert str(caught.value).splitlines()[0].endswith(shown), str(caught.value)
    with pytest.raises(AdapterFault) as caught:
        guarded.forward(model, [0, 1], (1, 2))  # flat IDs: the third argument is their shape
    assert str(caught.value).splitlines()[0].endswith("tokens [2] [0, 1], shape=(1, 2))")
