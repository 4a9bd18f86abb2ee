"""The strategies build what they promise, and the reference refuses what the spec expects."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl.errors import DecoderModelError
from impl.model import DecoderModel
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.strategies import (
    CONFIG_RULE_ORDER,
    config_rule_pairs,
    configs,
    configs_breaking,
    invalid_configs,
    invalid_token_inputs,
    perturbed_parameter_lists,
    runs,
    token_batches,
)
from spec.validation import (
    broken_config_rules,
    config_violation,
    loss_violation,
    rebuild_violation,
    token_violation,
)


@given(config=configs())
def test_valid_configs_break_no_rule(config: DecoderConfig) -> None:
    assert config_violation(config) is None
    assert config.model_width % (2 * config.heads) == 0


@given(pair=invalid_configs())
def test_invalid_configs_expect_the_earliest_broken_rule(
    pair: tuple[DecoderConfig, ErrorKind],
) -> None:
    config, expected = pair
    found = config_violation(config)
    assert found is not None and found.kind is expected
    with pytest.raises(DecoderModelError) as caught:
        DecoderModel.from_seed(config, 0)
    assert caught.value.kind is expected


@pytest.mark.parametrize("kind", [ErrorKind.ZERO_HEAD_COUNT, ErrorKind.INVALID_RMS_EPSILON])
def test_invalid_configs_can_aim_at_one_rule(kind: ErrorKind) -> None:
    @given(pair=invalid_configs(kind))
    def check(pair: tuple[DecoderConfig, ErrorKind]) -> None:
        assert pair[1] is kind
        violation = config_violation(pair[0])
        assert violation is not None and violation.kind is kind

    check()


@given(data=st.data())
def test_token_strategies(data: st.DataObject) -> None:
    config = data.draw(configs())
    tokens = data.draw(token_batches(config))
    assert token_violation(config, tokens) is None
    tokens, targets = data.draw(runs(config))
    assert tokens.shape == targets.shape and loss_violation(config, tokens, targets) is None
    bad, shape, expected = data.draw(invalid_token_inputs(config))
    found = token_violation(config, bad, shape)
    assert found is not None and found.kind is expected
    with pytest.raises(DecoderModelError) as caught:
        DecoderModel.from_seed(config, 0).forward(bad, shape)  # type: ignore[arg-type]
    assert caught.value.kind is expected


@given(data=st.data())
def test_perturbed_parameter_lists(data: st.DataObject) -> None:
    config = data.draw(configs(max_layers=2))
    state = DecoderModel.from_seed(config, 1).state()
    entries, expected = data.draw(perturbed_parameter_lists(config, state))
    found = rebuild_violation(config, entries)
    assert found is not None and found.kind is expected
    with pytest.raises(DecoderModelError) as caught:
        DecoderModel.from_parameters(config, entries)
    assert caught.value.kind is expected


@given(tokens=token_batches(DecoderConfig(5, 4, 2, 4, 1, 7), full_context=True))
def test_full_context_reaches_the_last_position(tokens: np.ndarray) -> None:  # type: ignore[type-arg]
    assert tokens.shape[1] == 7


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: configs(max_heads=0), "max_heads=0 must be at least 1"),
        (lambda: configs(min_layers=3, max_layers=2), "min_layers=3 is larger than max_layers=2"),
        (lambda: configs(max_head_width=1), "max_head_width=1 must be at least 2"),
        (
            lambda: token_batches(DecoderConfig(5, 4, 2, 4, 1, 4), max_batch=0),
            "max_batch=0 must be at least 1",
        ),
        (lambda: invalid_configs(ErrorKind.TOKEN_RANK), "is not a configuration rule"),
    ],
)
def test_strategy_arguments_are_checked_early(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(("earlier", "later"), config_rule_pairs(), ids=str)
def test_each_config_rule_pair_breaks_both_rules(earlier: ErrorKind, later: ErrorKind) -> None:
    """A pair that left its later rule intact would test the earlier one alone, and a port
    checking the two the other way round would pass it."""

    @given(config=configs_breaking(earlier, later))
    def check(config: DecoderConfig) -> None:
        found = config_violation(config)
        assert found is not None and found.kind is earlier
        assert later in broken_config_rules(config)
        if earlier is not ErrorKind.CONFIG_FIELD_TYPE:
            assert earlier in broken_config_rules(config)

    check()


def test_config_rule_pairs_cover_every_pair_that_can_break_together() -> None:
    pairs = config_rule_pairs()
    assert (ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE, ErrorKind.ODD_HEAD_WIDTH) in pairs
    assert all((ErrorKind.CONFIG_FIELD_TYPE, kind) in pairs for kind in CONFIG_RULE_ORDER)
    # 10 rules give 45 pairs; zero width or zero heads with divisibility or parity cannot.
    assert len(pairs) == 45 - 4
    with pytest.raises(ValueError, match="no configuration breaks both"):
        configs_breaking(ErrorKind.ZERO_HEAD_COUNT, ErrorKind.ODD_HEAD_WIDTH)
