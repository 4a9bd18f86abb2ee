"""Mutants in the model's structure: shapes, names, counts, and the tie."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import FloatArray, ForwardOutput, LossOutput, Parameters
from conformance.layouts import blocks_in_text_order, loaded_in_text_order
from conformance.tools.mutants.base import MutantBackend, mutant


@mutant("SHAPE-LOGITS")
class LogitsVocabularyFirst(MutantBackend):
    """Logits laid out [B, V, T]."""

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        output = super().forward(model, tokens, shape)
        return ForwardOutput(np.swapaxes(output.logits, 1, 2).copy(), output.stages)


@mutant("SHAPE-BLOCKS")
class LastBlockStageMissing(MutantBackend):
    """The last block's stage is not reported."""

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        output = super().forward(model, tokens, shape)
        stages = output.stages or []
        if model.config.layers:
            stages = [stage for stage in stages if stage[0] != f"block-{model.config.layers - 1}"]
        return ForwardOutput(output.logits, stages)


@mutant("PARAM-NAMES")
class QueryKeyNamesSwapped(MutantBackend):
    """Query and key matrices listed under each other's names."""

    def parameters(self, model: Any) -> list[tuple[str, FloatArray]]:
        listed = super().parameters(model)
        for index, (name, value) in enumerate(listed):
            if name.endswith("attention.query.weight"):
                key_name, key_value = listed[index + 1]
                listed[index], listed[index + 1] = (key_name, value), (name, key_value)
        return listed


@mutant("PARAM-COUNT")
class SeparateHeadListed(MutantBackend):
    """An untied lm_head that starts as a copy of the table, listed beside it.

    Caught by PARAM-COUNT (Vd scalars too many) and PARAM-NO-HEAD.
    """

    def parameters(self, model: Any) -> list[tuple[str, FloatArray]]:
        listed = super().parameters(model)
        return [*listed[:-1], ("lm_head.weight", listed[0][1].copy()), listed[-1]]

    def build(self, config: Any, parameters: Parameters) -> Any:
        return super().build(config, [(n, v) for n, v in parameters if n != "lm_head.weight"])


@mutant("PARAM-NAMES")
class BlocksListedInTextOrder(MutantBackend):
    """Blocks listed 0, 1, 10, 11, 2, ...: kept in a map keyed by the index as text.

    Computation right; only the list's order is wrong, and only past ten blocks.
    """

    def parameters(self, model: Any) -> list[tuple[str, FloatArray]]:
        return blocks_in_text_order(super().parameters(model), model.config.layers)


@mutant("VALUE-STAGES")
class BlocksLoadedInTextOrder(MutantBackend):
    """A parameter list's block groups assigned in turn to blocks 0, 1, 10, 11, 2, ...

    As a loader that walks a checkpoint's sorted names and fills the blocks one after
    another does: past ten blocks, block 2 gets block 10's weights.
    """

    def build(self, config: Any, parameters: Parameters) -> Any:
        listed = list(parameters)
        try:
            loaded = loaded_in_text_order(listed, config.layers)
        except (AttributeError, TypeError, ValueError):  # malformed: refused as the reference
            return super().build(config, parameters)
        return super().build(config, loaded)


@mutant("TIE-OUTPUT-ROLE")
class HiddenCopiedHead(MutantBackend):
    """A private copy of the table serves as the head: equal values, no tie.

    Forward results are exact; the table never receives the output-role gradient.
    """

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
