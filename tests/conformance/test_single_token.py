"""VALUE-STAGES and VALUE-LOGITS at one token a sequence: the shape of a decoding step."""

from __future__ import annotations

from conformance.runner import run_suite
from conformance.test_values import ONE_TOKEN_EACH, SINGLE_TOKEN, SINGLE_TOKEN_HINT


def test_the_case_is_one_token_through_every_kind_of_layer() -> None:
    config = SINGLE_TOKEN.config
    assert SINGLE_TOKEN.tokens.shape == SINGLE_TOKEN.targets.shape == (1, 1)
    assert config.layers >= 2 and config.heads >= 2 and config.context > 1
    assert SINGLE_TOKEN.variant == "varied"  # gains other than 1
    assert ONE_TOKEN_EACH.config == config and ONE_TOKEN_EACH.tokens.shape == (3, 1)
    assert len(set(ONE_TOKEN_EACH.tokens[:, 0])) == 3  # a sequence given another's is seen


def test_a_single_token_shortcut_fails_the_value_rules_saying_where_to_look() -> None:
    adapter = "conformance.tools.mutants.numerics:SingleTokenSkipsOutputProjection"
    report = run_suite(adapter, profile="ci", rules=["VALUE-STAGES", "VALUE-LOGITS"])
    for rule_id in ("VALUE-STAGES", "VALUE-LOGITS"):
        rule = report.rule(rule_id)
        assert rule.status == "failed", report.output[-2000:]
        assert SINGLE_TOKEN_HINT in rule.message
        assert "tokens = [[11]]" in rule.message  # the case reproduced is the one-token one


def test_sequences_of_one_token_mixed_up_fail_saying_so() -> None:
    adapter = "conformance.tools.mutants.numerics:BatchedSingleTokensShareTheFirstAttention"
    report = run_suite(adapter, profile="ci", rules=["VALUE-STAGES"])
    rule = report.rule("VALUE-STAGES")
    assert rule.status == "failed", report.output[-2000:]
    assert SINGLE_TOKEN_HINT in rule.message
    assert "tokens = [[11], [4], [7]]" in rule.message
