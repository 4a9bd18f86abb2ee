"""The ``decoder-conformance`` command line.

Subcommands import what they need when they run, so ``--help`` stays fast and a
missing optional extra breaks only the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from spec.config import FIXTURE
from spec.rules import RuleCategory

__all__ = ["CommandLineError", "main"]

PROGRAM = "decoder-conformance"


class CommandLineError(Exception):
    """A problem with the command line, reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(f"{self.prog}: {message} (see --help)")


def _add_run_commands(commands: Any) -> None:
    """run and check-adapter: the commands a backend author uses."""
    run = commands.add_parser(
        "run",
        help="check a backend against every rule and print a rule-by-rule table",
        description=(
            "Run the conformance suite (pytest --pyargs conformance) against a backend. "
            "Exit status 0 only when no rule failed."
        ),
    )
    run.add_argument(
        "--adapter",
        default=None,
        help="registered adapter name, package.module:attribute or path/to/file.py:attribute "
        "(default: $DECODER_CONFORMANCE_ADAPTER, else reference)",
    )
    run.add_argument(
        "--profile",
        choices=("ci", "default", "thorough", "scale"),
        default="default",
        help="ci (small, derandomized), default, thorough; or scale: the SCALE rules at the "
        "size of real models (spec/scale.py), against the float64 reference",
    )
    run.add_argument(
        "--scale-shape",
        action="append",
        default=[],
        metavar="NAME",
        help="with --profile scale: check this shape (repeatable; smollm2-135m, long-context, "
        "wide-vocabulary and wide-heads by default; smoke, large-ids and odd-widths take "
        "seconds)",
    )
    run.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="ID",
        help="check only this rule (repeatable; a glob such as 'ERR-*' too)",
    )
    run.add_argument(
        "--stop-on-category",
        action="append",
        default=[],
        choices=[category.value for category in RuleCategory],
        metavar="CATEGORY",
        help="end the run at the first failed test of a rule in this category (repeatable: "
        "%(choices)s); the rules after it are reported untested",
    )
    run.add_argument(
        "--max-examples",
        type=_positive_int,
        metavar="N",
        help="examples a property runs (the profile's)",
    )
    run.add_argument(
        "--seed",
        type=_non_negative_int,
        metavar="N",
        help="hypothesis seed (default: drawn and reported; the ci profile is derandomized)",
    )
    run.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    run.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown")
    run.add_argument(
        "--repro-dir", metavar="DIR", help="write a reproduction script per failed rule here"
    )
    run.add_argument("--xfails-file", metavar="FILE", help="expected failures of this backend")
    run.add_argument(
        "--known-failures",
        action="store_true",
        help="list the failures the adapter ships (conformance/known_failures/ADAPTER.txt, each "
        "with its reason) as expected; every other rule must pass",
    )
    run.add_argument("--skips-file", metavar="FILE", help="tests not to run (they crash or hang)")
    run.add_argument(
        "--no-contract-check",
        action="store_true",
        help="run the rules even when the adapter breaks its contract",
    )
    run.add_argument("--backend-command", help="command that starts a subprocess backend")
    run.add_argument(
        "--backend-timeout",
        type=_positive_real,
        default=60.0,
        metavar="S",
        help="seconds per request (60); three timeouts in a row end the waiting",
    )
    run.add_argument(
        "--run-timeout",
        type=_positive_real,
        metavar="S",
        help="seconds the whole run may take; past it the run is stopped (exit 124)",
    )
    run.add_argument(
        "-n",
        "--workers",
        type=_non_negative_int,
        default=0,
        help="run on N processes with pytest-xdist (0: in one process)",
    )
    run.add_argument(
        "--pytest-args",
        default="",
        help='extra pytest arguments, quoted as one string (for example "-x -k tying" or "-x")',
    )
    check = commands.add_parser(
        "check-adapter",
        help="check an adapter's contract in seconds: types, shapes, dtypes, capabilities",
        description=(
            "Call every method the adapter declares on two small models and report, one line "
            "each, what it returns against the protocol. Exit status 0 when it keeps it."
        ),
    )
    check.add_argument("--adapter", default=None, help="the adapter, as for run")
    check.add_argument("--backend-command", help="command that starts a subprocess backend")


