"""The contract check tells a backend that writes into the arrays it is given so, in one
line, instead of letting the next call meet other values (a misleading round-trip or
flat-IDs complaint, or a wrong verdict on a later rule)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conformance.adapter import ForwardOutput, LossOutput
from conformance.adapters.reference import ReferenceBackend
from conformance.contract import check_contract


class _TransposesTheCallersMatrices(ReferenceBackend):
    """Builds from its own copies, then turns the caller's square matrices to [out, in]."""

    def build(self, config: Any, parameters: Any) -> Any:
        model = super().build(config, [(name, np.array(value)) for name, value in parameters])
        for _, value in parameters:
            if value.ndim == 2 and value.shape[0] == value.shape[1]:
                value[...] = value.T.copy()
        return model


class _ClampsTheCallersTokens(ReferenceBackend):
    """Answers, then clamps the caller's IDs in place (torch.from_numpy(ids).clamp_)."""

    def forward(self, model: Any, tokens: Any, shape: Any = None) -> Any:
        output = super().forward(model, tokens, shape)
        np.clip(tokens, 0, 1, out=tokens)
        return output


class _ShiftsTheCallersTargets(ReferenceBackend):
    """Answers, then shifts the caller's targets in place, as a labels.roll_ would."""

    def loss(self, model: Any, tokens: Any, targets: Any, **detach: bool) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        targets[...] = np.roll(targets, 1)
        return output


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        (
            _TransposesTheCallersMatrices(),
            "build: wrote into the parameter arrays it was given "
            "(blocks.0.attention.query.weight, blocks.0.attention.key.weight, "
            "blocks.0.attention.value.weight and others): copy them",
        ),
        (_ClampsTheCallersTokens(), "forward: wrote into the token IDs it was given"),
        (_ShiftsTheCallersTargets(), "loss: wrote into the target IDs it was given"),
    ],
)
def test_a_backend_writing_into_its_inputs_is_told_so_and_nothing_else(
    backend: ReferenceBackend, expected: str
) -> None:
    messages = [str(violation) for violation in check_contract(backend)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(expected), messages


class _OneBufferForEveryBlock(ReferenceBackend):
    """Every block stage is the last block's array: one buffer each block updated in place."""

    def forward(self, model: Any, tokens: Any, shape: Any = None) -> Any:
        output = super().forward(model, tokens, shape)
        assert output.stages is not None
        last = [value for name, value in output.stages if name.startswith("block-")][-1]
        stages = [(name, last if name.startswith("block-") else v) for name, v in output.stages]
        return ForwardOutput(output.logits, stages)


def test_stages_that_are_one_buffer_are_named() -> None:
    messages = [str(violation) for violation in check_contract(_OneBufferForEveryBlock())]
    assert messages == [
        "forward: stages block-0 and block-1 hold the same values: a stage list that keeps one "
        "buffer each block updates in place; return a copy of each stage"
    ], messages
