"""A catalogue of deliberately broken backends the suite must reject.

Each mutant differs from the reference in exactly one way a real implementer could get
wrong. Its entry names the mistake, the rule expected to catch it, and the rule categories
whose rules count as catching it for the right reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.rules import RuleCategory

__all__ = ["CONTROLS", "MUTANTS", "Mutant"]

C = RuleCategory


@dataclass(frozen=True)
class Mutant:
    """One broken backend: where it lives, what is wrong, and what should notice."""

    name: str
    adapter: str
    mistake: str
    rule: str
    related: frozenset[RuleCategory]


def _mutant(
    module: str, cls: str, name: str, mistake: str, rule: str, *related: RuleCategory
) -> Mutant:
    return Mutant(name, f"conformance.mutants.{module}:{cls}", mistake, rule, frozenset(related))


MUTANTS: tuple[Mutant, ...] = (
    # Configuration and error precedence.
    _mutant("inputs", "DivisibilityCheckedFirst", "divisibility-checked-first", "the width-divisible-by-heads rule checked before the others", "ERR-CONFIG-ORDER", C.CONFIGURATION),
    _mutant("inputs", "DepthZeroUnvalidated", "depth-zero-unvalidated", "a zero-block configuration is not validated", "ERR-CONFIG-DEPTH0", C.CONFIGURATION),
    _mutant("inputs", "NegativeEpsilonAccepted", "negative-epsilon-accepted", "a negative RMSNorm epsilon is accepted", "ERR-CONFIG-KIND", C.CONFIGURATION),
    # Context and vocabulary bounds, targets.
    _mutant("inputs", "ContextOffByOne", "context-off-by-one", "a sequence as long as the context is refused", "ERR-CONTEXT-LIMIT", C.CONFIGURATION, C.INPUTS),
    _mutant("inputs", "TokenIdsWrapAround", "token-ids-wrap-around", "out-of-vocabulary token IDs wrap around", "ERR-TOKEN-ID", C.INPUTS),
    _mutant("inputs", "TargetIdsClipped", "target-ids-clipped", "out-of-vocabulary target IDs are clipped", "ERR-TARGET-ID", C.INPUTS),
    _mutant("inputs", "TokenIdsCheckedBeforeTargets", "token-ids-checked-before-targets", "the loss checks token IDs before its targets", "ERR-LOSS-ORDER", C.INPUTS),
    # Shapes, names, order, count, tying.
    _mutant("structure", "LogitsVocabularyFirst", "logits-vocabulary-first", "logits laid out [B, V, T]", "SHAPE-LOGITS", C.SHAPES),
    _mutant("structure", "LastBlockStageMissing", "last-block-stage-missing", "the last block's stage is not reported", "SHAPE-BLOCKS", C.SHAPES),
    _mutant("structure", "QueryKeyNamesSwapped", "query-key-names-swapped", "query and key matrices listed under each other's names", "PARAM-NAMES", C.PARAMETERS),
    _mutant("structure", "SeparateHeadListed", "separate-head-listed", "an untied lm_head that starts as a copy of the table", "PARAM-COUNT", C.PARAMETERS),
    _mutant("structure", "HiddenCopiedHead", "hidden-copied-head", "a private copy of the table serves as the head", "TIE-OUTPUT-ROLE", C.TYING),
    # Causality.
    _mutant("numerics", "MaskSeesNextToken", "mask-sees-next-token", "the causal mask lets position t see t + 1", "CAUSAL-PREFIX-BITWISE", C.CAUSALITY),
    _mutant("numerics", "MaskWithFiniteFill", "mask-with-finite-fill", "future scores set to -30 instead of -inf (a 1e-13 leak)", "CAUSAL-PREFIX-BITWISE", C.CAUSALITY),
    # RoPE.
    _mutant("numerics", "RopeKeysOneAhead", "rope-keys-one-ahead", "keys rotated one position ahead of queries", "VALUE-STAGES", C.VALUES),
    _mutant("numerics", "RopeRotateHalfPairs", "rope-rotate-half-pairs", "RoPE pairs features j and j + hw/2", "VALUE-STAGES", C.VALUES),
    _mutant("numerics", "RopeFrequencyExponentHalved", "rope-frequency-exponent-halved", "RoPE frequencies base^(-j/hw)", "VALUE-STAGES", C.VALUES),
    _mutant("numerics", "RopeFrequenciesInFloat32", "rope-frequencies-in-float32", "RoPE frequencies rounded to float32 (about 1e-7)", "VALUE-STAGES", C.VALUES),
    _mutant("numerics", "RopeOnValues", "rope-on-values", "RoPE applied to the values too", "VALUE-STAGES", C.VALUES),
    # RMSNorm.
    _mutant("numerics", "RmsEpsilonOutsideRoot", "rms-epsilon-outside-root", "epsilon added outside the square root (about 1e-6)", "VALUE-STAGES", C.DEPTH, C.VALUES),
    _mutant("numerics", "RmsOverTokenAxis", "rms-over-token-axis", "RMSNorm's mean taken over positions", "CAUSAL-PREFIX-BITWISE", C.CAUSALITY, C.BATCH),
    _mutant("numerics", "NormWithoutNormalization", "norm-without-normalization", "RMSNorm only multiplies by its gain", "DEPTH-ZERO-FORMULA", C.DEPTH, C.VALUES),
    # Attention scaling and head layout.
    _mutant("numerics", "AttentionScaledByModelWidth", "attention-scaled-by-model-width", "scores divided by sqrt(d), not sqrt(hw)", "VALUE-STAGES", C.VALUES),
    _mutant("numerics", "HeadsStrided", "heads-strided", "heads take strided, not contiguous, features", "VALUE-STAGES", C.VALUES),
    # SwiGLU.
    _mutant("numerics", "GateSigmoidNotSilu", "gate-sigmoid-not-silu", "the gate uses sigmoid instead of SiLU", "VALUE-STAGES", C.VALUES),
    _mutant("numerics", "SiluOnUpBranch", "silu-on-up-branch", "SiLU applied to the up branch", "VALUE-STAGES", C.VALUES),
    # Residual and norm placement.
    _mutant("numerics", "PostNormBlocks", "post-norm-blocks", "blocks normalize after the residual add", "VALUE-STAGES", C.VALUES),
    _mutant("numerics", "FeedForwardResidualDropped", "feed-forward-residual-dropped", "the feed-forward output replaces the stream", "VALUE-STAGES", C.VALUES),
    # Loss averaging.
    _mutant("training", "LossSummedNotAveraged", "loss-summed-not-averaged", "the loss sums over positions", "LOSS-MEAN-NLL", C.LOSS),
    _mutant("training", "LossAveragedPerSequence", "loss-averaged-per-sequence", "the loss averages per sequence, then sums", "LOSS-MEAN-NLL", C.LOSS),
    # Initialization recipe and transactions.
    _mutant("training", "XavierFilledColumnMajor", "xavier-filled-column-major", "Xavier matrices filled column by column", "INIT-RECIPE", C.INITIALIZATION),
    _mutant("training", "StreamAdvancedBeforeValidation", "stream-advanced-before-validation", "the stream is drawn from before validation", "INIT-STREAM-ADVANCE", C.INITIALIZATION, C.TRANSACTIONS),
    # Determinism.
    _mutant("training", "GradientsAccumulateAcrossCalls", "gradients-accumulate-across-calls", "gradients are not reset between calls", "DET-REPEAT", C.DETERMINISM),
    _mutant("training", "NondeterministicScores", "nondeterministic-scores", "attention scores carry 1e-15 run-to-run noise", "DET-REPEAT", C.DETERMINISM),
    # Backward-only bugs: the forward pass is exact.
    _mutant("training", "RmsBackwardWithoutMeanTerm", "rms-backward-without-mean-term", "RMSNorm backward without its mean-square term", "GRAD-ORACLE", C.GRADIENTS),
    _mutant("training", "SiluBackwardIsSigmoid", "silu-backward-is-sigmoid", "SiLU backward uses sigmoid(u)", "GRAD-ORACLE", C.GRADIENTS),
    _mutant("training", "SoftmaxBackwardWithoutSumTerm", "softmax-backward-without-sum-term", "softmax backward without its sum term", "GRAD-ORACLE", C.GRADIENTS),
    _mutant("training", "OutputWeightGradientTransposed", "output-weight-gradient-transposed", "the attention output matrix's gradient transposed", "GRAD-ORACLE", C.GRADIENTS),
)  # fmt: skip

# Correct backends: a suite that rejects them is as broken as one that accepts the mutants.
CONTROLS: tuple[tuple[str, str, str | None], ...] = (
    ("reference", "reference", None),
    (
        "reference-over-subprocess",
        "subprocess",
        "{python} -m conformance.adapters.reference_server",
    ),
)

del C