def _add_suite_commands(commands: Any) -> None:
    """golden, tolerances, bench and mutants: the maintainers' commands."""
    golden = commands.add_parser(
        "golden",
        help="regenerate the golden files from the reference, or check them",
        description="Golden files: expected results of every golden case, with provenance.",
    )
    golden_actions = golden.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    golden_actions.required = True
    regen = golden_actions.add_parser(
        "regen", help="rewrite every golden file from the reference backend (atomically)"
    )
    check = golden_actions.add_parser(
        "check", help="report stale, missing or hand-edited golden files (exit 1 if any)"
    )
    for action in (regen, check):
        action.add_argument(
            "--directory", help="the golden directory (default: the one shipped with the suite)"
        )
    regen.add_argument(
        "--adapter",
        default="reference",
        help="must be 'reference': only the reference backend may write golden files",
    )
    check.add_argument(
        "--no-recompute",
        action="store_true",
        help="check integrity and provenance only, without rerunning the reference",
    )
    tolerances = commands.add_parser(
        "tolerances",
        help="show the committed tolerances, or derive them again from measurements",
        description="Tolerances per precision class and the measurements behind them.",
    )
    tolerance_actions = tolerances.add_subparsers(
        dest="action", metavar="ACTION", parser_class=_Parser
    )
    tolerance_actions.required = True
    tolerance_actions.add_parser("show", help="print the committed table and its derivation")
    derive = tolerance_actions.add_parser(
        "derive",
        help="derive the error models from measurements (or survey one backend with --adapter)",
    )
    derive.add_argument(
        "--adapter",
        default=None,
        help="survey this backend against its derived tolerances instead of deriving them",
    )
    derive.add_argument("--backend-command", help="command that starts a subprocess backend")
    derive.add_argument(
        "--configs",
        type=_positive_int,
        default=None,
        help="generated cases (1000 to derive, 100 to survey a backend)",
    )
    derive.add_argument("--seed", type=_non_negative_int, default=0, help="generator seed (0)")
    derive.add_argument(
        "--write",
        action="store_true",
        help="replace spec/derived_tolerances.json with the derived table (maintainers)",
    )
    derive.add_argument(
        "--scale",
        action="store_true",
        help="measure only the bounds at the scale shapes (spec/scale.py): the emulation "
        "against the float64 reference, at each shape (minutes per shape and precision)",
    )
    derive.add_argument(
        "--scale-shape",
        action="append",
        default=[],
        metavar="NAME",
        help="with --scale: this shape only (repeatable; default every shape)",
    )
    derive.add_argument(
        "--precision",
        action="append",
        default=[],
        choices=("float32", "bfloat16", "float16"),
        help="with --scale: this precision only (repeatable; default all three)",
    )
    derive.add_argument(
        "--growth",
        action="store_true",
        help="measure only how the float64 reference's error against mpmath grows with "
        "width, depth, positions and vocabulary, and fit it (about 10 minutes)",
    )
    bench = commands.add_parser(
        "bench",
        help="time forward + backward of the reference against PyTorch float64",
        description=(
            "Forward + backward of the reference and (when installed) PyTorch float64, each in "
            "fresh processes with the same thread count: median times, their ratio, GFLOP/s "
            "against this machine's matrix-multiply rate, peak memory, and how the cost grows."
        ),
    )
    bench.add_argument(
        "--sizes",
        default="small,medium,large",
        help="comma-separated: small, medium, large, smollm2 (the scale profile's SmolLM2-135M "
        "shape, batch 1 x 1,024 tokens: minutes)",
    )
    bench.add_argument(
        "--threads", type=_positive_int, default=os.cpu_count() or 1, help="threads (all cores)"
    )
    bench.add_argument("--rounds", type=_positive_int, default=2, help="alternating rounds (2)")
    bench.add_argument("--repeats", type=_positive_int, default=3, help="timed steps a round (3)")
    bench.add_argument("--no-scaling", action="store_true", help="skip the scaling tables")
    bench.add_argument(
        "--tuned-allocator",
        action="store_true",
        help="raise glibc's mmap and trim thresholds for both backends (fewer page faults)",
    )
    bench.add_argument(
        "--breakdown",
        action="store_true",
        help="also split each size's step into weight-matrix products and the rest",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    mutants = commands.add_parser(
        "mutants",
        help="run the suite (profile ci) against every deliberately broken backend",
        description=(
            "Judge the mutant catalogue: each mutant must be killed by a rule related to its "
            "mistake, and the correct controls must pass. Exit status 0 only then."
        ),
    )
    mutants.add_argument("--list", action="store_true", help="list the mutants and exit")
    mutants.add_argument("--only", nargs="+", metavar="NAME", help="judge only these mutants")
    mutants.add_argument(
        "--workers", type=_positive_int, default=2, help="mutants judged at once (2)"
    )
    mutants.add_argument("--no-controls", action="store_true", help="skip the correct controls")
    mutants.add_argument(
        "--whole-suite",
        action="store_true",
        help="run every rule against each mutant (by default only the rules of the mistake's "
        "categories run, up to the first failure, which is the rule that kills it; the whole "
        "suite runs only when none of them fails)",
    )
    matrix = commands.add_parser(
        "matrix",
        help="run every shipped adapter and write the compliance matrix (Markdown, HTML)",
        description=(
            "Run the suite against each adapter in turn, with the known failures it ships, "
            "and print a table of rules by backends. Exit status 0 only when no rule failed "
            "unexpectedly (and, with --check, the recorded matrix still holds)."
        ),
    )
    matrix.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="an adapter to include (repeatable; default: every shipped adapter)",
    )
    matrix.add_argument(
        # Not scale: its shapes take minutes and gigabytes per adapter (run --profile scale).
        "--profile",
        choices=("ci", "default", "thorough"),
        default="ci",
        help="profile (ci)",
    )
    matrix.add_argument("--markdown", metavar="FILE", help="write the matrix as Markdown")
    matrix.add_argument("--html", metavar="FILE", help="write the matrix as an HTML page")
    matrix.add_argument(
        "--readme", metavar="FILE", help="replace the matrix section of FILE (between markers)"
    )
    matrix.add_argument(
        "--check", metavar="FILE", help="exit 1 where this run's statuses differ from FILE's"
    )
    matrix.add_argument("--json-dir", metavar="DIR", help="keep each adapter's JSON report here")
    matrix.add_argument(
        "-j",
        "--jobs",
        type=_positive_int,
        default=1,
        metavar="N",
        help="adapters checked at once, each on one thread (1)",
    )


