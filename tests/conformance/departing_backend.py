"""A reference backend that cannot build a model with no blocks, as llama.cpp cannot."""

from __future__ import annotations

from typing import Any

from conformance.adapter import Departure, Parameters
from conformance.adapters.reference import ReferenceBackend
from spec.config import DecoderConfig


class CannotBuildDepthZero(ReferenceBackend):
    """Fails at depth 0 without declaring it: every rule that draws depth 0 fails."""

    name = "cannot-build-depth-zero"

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        if config.layers == 0:
            raise RuntimeError("this engine cannot build a model with no blocks")
        return super().build(config, parameters)


class DeclaresNoDepthZero(CannotBuildDepthZero):
    """The same engine, its departure declared."""

    name = "declares-no-depth-zero"
    departures = frozenset({Departure.NO_DEPTH_ZERO})
