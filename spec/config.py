"""The configuration record of a tied decoder, and the seed's published fixture."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["FIXTURE", "REAL_FIELDS", "SIZE_FIELDS", "DecoderConfig", "Fixture"]


@dataclass(frozen=True)
class DecoderConfig:
    """Every dimension and numerical constant of one decoder model.

    The record accepts any values; a model validates them when it is built, so that a
    rejected configuration is reported with its specific error kind.
    """

    vocabulary_size: int
    model_width: int
    heads: int
    feed_forward_width: int
    layers: int
    context: int
    rope_base: float = 10000.0
    rms_epsilon: float = 1e-6

    @property
    def head_width(self) -> int:
        """Features per attention head (``model_width // heads``)."""
        return self.model_width // self.heads

    def as_dict(self) -> dict[str, int | float]:
        """The fields by name, in declaration order."""
        return asdict(self)


# The fields that hold sizes (non-negative integers) and those that hold real numbers.
SIZE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(DecoderConfig) if f.type == "int")
REAL_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(DecoderConfig) if f.type == "float")


@dataclass(frozen=True)
class Fixture:
    """A deterministic run: configuration, seed, tokens, targets and the gradient probe."""

    config: DecoderConfig
    seed: int
    tokens: tuple[tuple[int, ...], ...]
    targets: tuple[tuple[int, ...], ...]
    probe_table: tuple[float, ...]
    probe_gain: tuple[float, ...]
    probe_tokens: tuple[tuple[int, ...], ...]
    probe_targets: tuple[tuple[int, ...], ...]
    gradient_step: float = 1e-6
    gradient_tolerance: float = 2e-5


# fmt: off
_PROBE_TABLE = (
    0.8, -0.2, 0.1, 0.4,
    -0.3, 0.7, 0.2, -0.1,
    0.5, 0.1, -0.6, 0.3,
    -0.4, -0.2, 0.9, 0.1,
    0.2, 0.3, -0.1, 0.8,
)
# fmt: on

# The seed chapter's fixture (RECIPE.md, "Fixture constants").
FIXTURE = Fixture(
    config=DecoderConfig(
        vocabulary_size=5,
        model_width=4,
        heads=2,
        feed_forward_width=4,
        layers=2,
        context=4,
        rope_base=10000.0,
        rms_epsilon=1e-6,
    ),
    seed=32,
    tokens=((0, 1, 2),),
    targets=((1, 2, 3),),
    # Five rows of four, one per vocabulary ID.
    probe_table=_PROBE_TABLE,
    probe_gain=(1.0, 0.9, 1.1, 0.8),
    probe_tokens=((0, 1),),
    probe_targets=((1, 2),),
)