def _id_rows(option: str, text: str) -> list[list[int]]:
    """Parse ``"0,1,2;3,4,5"`` into rows of integer IDs."""
    rows: list[list[int]] = []
    for row_index, row_text in enumerate(text.split(";")):
        row: list[int] = []
        for item in (part.strip() for part in row_text.split(",")):
            if not item and row_text.strip() == "":
                continue
            try:
                row.append(int(item))
            except ValueError:
                raise CommandLineError(
                    f"{PROGRAM} trace: {option}: row {row_index} has {item!r}, "
                    'which is not an integer (expected rows like "0,1,2;3,4,5")'
                ) from None
        rows.append(row)
    lengths = {len(row) for row in rows}
    if len(lengths) > 1:
        described = ", ".join(f"row {index} has {len(row)}" for index, row in enumerate(rows))
        raise CommandLineError(
            f"{PROGRAM} trace: {option}: every row needs the same number of IDs; {described}"
        )
    return rows


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not positive")
    return value


def _positive_real(text: str) -> float:
    value = _real(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def build_parser() -> _Parser:
    from conformance import __version__

    parser = _Parser(
        prog=PROGRAM,
        description="Check tied-embedding decoder-only transformers against an executable spec.",
    )
    parser.add_argument("--version", action="version", version=f"{PROGRAM} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    commands.add_parser(
        "report",
        help="print the seed chapter's 14-line learner report, computed by the reference",
        description="Run the seed fixture through the reference and print the learner report.",
    )
    _add_run_commands(commands)
    _add_suite_commands(commands)
    rules = commands.add_parser(
        "rules",
        help="list every rule of the specification (ID, category, statement, source)",
        description="List the rules a conforming implementation must satisfy.",
    )
    rules.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="table: aligned text for people; json: one object for machines",
    )
    trace = commands.add_parser(
        "trace",
        help="print the evidence record (DECODER_MODEL_TRACE_V1) for any configuration",
        description=(
            "Run the reference on a configuration (the seed fixture by default) and print the "
            "evidence trace, or with --format json every stage, logit and gradient."
        ),
    )
    fixture_config = FIXTURE.config
    sizes = (
        ("--vocab", "vocabulary_size", "vocabulary size V"),
        ("--width", "model_width", "model width d"),
        ("--heads", "heads", "attention heads"),
        ("--ffn", "feed_forward_width", "SwiGLU hidden width f"),
        ("--layers", "layers", "decoder blocks N"),
        ("--context", "context", "context capacity (maximum positions)"),
    )
    for flag, field, text in sizes:
        default = getattr(fixture_config, field)
        trace.add_argument(
            flag,
            dest=field,
            type=_non_negative_int,
            default=default,
            help=f"{text} (default {default})",
        )
    trace.add_argument(
        "--rope-base",
        dest="rope_base",
        type=_real,
        default=fixture_config.rope_base,
        help=f"RoPE base (default {fixture_config.rope_base!r})",
    )
    trace.add_argument(
        "--epsilon",
        dest="rms_epsilon",
        type=_real,
        default=fixture_config.rms_epsilon,
        help=f"RMSNorm epsilon (default {fixture_config.rms_epsilon!r})",
    )
    trace.add_argument(
        "--seed",
        type=_non_negative_int,
        default=FIXTURE.seed,
        help="SplitMix64 seed, 0 to 2**64-1 (default 32)",
    )
    trace.add_argument("--tokens", help='token IDs, rows separated by ";" (default "0,1,2")')
    trace.add_argument("--targets", help='target IDs in the same form (default "1,2,3")')
    trace.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: the evidence trace; json: stages, logits, loss and gradients",
    )
    trace.add_argument(
        "--adapter",
        help="trace this backend, through the adapter protocol (default: the reference itself)",
    )
    trace.add_argument("--backend-command", help="command that starts a subprocess backend")
    trace.add_argument(
        "--diff",
        action="store_true",
        help="also name the first stage, row and feature where the backend departs from the "
        "reference, with both values",
    )
    return parser


def _run_report(options: argparse.Namespace) -> str:
    from conformance.tools.evidence import seed_report

    return seed_report()


