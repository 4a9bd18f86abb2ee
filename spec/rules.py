"""The rule registry: every checkable statement about a conforming decoder, with a stable ID.

A rule is written once here and applied to a backend by the conformance suite. IDs never
change meaning; a retired rule keeps its ID out of circulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["RULES", "Capability", "Rule", "RuleCategory", "rule", "rules_in"]


class RuleCategory(StrEnum):
    """What part of the model a rule is about."""

    PROTOCOL = "protocol"
    CONFIGURATION = "configuration"
    INPUTS = "inputs"
    REBUILD = "rebuild"
    SHAPES = "shapes"
    PARAMETERS = "parameters"
    TYING = "tying"
    CAUSALITY = "causality"
    BATCH = "batch"
    DEPTH = "depth"
    DETERMINISM = "determinism"
    INITIALIZATION = "initialization"
    TRANSACTIONS = "transactions"
    LOSS = "loss"
    VALUES = "values"
    GRADIENTS = "gradients"
    GOLDEN = "golden"
    SCALE = "scale"  # run by the scale profile only, against the float64 reference


class Capability(StrEnum):
    """An optional part of a backend; a rule that needs one the backend lacks is skipped."""

    STAGES = "stages"  # forward returns every residual-stream stage, not only logits
    GRADIENTS = "gradients"  # loss returns the gradient of every named parameter
    TIED_ROLES = "tied-roles"  # loss can detach the lookup or the head use of the table
    CONFIG_ERRORS = "config-errors"  # invalid configurations are refused with spec kinds
    INPUT_ERRORS = "input-errors"  # invalid tokens and targets are refused with spec kinds
    REBUILD_ERRORS = "rebuild-errors"  # invalid parameter lists are refused with spec kinds
    SEEDED_INIT = "seeded-init"  # build_seeded(config, seed) follows the recipe
    STREAM_INIT = "stream-init"  # initialize(config, stream) draws from a caller's stream


@dataclass(frozen=True)
class Rule:
    """One rule: a stable ID, a one-line statement, a category, where the seed says it, and
    the capabilities a backend needs for the rule to be checked at all."""

    id: str
    statement: str
    category: RuleCategory
    source: str
    needs: tuple[Capability, ...] = ()


# Where the seed chapter (or the recipe that completes it) states each rule.
_CONFIG = "seed: 'Validate vocabulary, dimensions, depth, context, RoPE, and normalization'"
_ERRORS = "seed: 'Attribute each complete-model failure to the boundary that rejected it'"
_LAYER = "seed: 'Compose lookup, distinct blocks, final RMSNorm, tied logits, indexed loss'"
_AXES = "seed: 'Predict the axes before tracing the decoder'"
_FORMULA = "seed: 'Reuse the embedding table at the far end of the stack'"
_ROLES = "seed: 'Distinguish one parameter from its two uses'"
_ANSWERS = "seed: 'Check the structural answers'"
_GRADCHECK = "seed: 'Check the tied table and final gain numerically'"
_EVIDENCE = "seed: 'Collect one coherent evidence record'"
_RECIPE = "RECIPE.md"
_SCALE = "project rule (issue 22): spec/scale.py's shapes, the float64 reference as the oracle"

# fmt: off
C = RuleCategory
K = Capability
RULES: tuple[Rule, ...] = (
    Rule("ADAPTER-CONTRACT", "The adapter returns what the protocol says: numpy arrays of its precision, stable names, every gradient in a dict, the refusals it declares.", C.PROTOCOL, "the adapter protocol (conformance/adapter.py, PROTOCOL.md)"),
    Rule("ERR-CONFIG-KIND", "Each configuration rule, broken alone, is refused with its own error kind.", C.CONFIGURATION, _CONFIG, needs=(K.CONFIG_ERRORS,)),
    Rule("ERR-CONFIG-ORDER", "When several configuration rules are broken (a wrong-typed field among them), the first in the documented order is reported.", C.CONFIGURATION, f"{_CONFIG}; {_RECIPE} 'Validation order'", needs=(K.CONFIG_ERRORS,)),
    Rule("ERR-CONFIG-DEPTH0", "A zero-block configuration is validated as strictly as a deep one.", C.CONFIGURATION, "seed: 'DecoderModelConfig validates all architecture settings even when N=0'", needs=(K.CONFIG_ERRORS,)),
    Rule("CONFIG-VALID-BUILDS", "Every configuration that breaks no rule builds and runs, depth 0 included.", C.CONFIGURATION, "seed: 'This implementation accepts zero, one, or more blocks'"),
    Rule("ERR-TOKEN-SHAPE", "Token IDs that are not a non-empty [batch, tokens] integer array are refused with their kind; any integer type is taken (targets too).", C.INPUTS, _ERRORS, needs=(K.INPUT_ERRORS,)),
    Rule("ERR-CONTEXT-LIMIT", "A sequence longer than the context capacity is refused; one exactly as long is accepted.", C.INPUTS, _LAYER, needs=(K.INPUT_ERRORS,)),
    Rule("ERR-TOKEN-ID", "A token ID outside [0, V) is a vocabulary-input error naming its first flat position.", C.INPUTS, _ANSWERS, needs=(K.INPUT_ERRORS,)),
    Rule("ERR-TOKEN-ORDER", "Token checks run in order: dtype, rank, batch, length, context, overflow, count, then the first bad ID.", C.INPUTS, f"seed: validate_tokens; {_RECIPE} 'Validation order'", needs=(K.INPUT_ERRORS,)),
    Rule("ERR-TARGET-COUNT", "A loss call without exactly one target per token is a target-shape error; B*T targets, [B, T] or one flat row, are one per token.", C.INPUTS, _ANSWERS, needs=(K.INPUT_ERRORS,)),
    Rule("ERR-TARGET-ID", "A target ID outside [0, V) is a target-ID error naming its first flat position.", C.INPUTS, _ERRORS, needs=(K.INPUT_ERRORS,)),
    Rule("ERR-LOSS-ORDER", "The loss checks the token shape (dtype to count) first, then target dtype, count and IDs, and only then the token IDs.", C.INPUTS, f"seed: 'loss first checks one valid target per token'; {_RECIPE} 'Validation order'", needs=(K.INPUT_ERRORS,)),
    Rule("ERR-SEED-EXAMPLES", "Zero heads, a too-long sequence, token ID V and a missing target are configuration, context, vocabulary-input and target-shape failures.", C.INPUTS, _ANSWERS, needs=(K.CONFIG_ERRORS, K.INPUT_ERRORS,)),
    Rule("ERR-RMS-ZERO", "With epsilon 0, an RMSNorm row of mean square exactly 0 is refused (rms-zero-mean-square), not made NaN; with epsilon > 0 it is ordinary.", C.INPUTS, f"{_RECIPE} 'Forward': 'With eps = 0 a row whose mean square is exactly 0 is an error (not a NaN)'", needs=(K.INPUT_ERRORS,)),
    Rule("ERR-SEED-RANGE", "A seed outside [0, 2^64 - 1] is refused as invalid-seed, after the configuration is checked.", C.INITIALIZATION, f"{_RECIPE} 'Initialization'", needs=(K.SEEDED_INIT, K.CONFIG_ERRORS,)),
    Rule("ERR-RESOURCES", "2^70 parameter scalars are refused as parameter-allocation-failed; 2^18 positions as activation-allocation-failed, or computed right.", C.INPUTS, "seed: LayerAllocationFailed, ParameterAllocationFailed; project rule (issue 19)", needs=(K.INPUT_ERRORS,)),
    Rule("REBUILD-MEMORY-LAYOUT", "Parameters, tokens and targets in Fortran order or as strided views give the logits and loss of C-ordered copies.", C.REBUILD, "project rule: an array is its values, whatever its memory layout"),
    Rule("REBUILD-ROUNDTRIP", "Rebuilding from a model's own named parameter list reproduces its logits bitwise.", C.REBUILD, "seed: 'Stable order also defines one reusable decoder parameter layout'"),
    Rule("ERR-REBUILD-COUNT", "A parameter list without exactly 2 + 9N tensors is refused as a count mismatch.", C.REBUILD, "seed: validate_parameter_layout", needs=(K.REBUILD_ERRORS,)),
    Rule("ERR-REBUILD-NAMES", "A parameter list with a wrong name is refused at the first mismatching index, before shapes are checked.", C.REBUILD, "seed: validate_parameter_layout", needs=(K.REBUILD_ERRORS,)),
    Rule("ERR-REBUILD-SHAPES", "A parameter of the wrong shape is refused at its index, before any parameter's dtype or values are checked.", C.REBUILD, "seed: validate_parameter_layout", needs=(K.REBUILD_ERRORS,)),
    Rule("ERR-REBUILD-VALUES", "A parameter holding NaN or infinity is refused at its index rather than silently propagated.", C.REBUILD, "project rule (not in the seed)", needs=(K.REBUILD_ERRORS,)),
    Rule("ERR-REBUILD-DTYPES", "A complex or bool parameter is refused as parameter-dtype at its index, before any value check; integer and float32 arrays are accepted.", C.REBUILD, "seed: validate_parameter_layout; project rule (issue 19)", needs=(K.REBUILD_ERRORS,)),
    Rule("SHAPE-EMBEDDING", "The lookup E[z] has shape [B, T, d].", C.SHAPES, _AXES, needs=(K.STAGES,)),
    Rule("SHAPE-BLOCKS", "There is one block output per block, each of shape [B, T, d].", C.SHAPES, _AXES, needs=(K.STAGES,)),
    Rule("SHAPE-FINAL-NORM", "The final RMSNorm output has shape [B, T, d].", C.SHAPES, _AXES, needs=(K.STAGES,)),
    Rule("SHAPE-LOGITS", "The logits have shape [B, T, V].", C.SHAPES, _AXES),
    Rule("SHAPE-PARAMETERS", "Each named parameter has the shape its name implies: [V,d], [d], [d,d], [d,f] or [f,d].", C.SHAPES, f"{_RECIPE} 'Parameter list'"),
    Rule("PARAM-COUNT", "The model owns Vd + N(4d^2 + 3df + 2d) + d scalars, Vd fewer than an untied model.", C.PARAMETERS, _FORMULA),
    Rule("PARAM-NAMES", "The parameters are exactly the 2 + 9N stable names, in the stable order.", C.PARAMETERS, _ANSWERS),
    Rule("PARAM-NAME-GRAMMAR", "Parameter names are unique lowercase ASCII letters, digits, '_' and '.', with no empty segment.", C.PARAMETERS, f"{_RECIPE} 'Parameter list'"),
    Rule("PARAM-NO-HEAD", "There is no lm_head or other output-head parameter, and no bias anywhere.", C.PARAMETERS, _ROLES),
    Rule("TIE-SINGLE-LEAF", "One table serves lookup and projection: changing its row v changes both E[v] and logit column v.", C.TYING, _ROLES),
    Rule("TIE-GRADIENT-SUM", "The table's gradient is its lookup-role plus its output-role part, each measured with the other use detached, and neither is missing.", C.TYING, _ROLES, needs=(K.GRADIENTS, K.TIED_ROLES,)),
    Rule("TIE-OUTPUT-ROLE", "The table's gradient includes the output role (rows never looked up receive it); a head that merely copies the table is not tied.", C.TYING, _ROLES, needs=(K.GRADIENTS, K.STAGES,)),
    Rule("CAUSAL-PREFIX-BITWISE", "Changing only token t leaves every logit row before t bitwise unchanged (full-length runs, drawn ones and t = 4700-4714 of 4715).", C.CAUSALITY, _ANSWERS),
    Rule("CAUSAL-POSITION-CHANGES", "Changing token t changes logit row t.", C.CAUSALITY, _EVIDENCE),
    Rule("CAUSAL-LONG-REACH", "At 4715 positions in one block, setting tokens 0-618 to another token changes logit row 4714: the last row sees every earlier key.", C.CAUSALITY, f"{_LAYER} (causal attention: every position up to its own); project rule: an attention window carried over from another model (Mistral's 4096 keys) hides the first keys from rows past it, at any precision, where a 16-bit bound at 4715 positions is too wide to see it"),
    Rule("BATCH-INDEPENDENCE", "A sequence's logits do not depend on the other sequences in its batch.", C.BATCH, _FORMULA),
    Rule("DEPTH-ZERO-FORMULA", "With no blocks the logits are RMSNorm(E[z]) E^T.", C.DEPTH, _FORMULA),
    Rule("DET-REPLAY", "The same configuration and seed give bitwise identical parameters and logits.", C.DETERMINISM, _EVIDENCE, needs=(K.SEEDED_INIT,)),
    Rule("DET-REPEAT", "Running the same model on the same input twice gives bitwise identical logits, loss and gradients.", C.DETERMINISM, _EVIDENCE),
    Rule("DET-HISTORY", "A call's results do not depend on earlier calls (shorter, longer, other batches), and later calls leave returned arrays as they were.", C.DETERMINISM, "seed: forward and loss are functions of the parameters and their inputs; project rule: a cache sized by an earlier call"),
    Rule("INIT-RECIPE", "Initial parameters for (config, seed) are the SplitMix64/Xavier draws in the stable order, gains at one.", C.INITIALIZATION, f"{_RECIPE} 'Initialization'", needs=(K.SEEDED_INIT,)),
    Rule("INIT-STREAM-ADVANCE", "Successful initialization advances the random stream by exactly the number of matrix scalars.", C.INITIALIZATION, f"{_RECIPE} 'Initialization'", needs=(K.STREAM_INIT,)),
    Rule("TXN-INIT", "A refused construction leaves the caller's random stream exactly as it was.", C.TRANSACTIONS, "seed: 'Initialization uses a trial random stream'", needs=(K.STREAM_INIT, K.CONFIG_ERRORS,)),
    Rule("TXN-CALL", "A refused forward or loss call leaves every parameter and accumulated gradient unchanged.", C.TRANSACTIONS, "project standard: bad input changes nothing", needs=(K.INPUT_ERRORS,)),
    Rule("LOSS-MEAN-NLL", "The loss is the mean over all B*T positions of -log softmax(logits[b, t])[target[b, t]].", C.LOSS, _FORMULA),
    Rule("VALUE-STAGES", "Every stage (lookup, each block, final norm) agrees with the high-precision oracle within tolerance.", C.VALUES, _FORMULA, needs=(K.STAGES,)),
    Rule("VALUE-LOGITS", "The logits and the loss agree with the high-precision oracle within tolerance.", C.VALUES, _FORMULA),
    Rule("VALUE-LARGE-LOGITS", "With logits in the thousands (a final gain of 1000), logits, loss and gradients (at the model's scale) stay finite and match the oracle.", C.VALUES, f"{_FORMULA}; project rule (issue 19): a softmax without its row maximum overflows there"),
    Rule("VALUE-LARGE-SCORES", "With attention scores in the thousands (query and key matrices x16), stages, logits, loss and gradients stay finite and match the oracle.", C.VALUES, f"{_FORMULA}; project rule: an attention softmax without its row maximum overflows there, or gives 0 / 0 on a row of very negative scores"),
    Rule("VALUE-LARGE-GATES", "With SwiGLU gate inputs in the hundreds (gate matrices x64, down /64), stages, logits, loss and gradients stay finite and match the oracle.", C.VALUES, f"{_FORMULA}; project rule: a sigmoid written exp(u) / (1 + exp(u)), or a SiLU slope written with exp(-u), overflows there"),
    Rule("VALUE-LARGE-IDS", "With 70,001 entries, token and target IDs past 255, 2,048 and 65,535 select their own rows: values and gradients match the reference.", C.VALUES, f"{_SCALE}; project rule: an ID kept in 8 or 16 bits, or in a bfloat16 or float16 array, reads another row"),
    Rule("VALUE-WIDE-HEADS", "With heads of width 128 over 80 positions, stages, logits, loss and gradients match the float64 reference within the bounds measured there.", C.VALUES, f"{_SCALE}; project rule: every generated head is at most 8 wide and every drawn sequence short, so RoPE over only part of a wide head, or a kernel for wide heads or for tiles of 64 positions, is seen only here"),
    Rule("VALUE-ODD-WIDTHS", "With heads of 70, width 210, SwiGLU 333, vocabulary 131 and 67 positions, values and gradients match the float64 reference.", C.VALUES, f"{_SCALE}; project rule: generated widths stop at 32 and the wider fixed cases are multiples of 64, so a vectorized loop or tile that mishandles its last, partial group of features, RoPE pairs or vocabulary entries is seen only here"),
    Rule("VALUE-LONG-CONTEXT", "At 4715 positions, sampled logit rows (0 to 4714) match the oracle: RoPE at large positions, masks, windows, long rows, a partial tile.", C.VALUES, f"{_FORMULA}; project rule (issue 19): RoPE tables in low precision drift at long positions; past 4096, a table or an attention window of 4096 positions ends; a kernel tiled in powers of two mishandles a partial last tile"),
    Rule("VALUE-SEED-FIXTURE", "The seed fixture's published rows, logits and loss are reproduced to six decimals; build_seeded(config, 32) gives the same logits bitwise.", C.VALUES, "seed: 'Inspect representative hidden rows and every logit'"),
    # After the value rules: a port whose values are wrong fails them first, by their names.
    Rule("DET-ISOLATION", "A model's results do not depend on models run before it: same shapes with another RoPE base, epsilon or parameters.", C.DETERMINISM, "seed: a model is a function of its configuration and parameters; project rule: a table, weight or compiled function kept per process under too narrow a key"),
    Rule("GRAD-FINITE", "The loss gives every parameter tensor a finite gradient.", C.GRADIENTS, _GRADCHECK, needs=(K.GRADIENTS,)),
    Rule("GRAD-ORACLE", "Every parameter scalar's gradient agrees with the high-precision oracle gradient within tolerance.", C.GRADIENTS, f"{_ROLES}; project rule (issue 6)", needs=(K.GRADIENTS,)),
    Rule("GRAD-LONG-CONTEXT", "Over 4715 positions (one block), the loss and every parameter's gradient match the float64 reference within the bounds measured there.", C.GRADIENTS, f"{_SCALE}; project rule: every other gradient is taken over at most 80 positions, so a backward pass in tiles or chunks that mishandles the last, partial one (a key tile's dK and dV, a chunked loss's row weights), or gradients summed over thousands of positions in too narrow a precision, is seen only here", needs=(K.GRADIENTS,)),
    Rule("GOLDEN-VALUES", "On every golden case, every stage, the logits and the loss match the golden file within tolerance.", C.GOLDEN, "golden/ (issue 5)"),
    Rule("GOLDEN-GRADIENTS", "On every golden case, every parameter's gradient matches the golden file within tolerance.", C.GOLDEN, "golden/ (issue 5)", needs=(K.GRADIENTS,)),
    Rule("SCALE-STAGES", "At each scale shape, every stage agrees with the float64 reference within the bound measured for the declared precision at that shape.", C.SCALE, _SCALE, needs=(K.STAGES,)),
    Rule("SCALE-LOGITS", "At each scale shape, the logits and the loss agree with the float64 reference within the shape's bounds for the declared precision.", C.SCALE, _SCALE),
    Rule("SCALE-GRADIENTS", "At each scale shape, every parameter's gradient agrees with the float64 reference within the bound measured at that shape.", C.SCALE, _SCALE, needs=(K.GRADIENTS,)),
    Rule("SCALE-CAUSALITY", "At each scale shape, changing the token at a late position leaves every earlier logit row bitwise unchanged and changes its own row.", C.SCALE, _SCALE),
    Rule("SCALE-BATCH", "At each scale shape, a sequence run alone gives the logits it has in the batch, within the shape's bound.", C.SCALE, _SCALE),
    Rule("SCALE-TYING", "At each scale shape, the parameters are the 2 + 9N stable names (no head), and changing a table row changes its lookup and logit column.", C.SCALE, _SCALE),
    Rule("GRAD-SEED-CHECK", "The seed's central-difference check (step 1e-6, tolerance 2e-5) passes on its probe model.", C.GRADIENTS, _GRADCHECK, needs=(K.GRADIENTS,)),
)
del C, K
# fmt: on

_BY_ID = {entry.id: entry for entry in RULES}
if len(_BY_ID) != len(RULES):
    raise RuntimeError("rule IDs must be unique")


def rule(rule_id: str) -> Rule:
    """The rule with this ID; a ``KeyError`` names the unknown ID."""
    try:
        return _BY_ID[rule_id]
    except KeyError:
        raise KeyError(f"no rule {rule_id!r}; known rules: {', '.join(_BY_ID)}") from None


def rules_in(category: RuleCategory) -> list[Rule]:
    """Every rule of one category, in registry order."""
    return [entry for entry in RULES if entry.category is category]
