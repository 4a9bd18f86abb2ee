"""Mutants in the model's structure: shapes, names, counts, and the tie."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import FloatArray, ForwardOutput, LossOutput, Parameters
from conformance.mutants.base import MutantBackend


class LogitsVocabularyFirst(MutantBackend):
    """Returns logits as ``[B, V, T]``. Rule: SHAPE-LOGITS."""

    name = "logits-vocabulary-first"

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        output = super().forward(model, tokens, shape)
        return ForwardOutput(np.swapaxes(output.logits, 1, 2).copy(), output.stages)


class LastBlockStageMissing(MutantBackend):
    """Reports every stage but the last block's. Rule: SHAPE-BLOCKS."""

    name = "last-block-stage-missing"

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        output = super().forward(model, tokens, shape)
        stages = output.stages or []
        if model.config.layers:
            stages = [stage for stage in stages if stage[0] != f"block-{model.config.layers - 1}"]
        return ForwardOutput(output.logits, stages)


class QueryKeyNamesSwapped(MutantBackend):
    """Lists the key matrix under the query's name and the other way round. Rule: PARAM-NAMES."""

    name = "query-key-names-swapped"

    def parameters(self, model: Any) -> list[tuple[str, FloatArray]]:
        listed = super().parameters(model)
        for index, (name, value) in enumerate(listed):
            if name.endswith("attention.query.weight"):
                key_name, key_value = listed[index + 1]
                listed[index], listed[index + 1] = (key_name, value), (name, key_value)
        return listed


class SeparateHeadListed(MutantBackend):
    """Keeps an ``lm_head.weight`` beside the table (an untied head that starts as a copy).

    Rules: PARAM-COUNT, PARAM-NO-HEAD.
    """

    name = "separate-head-listed"

    def parameters(self, model: Any) -> list[tuple[str, FloatArray]]:
        listed = super().parameters(model)
        return [*listed[:-1], ("lm_head.weight", listed[0][1].copy()), listed[-1]]

    def build(self, config: Any, parameters: Parameters) -> Any:
        return super().build(config, [(n, v) for n, v in parameters if n != "lm_head.weight"])


class HiddenCopiedHead(MutantBackend):
    """The head is a private copy of the table taken at build time: equal values, no tie.

    Forward results are exact; the table never receives the output-role gradient.
    Rule: TIE-OUTPUT-ROLE.
    """

    name = "hidden-copied-head"

    def loss(
        self,
        model: Any,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        # The copy takes the output-role gradient; the table keeps only its lookup role.
        return super().loss(model, tokens, targets, detach_lookup=detach_lookup, detach_head=True)