def _run_rules(options: argparse.Namespace) -> str:
    import json

    from spec.rules import RULES

    if options.format == "json":
        listed = [
            {
                "id": r.id,
                "category": str(r.category),
                "needs": [str(c) for c in r.needs],
                "statement": r.statement,
                "source": r.source,
            }
            for r in RULES
        ]
        return json.dumps({"rules": listed}, indent=2) + "\n"
    needs = {r.id: ", ".join(str(c) for c in r.needs) or "-" for r in RULES}
    id_width = max(len(r.id) for r in RULES)
    category_width = max(len(str(r.category)) for r in RULES)
    needs_width = max(len(text) for text in needs.values())
    lines = [
        f"{'ID':<{id_width}}  {'CATEGORY':<{category_width}}  {'NEEDS':<{needs_width}}  STATEMENT"
    ]
    lines.extend(
        f"{r.id:<{id_width}}  {r.category!s:<{category_width}}  {needs[r.id]:<{needs_width}}  "
        f"{r.statement}"
        for r in RULES
    )
    lines.append(f"{len(RULES)} rules")
    return "\n".join(lines) + "\n"


def _run_trace(options: argparse.Namespace) -> str:
    from conformance.tools.evidence import TraceRefused, trace
    from spec.config import DecoderConfig

    if options.tokens is not None and options.targets is None:
        raise CommandLineError(
            f"{PROGRAM} trace: --targets is required with --tokens (one target per token)"
        )
    if options.seed > 2**64 - 1:
        raise CommandLineError(
            f"{PROGRAM} trace: --seed must be at most 2**64-1, got {options.seed}"
        )
    config = DecoderConfig(
        vocabulary_size=options.vocabulary_size,
        model_width=options.model_width,
        heads=options.heads,
        feed_forward_width=options.feed_forward_width,
        layers=options.layers,
        context=options.context,
        rope_base=options.rope_base,
        rms_epsilon=options.rms_epsilon,
    )
    tokens = FIXTURE.tokens if options.tokens is None else _id_rows("--tokens", options.tokens)
    targets = FIXTURE.targets if options.targets is None else _id_rows("--targets", options.targets)
    if options.adapter is None and not options.diff:
        try:
            return trace(config, options.seed, tokens, targets, as_json=options.format == "json")
        except TraceRefused as error:
            raise CommandLineError(f"{PROGRAM} trace: {error}") from error
    return _trace_backend(options, config, tokens, targets)


def _trace_backend(options: argparse.Namespace, config: Any, tokens: Any, targets: Any) -> str:
    """``trace --adapter NAME [--diff]``: any backend's trace, through its adapter."""
    from conformance.adapter import BackendLoadError, BackendOptions, Refusal, load_backend
    from conformance.trace import collect_trace, first_departure, run_record
    from spec.evidence import fixture_for
    from spec.tolerances import tolerance_for
    from spec.trace import render_trace, trace_json
    from spec.validation import config_violation, loss_violation

    violation = config_violation(config) or loss_violation(config, tokens, targets)
    if violation is not None:
        raise CommandLineError(f"{PROGRAM} trace: the inputs break {violation.kind}")
    fixture = fixture_for(config, options.seed, tokens, targets)
    name = options.adapter or "reference"
    try:
        backend = load_backend(name, BackendOptions(backend_command=options.backend_command))
    except BackendLoadError as error:
        raise CommandLineError(f"{PROGRAM} trace: {error}") from error
    try:
        evidence = collect_trace(backend, fixture)
        text = trace_json(evidence.run) if options.format == "json" else render_trace(evidence)
        if options.diff:
            reference = run_record(load_backend("reference"), fixture)
            tolerance = tolerance_for(backend.precision).at(config, len(tokens[0])).values
            departure = first_departure(evidence.run, reference, tolerance)
            verdict = (
                str(departure)
                if departure is not None
                else f"no departure from the reference beyond {tolerance:.3g}"
            )
            text += verdict + "\n"
    except Refusal as refusal:
        raise CommandLineError(f"{PROGRAM} trace: backend {name} refused: {refusal}") from refusal
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
    return text


# pytest options that end a run before its tests report: the suite would read no verdict.
_REPORTLESS_PYTEST_OPTIONS = frozenset(
    {"--collect-only", "--co", "--help", "-h", "--version", "-V", "--fixtures", "--markers"}
)


def _writable_file(command: str, flag: str, target: str) -> None:
    """A report path whose folder exists and that is not itself a folder."""
    from pathlib import Path

    path = Path(target)
    if path.is_dir():
        raise CommandLineError(f"{PROGRAM} {command}: {flag} {target} is a folder, not a file")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise CommandLineError(f"{PROGRAM} {command}: {flag} {target}: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise CommandLineError(f"{PROGRAM} {command}: {flag} {target}: {folder} is not writable")


def _text_file(command: str, flag: str, source: str) -> None:
    """A readable UTF-8 text file (a list of rules or tests)."""
    from pathlib import Path

    path = Path(source)
    if not path.is_file():
        raise CommandLineError(f"{PROGRAM} {command}: {flag} {source}: no such file")
    try:
        with path.open("rb") as stream:
            head = stream.read(1 << 20)
        if b"\0" in head:
            raise UnicodeDecodeError("utf-8", head, head.index(b"\0"), head.index(b"\0") + 1, "NUL")
        head.decode("utf-8")
    except UnicodeDecodeError:
        raise CommandLineError(
            f"{PROGRAM} {command}: {flag} {source} is not a text file (one rule ID or test "
            "ID per line)"
        ) from None
    except OSError as error:
        raise CommandLineError(f"{PROGRAM} {command}: {flag} {source}: {error.strerror}") from None


def _check_scale_options(options: argparse.Namespace) -> None:
    """The scale profile's options, before anything runs."""
    import fnmatch

    from conformance.profiles import SCALE_PROFILE, runs_rule
    from spec.rules import RULES
    from spec.scale import SCALE_SHAPES

    at_scale = options.profile == SCALE_PROFILE
    unknown = [name for name in options.scale_shape if name not in SCALE_SHAPES]
    if unknown:
        raise CommandLineError(
            f"{PROGRAM} run: --scale-shape {', '.join(unknown)}: no such shape; known: "
            f"{', '.join(SCALE_SHAPES)}"
        )
    if options.scale_shape and not at_scale:
        raise CommandLineError(f"{PROGRAM} run: --scale-shape goes with --profile scale")
    if options.workers and at_scale:
        # Each worker would compute every shape's reference runs again, and hold them.
        raise CommandLineError(
            f"{PROGRAM} run: --profile scale runs on one process (a shape's rules share its "
            "runs); leave out -n"
        )
    for pattern in options.rule:
        matched = [r.id for r in RULES if fnmatch.fnmatchcase(r.id, pattern.upper())]
        if matched and not any(runs_rule(options.profile, rule_id) for rule_id in matched):
            where = "only at --profile scale" if not at_scale else "at every profile but scale"
            raise CommandLineError(
                f"{PROGRAM} run: --rule {pattern}: {', '.join(matched[:3])}"
                f"{' ...' if len(matched) > 3 else ''} run {where}"
            )


def _run_suite(options: argparse.Namespace) -> str:
    """Run the suite; its progress and the rule table go to the terminal as they come."""
    import shlex
    from importlib.util import find_spec
    from pathlib import Path

    from conformance.known_failures import known_failures_file
    from conformance.runner import run_suite
    from conformance.session import DEFAULT_ADAPTER, ENVIRONMENT_VARIABLE

    _check_scale_options(options)
    if options.workers and find_spec("xdist") is None:
        raise CommandLineError(
            f"{PROGRAM} run: -n needs pytest-xdist (pip install 'decoder-conformance[test]')"
        )
    # Every file argument is checked before the run starts, so no mistake costs a run.
    outputs = [("--json", options.json), ("--markdown", options.markdown)]
    for flag, target in outputs:
        if target:
            _writable_file("run", flag, target)
    if (
        options.json
        and options.markdown
        and Path(options.json).resolve() == Path(options.markdown).resolve()
    ):
        raise CommandLineError(
            f"{PROGRAM} run: --json and --markdown name the same file {options.markdown}"
        )
    if (
        options.repro_dir
        and Path(options.repro_dir).exists()
        and not Path(options.repro_dir).is_dir()
    ):
        raise CommandLineError(f"{PROGRAM} run: --repro-dir {options.repro_dir} is not a folder")
    if options.known_failures:
        if options.xfails_file:
            raise CommandLineError(
                f"{PROGRAM} run: --known-failures and --xfails-file both list expected "
                "failures; give one"
            )
        try:
            adapter = options.adapter or os.environ.get(ENVIRONMENT_VARIABLE) or DEFAULT_ADAPTER
            options.xfails_file = str(known_failures_file(adapter))
        except LookupError as error:
            raise CommandLineError(f"{PROGRAM} run: --known-failures: {error}") from None
    for flag, listed in (
        ("--xfails-file", options.xfails_file),
        ("--skips-file", options.skips_file),
    ):
        if listed:
            _text_file("run", flag, listed)
    if options.stop_on_category and options.workers:
        raise CommandLineError(
            f"{PROGRAM} run: --stop-on-category needs one process (-n 0): each of "
            f"{options.workers} workers would stop on its own"
        )
    try:
        pytest_args = shlex.split(options.pytest_args)
    except ValueError as error:
        raise CommandLineError(f"{PROGRAM} run: --pytest-args: {error}") from None
    for argument in pytest_args:
        if argument.split("=", 1)[0] in _REPORTLESS_PYTEST_OPTIONS:
            raise CommandLineError(
                f"{PROGRAM} run: --pytest-args {argument}: the run would check nothing and "
                "report nothing; list the rules with 'decoder-conformance rules'"
            )
    report = run_suite(
        options.adapter,
        profile=options.profile,
        scale_shapes=options.scale_shape,
        stop_on_categories=options.stop_on_category,
        rules=options.rule,
        max_examples=options.max_examples,
        seed=options.seed,
        backend_command=options.backend_command,
        backend_timeout=options.backend_timeout,
        xfails_file=options.xfails_file,
        skips_file=options.skips_file,
        json_report=options.json,
        markdown_report=options.markdown,
        repro_dir=options.repro_dir,
        contract_check=not options.no_contract_check,
        workers=options.workers,
        pytest_args=pytest_args,
        stream=sys.stdout,
        color=sys.stdout.isatty(),
        timeout=options.run_timeout,
    )
    if report.error:
        print(report.error, file=sys.stderr)
    if report.status:
        raise _SuiteExit(report.status)
    return ""


def _run_check_adapter(options: argparse.Namespace) -> str:
    import os

    from conformance.adapter import BackendLoadError, BackendOptions, load_backend
    from conformance.contract import check_contract
    from conformance.session import DEFAULT_ADAPTER, ENVIRONMENT_VARIABLE

    name = options.adapter or os.environ.get(ENVIRONMENT_VARIABLE) or DEFAULT_ADAPTER
    try:
        backend = load_backend(name, BackendOptions(backend_command=options.backend_command))
    except BackendLoadError as error:
        raise CommandLineError(f"{PROGRAM} check-adapter: {error}") from error
    try:
        found = check_contract(backend)
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
    header = f"adapter {name!r}: backend {backend.name} {backend.version} ({backend.precision})"
    if not found:
        return f"{header}: the adapter contract holds\n"
    lines = [f"{header}: {len(found)} contract violations"]
    lines += [f"  {violation}" for violation in found]
    print("\n".join(lines), flush=True)  # the verdict is the output; the status says it failed
    raise _SuiteExit(1)


class _SuiteExit(Exception):
    """The suite ran and its verdict (or pytest's own failure) sets the exit status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _run_tolerances(options: argparse.Namespace) -> str:
    if options.action == "show":
        from conformance.tools.tolerance_derivation import render_derivation
        from spec.tolerances import DOCUMENT, TABLE

        made = DOCUMENT["provenance"]
        provenance = [
            f"spec/derived_tolerances.json, written {made['written']} by `{made['command']}` "
            f"(numpy {made['numpy']}, Python {made['python']}); how: {made['explained_in']}",
            *(f"{name}: {entry['derivation']}" for name, entry in TABLE.items()),
        ]
        provenance += [
            f"scale bounds, {entry['precision']} at {', '.join(entry['shapes'])}: "
            f"written {entry['written']} by `{entry['command']}`"
            for entry in made.get("scale", [])
        ]
        text = render_derivation(TABLE)
        if "reference_growth" in DOCUMENT:
            from conformance.tools.reference_growth import render_growth, render_scale_bounds

            growth = DOCUMENT["reference_growth"]
            made_by = f"written {growth['written']} by `{growth['command']}`"
            provenance.append(f"reference_growth: {made_by}")
            text += "\n" + render_growth(growth) + "\n\n" + render_scale_bounds() + "\n"
        return text + "\n" + "\n".join(provenance) + "\n"
    if (options.scale_shape or options.precision) and not options.scale:
        raise CommandLineError(
            f"{PROGRAM} tolerances derive: --scale-shape and --precision go with --scale"
        )
    if (options.scale or options.growth) and (
        options.adapter or options.backend_command or options.configs
    ):
        raise CommandLineError(
            f"{PROGRAM} tolerances derive: --scale and --growth measure the reference's own "
            "instruments; --adapter, --backend-command and --configs do not go with them"
        )
    if options.scale or options.growth:
        return _derive_at_scale(options)
    if options.adapter is None and options.backend_command is None:
        return _derive_tolerances(options)
    from conformance.adapter import BackendLoadError, BackendOptions, load_backend
    from conformance.tools.tolerance_survey import account_for_seed_check, render_survey, survey

    try:
        backend = load_backend(
            options.adapter or "subprocess", BackendOptions(backend_command=options.backend_command)
        )
    except BackendLoadError as error:
        raise CommandLineError(f"{PROGRAM} tolerances derive: {error}") from error
    measured = survey(backend, configs=options.configs or 100, seed=options.seed)
    account = account_for_seed_check(backend) if backend.precision == "float64" else None
    return render_survey(measured, account)


def _derive_at_scale(options: argparse.Namespace) -> str:
    """``tolerances derive --scale`` / ``--growth``: measure the scale bounds or the
    reference's error growth, and (with ``--write``) merge them into the committed table."""
    import copy
    import datetime
    import json
    from pathlib import Path

    import spec
    from conformance.files import write_atomically
    from conformance.tools import reference_growth
    from conformance.tools.tolerance_derivation import (
        calibrated_scale_cases,
        record_scale_provenance,
    )
    from spec.formats import Precision
    from spec.scale import SCALE_SHAPES
    from spec.tolerances import DOCUMENT

    unknown = [name for name in options.scale_shape if name not in SCALE_SHAPES]
    if unknown:
        raise CommandLineError(
            f"{PROGRAM} tolerances derive: --scale-shape {', '.join(unknown)}: no such shape; "
            f"known: {', '.join(SCALE_SHAPES)}"
        )
    document = copy.deepcopy(DOCUMENT)
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    lines: list[str] = []

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if options.growth:
        points = reference_growth.measure_growth(progress=progress)
        command = f"{PROGRAM} tolerances derive --growth --write"
        document["reference_growth"] = reference_growth.growth_document(points, command)
        lines.append(reference_growth.render_growth(document["reference_growth"]))
    if options.scale:
        shapes = options.scale_shape or list(SCALE_SHAPES)
        precisions = options.precision or ["float32", "bfloat16", "float16"]
        for name in precisions:
            measured = calibrated_scale_cases(Precision(name), shapes, progress=progress)
            document["precisions"][name].setdefault("cases", {}).update(measured)
            lines += [
                f"{name} {case}: " + ", ".join(f"{q} {bound:.3g}" for q, bound in bounds.items())
                for case, bounds in measured.items()
            ]
        arguments = "".join(f" --scale-shape {n}" for n in options.scale_shape) + "".join(
            f" --precision {p}" for p in options.precision
        )
        document["provenance"]["scale"] = record_scale_provenance(
            document["provenance"].get("scale", []),
            precisions,
            shapes,
            f"{PROGRAM} tolerances derive --scale{arguments} --write",
            today,
        )
    text = "\n".join(lines) + "\n"
    if options.write:
        path = Path(spec.__file__).parent / "derived_tolerances.json"
        write_atomically(path, json.dumps(document, indent=2) + "\n")
        text += f"wrote {path}\n"
    return text


def _derive_tolerances(options: argparse.Namespace) -> str:
    """Measure every precision's instrument, fit the error models, check them on held-out
    cases, and (with ``--write``) replace the committed table."""
    from pathlib import Path

    import spec
    from conformance.tools import tolerance_derivation as derivation
    from spec.formats import Precision
    from spec.tolerances import DOCUMENT, TABLE, model_from_entry

    count = options.configs or 1000
    cases = derivation.derivation_cases(count, options.seed)
    measured = derivation.measure(cases, long=derivation.long_cases(options.seed))
    held_out = derivation.measure(derivation.derivation_cases(max(1, count // 3), options.seed + 1))
    table: dict[str, Any] = {}
    use = {}
    for precision in Precision:
        fitted = derivation.fit(measured, precision)
        entry = {
            "safety": derivation.SAFETY,
            "quantities": fitted,
            "derivation": derivation.derivation_text(precision, fitted, count),
            # The scale bounds and the growth study are measured by --scale and --growth.
            "cases": derivation.calibrated_cases(precision)
            | {
                name: bounds
                for name, bounds in TABLE.get(str(precision), {}).get("cases", {}).items()
                if name.startswith("scale:")
            },
        }
        table[str(precision)] = entry
        use[precision] = derivation.held_out_use(held_out, model_from_entry(precision, entry))
    text = derivation.render_derivation(table, use)
    text += (
        f"held-out use: the largest error / tolerance over {max(1, count // 3)} "
        f"other cases (seed {options.seed + 1}); above 1 would be a false alarm\n"
    )
    if options.write:
        path = Path(spec.__file__).parent / "derived_tolerances.json"
        command = f"{PROGRAM} tolerances derive --configs {count} --seed {options.seed}"
        kept = {key: DOCUMENT[key] for key in ("reference_growth",) if key in DOCUMENT}
        scale = DOCUMENT["provenance"].get("scale")  # the scale bounds' own commands
        derivation.write_table(path, table, command + " --write", kept, scale)
        text += f"wrote {path}\n"
    return text


def _run_golden(options: argparse.Namespace) -> str:
    from pathlib import Path

    from conformance.adapter import BackendLoadError, load_backend
    from conformance.golden import golden_directory
    from conformance.tools.golden import check_golden, regenerate

    directory = Path(options.directory) if options.directory else golden_directory()
    if options.action == "regen":
        try:
            backend = load_backend(options.adapter)
            names = regenerate(backend, directory)
        except (BackendLoadError, OSError) as error:  # PermissionError included
            raise CommandLineError(f"{PROGRAM} golden regen: {error}") from error
        return f"regenerated {len(names)} golden files in {directory / 'cases'}\n"
    reference = None if options.no_recompute else load_backend("reference")
    problems, notes = check_golden(directory, recompute=reference)
    lines = [f"note: {note}" for note in notes]
    lines += [str(problem) for problem in problems]
    if problems:
        print("\n".join(lines), file=sys.stderr)
        raise _SuiteExit(1)
    lines.append(f"golden files in {directory}: all current and intact")
    return "\n".join(lines) + "\n"


def _run_bench(options: argparse.Namespace) -> str:
    from pathlib import Path

    from conformance.tools.bench import SIZES, render_bench, run_bench

    sizes = [name.strip() for name in options.sizes.split(",") if name.strip()]
    unknown = [name for name in sizes if name not in SIZES]
    if unknown or not sizes:
        raise CommandLineError(
            f"{PROGRAM} bench: --sizes takes {', '.join(SIZES)}, got {options.sizes!r}"
        )
    if options.json:
        _writable_file("bench", "--json", options.json)
    result = run_bench(
        sizes=sizes,
        threads=options.threads,
        rounds=options.rounds,
        repeats=options.repeats,
        scaling=not options.no_scaling,
        tuned_allocator=options.tuned_allocator,
        breakdown=options.breakdown,
        progress=lambda text: print(text, file=sys.stderr, flush=True),
    )
    if options.json:
        from conformance.files import write_atomically

        write_atomically(Path(options.json), result.as_json())
    return render_bench(result)


def _run_mutants(options: argparse.Namespace) -> str:
    import time

    from conformance.tools.mutant_runner import render_matrix, run_catalogue
    from conformance.tools.mutants import MUTANTS

    if options.list:
        width = max(len(m.name) for m in MUTANTS)
        return "\n".join(f"{m.name:<{width}}  {m.rule:<24}  {m.mistake}" for m in MUTANTS) + "\n"
    started = time.perf_counter()
    try:
        results = run_catalogue(
            workers=options.workers,
            only=options.only,
            controls=not options.no_controls,
            whole_suite=options.whole_suite,
        )
    except KeyError as error:
        raise CommandLineError(f"{PROGRAM} mutants: {error.args[0]}") from error
    print(render_matrix(results, time.perf_counter() - started), end="")
    if not all(result.as_expected for result in results):
        raise _SuiteExit(1)
    return ""


def _run_matrix(options: argparse.Namespace) -> str:
    from pathlib import Path

    from conformance.tools.matrix import (
        DEFAULT_ADAPTERS,
        MatrixError,
        check_statuses,
        read_statuses,
        replace_section,
        run_matrix,
        write_outputs,
    )

    commands = dict(DEFAULT_ADAPTERS)
    adapters = [(name, commands.get(name)) for name in options.adapter] or list(DEFAULT_ADAPTERS)
    for flag in ("markdown", "html"):
        if getattr(options, flag):
            _writable_file("matrix", f"--{flag}", getattr(options, flag))
    # Before any run: a README without the section, or a matrix file without a table.
    for flag, parse in (
        ("readme", lambda text: replace_section(text, "")),
        ("check", read_statuses),
    ):
        target = getattr(options, flag)
        if target:
            _text_file("matrix", f"--{flag}", target)
            try:
                parse(Path(target).read_text(encoding="utf-8"))
            except MatrixError as error:
                raise CommandLineError(f"{PROGRAM} matrix: --{flag} {target}: {error}") from None
    json_dir = Path(options.json_dir) if options.json_dir else None
    if json_dir is not None:
        json_dir.mkdir(parents=True, exist_ok=True)
    columns = run_matrix(
        adapters,
        profile=options.profile,
        stream=sys.stderr,
        json_dir=json_dir,
        jobs=options.jobs,
    )
    text = write_outputs(
        columns,
        options.profile,
        markdown=Path(options.markdown) if options.markdown else None,
        html_file=Path(options.html) if options.html else None,
        readme=Path(options.readme) if options.readme else None,
    )
    problems = [
        f"{column.title}: {result.id} failed unexpectedly"
        for column in columns
        for result in column.report.rules
        if result.status == "failed"
    ]
    problems += [
        f"{column.adapter}: did not run" for column in columns if column.report.identity is None
    ]
    if options.check:
        problems += check_statuses(
            columns, Path(options.check).read_text(encoding="utf-8"), options.profile
        )
    sys.stdout.write(text)
    for line in problems:
        print(f"{PROGRAM} matrix: {line}", file=sys.stderr)
    if problems:
        raise _SuiteExit(1)
    return ""


_COMMANDS: dict[str, Callable[[argparse.Namespace], str]] = {
    "bench": _run_bench,
    "matrix": _run_matrix,
    "golden": _run_golden,
    "mutants": _run_mutants,
    "check-adapter": _run_check_adapter,
    "report": _run_report,
    "rules": _run_rules,
    "tolerances": _run_tolerances,
    "run": _run_suite,
    "trace": _run_trace,
}


# Options whose value is a command line of its own, and so often starts with a dash.
_PASS_THROUGH_OPTIONS = ("--pytest-args",)


def attach_pass_through_values(argv: Sequence[str]) -> list[str]:
    """``--pytest-args -x`` as ``--pytest-args=-x``: argparse would read a lone value that
    starts with a dash as an option and refuse it ("expected one argument")."""
    attached: list[str] = []
    arguments = iter(argv)
    for argument in arguments:
        if argument in _PASS_THROUGH_OPTIONS:
            value = next(arguments, None)
            attached.append(argument if value is None else f"{argument}={value}")
        else:
            attached.append(argument)
    return attached


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        options = parser.parse_args(
            attach_pass_through_values(sys.argv[1:] if argv is None else argv)
        )
        output = _COMMANDS[options.command](options)
    except CommandLineError as error:
        print(error, file=sys.stderr)
        return 2
    except _SuiteExit as verdict:
        return verdict.status
    except KeyboardInterrupt:
        print(f"{PROGRAM}: interrupted", file=sys.stderr)
        return 130
    sys.stdout.write(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
