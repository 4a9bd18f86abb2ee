"""The pytest plugin: options, fixtures and the hooks that tie tests to rules.

Registered as a ``pytest11`` entry point. Everything it does is inert unless the run is
aimed at the conformance suite; the work lives in :mod:`conformance.session` and
:mod:`conformance.report`, imported when needed.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from conformance.profiles import PROFILES, active, runs_rule, select_profile

if TYPE_CHECKING:
    from conformance.checks import Judge
    from conformance.guard import GuardedBackend
    from conformance.session import SuiteSession
    from spec.tolerances import ToleranceModel

_SESSION: pytest.StashKey[SuiteSession] = pytest.StashKey()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{text} is not a positive integer")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("decoder-conformance", "decoder conformance suite")
    group.addoption(
        "--adapter",
        help="backend to check: a registered adapter name, package.module:attribute, or "
        "path/to/file.py:attribute (default: $DECODER_CONFORMANCE_ADAPTER, else 'reference')",
    )
    group.addoption("--backend-command", help="command that starts a subprocess backend")
    group.addoption(
        "--backend-timeout",
        type=float,
        default=60.0,
        help="seconds a subprocess backend may take to answer one request (default 60)",
    )
    group.addoption(
        "--xfails-file",
        help="expected failures: one test-id prefix or rule ID per line, '#' comments",
    )
    group.addoption(
        "--skips-file",
        help="tests not to run (they crash or hang): one test-id prefix or rule ID per line",
    )
    group.addoption(
        "--rule",
        action="append",
        metavar="ID",
        help="run only this rule (repeatable; globs such as 'ERR-*')",
    )
    group.addoption(
        "--conformance-profile",
        choices=sorted(PROFILES),
        default="default",
        help="profile of the suite: ci (small, derandomized), default, thorough, or scale "
        "(the SCALE rules at spec/scale.py's shapes, against the float64 reference)",
    )
    group.addoption(
        "--scale-shape",
        action="append",
        metavar="NAME",
        help="with the scale profile, check this shape of spec/scale.py (repeatable; default: "
        "smollm2-135m, long-context, wide-vocabulary)",
    )
    group.addoption(
        "--conformance-max-examples",
        type=_positive_int,
        help="examples a property runs (default: the profile's)",
    )
    group.addoption(
        "--no-contract-check",
        action="store_true",
        help="run the rule tests even when the adapter breaks its contract",
    )
    group.addoption(
        "--stop-on-category",
        action="append",
        metavar="CATEGORY",
        help="end the run at the first failed test of a rule in this category (repeatable; "
        "spec/rules.py's categories, such as 'values'); the rules after it are reported "
        "untested. Rules run in registry order, so the failure is that category's first",
    )
    group.addoption("--conformance-json", help="write the rule-by-rule report as JSON here")
    group.addoption("--conformance-markdown", help="write the rule-by-rule report as Markdown here")
    group.addoption("--repro-dir", help="write a reproduction script per failed rule here")
    group.addoption(
        "--conformance-error-file",
        help="where a run that cannot start writes its one-line reason (for the runner)",
    )


def pytest_configure(config: pytest.Config) -> None:
    from conformance.runner import follow_leash

    follow_leash()  # started by run_suite: end with the process that started this run
    config.addinivalue_line("markers", "rule(rule_id): the spec rule a conformance test checks")
    seed = config.getoption("hypothesis_seed", None)
    select_profile(
        config.getoption("conformance_profile"),
        max_examples=config.getoption("conformance_max_examples"),
        seed=None if seed is None else int(seed),
    )
    from spec.scale import SCALE_SHAPES

    unknown = [name for name in config.getoption("scale_shape") or [] if name not in SCALE_SHAPES]
    if unknown:
        raise pytest.UsageError(
            f"--scale-shape {', '.join(unknown)}: no such shape; known: {', '.join(SCALE_SHAPES)}"
        )
    from spec.rules import RuleCategory

    categories = [category.value for category in RuleCategory]
    chosen = config.getoption("stop_on_category") or []
    unknown = [name for name in chosen if name not in categories]
    if unknown:
        raise pytest.UsageError(
            f"--stop-on-category {', '.join(unknown)}: no such category; known: "
            f"{', '.join(categories)}"
        )
    for option in ("conformance_json", "conformance_markdown"):
        target = config.getoption(option)
        if target:
            from pathlib import Path

            folder = Path(target).resolve().parent
            if not folder.is_dir():
                flag = "--" + option.replace("_", "-")
                raise pytest.UsageError(f"{flag} {target}: the folder {folder} does not exist")
    from conformance.session import SuiteSession

    session = SuiteSession(config)
    config.stash[_SESSION] = session
    config.pluginmanager.register(session, "decoder-conformance-session")


def _is_conformance_test(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and module.__name__.startswith("conformance.test_")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    session = config.stash[_SESSION]
    from spec.rules import RULES

    # Rules run in registry order, specific before general (a RoPE slip fails VALUE-STAGES
    # before GOLDEN-VALUES), so the first failure names the most telling rule.
    position = {rule.id: index for index, rule in enumerate(RULES)}
    conformance_items = [item for item in items if _is_conformance_test(item)]
    shuffled = config.pluginmanager.hasplugin("randomly") and config.getoption(
        "randomly_reorganize", False
    )
    if conformance_items and not shuffled:  # a random order, when asked for, is kept
        # At scale, shape by shape: one shape's reference run serves all its rules.
        ordered = sorted(
            conformance_items,
            key=lambda item: (
                _scale_shape_index(item),
                position.get(session.rule_of(item), len(position)),
            ),
        )
        others = [item for item in items if not _is_conformance_test(item)]
        items[:] = ordered + others
    deselected = []
    kept = []
    for item in items:
        if not _is_conformance_test(item):
            kept.append(item)
            continue
        rule_id = session.rule_of(item)
        in_profile = runs_rule(active().name, rule_id)
        if session.contract_broken or not session.selected(rule_id) or not in_profile:
            deselected.append(item)
            continue
        kept.append(item)
        item.user_properties.append(("rule", rule_id))
        item.extra_keyword_matches.add(rule_id)  # so that -k TIE-OUTPUT-ROLE selects it
        if session.skips is not None:
            reason = session.skips.reason_for(item, rule_id)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        if session.expected_failures is not None:
            reason = session.expected_failures.reason_for(item, rule_id)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    session.tally.order_tests([item.nodeid for item in items])
    for listed in (session.expected_failures, session.skips):
        if listed is None or session.contract_broken:
            continue
        for number, entry in listed.unmatched():
            if not _may_match_in_profile(entry):
                continue  # written for another profile (the SCALE rules or the others)
            warning = pytest.PytestConfigWarning(
                f"{listed.path.name} line {number} ({entry!r}) matches no test"
            )
            config.issue_config_time_warning(warning, stacklevel=2)


def _may_match_in_profile(entry: str) -> bool:
    """Whether an xfails or skips entry (a rule ID or a test-ID prefix) can match a test of
    the selected profile."""
    at_scale = active().name == "scale"
    about_scale = entry.upper().startswith("SCALE-") or "test_scale" in entry
    return about_scale == at_scale


def _scale_shape_index(item: pytest.Item) -> int:
    from spec.scale import SCALE_SHAPES

    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("shape_name") if callspec is not None else None
    return list(SCALE_SHAPES).index(name) if name in SCALE_SHAPES else -1


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _is_conformance_test(item):
        return
    session = item.config.stash[_SESSION]
    backend = session.backend
    backend.begin_test()  # a new test forgets an earlier adapter error or process fault
    from spec.rules import rule

    for capability in rule(session.rule_of(item)).needs:
        if capability not in backend.capabilities:
            pytest.skip(f"needs capability '{capability}', which backend {backend.name} lacks")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None]:
    """An adapter fault or an unexpected refusal is reported by its message alone: what
    raised, where, on what call."""
    outcome: Any = yield
    if _is_conformance_test(item):
        from conformance import margins
        from conformance.coverage import PROPERTY, RECORDER

        # This test's share of what the run sent, and how close its passing checks came to
        # their bounds, carried to the controller with the report.
        properties = outcome.get_result().user_properties
        properties.append((PROPERTY, RECORDER.take()))
        closest = margins.RECORDER.take()
        if closest is not None:
            properties.append((margins.PROPERTY, closest))
        _stop_after_a_chosen_category(item, outcome.get_result())
    if call.excinfo is not None and _is_conformance_test(item):
        own = _backend_message(call.excinfo.value)
        if own is not None:
            outcome.get_result().longrepr = own
        else:
            from hypothesis.errors import FlakyFailure

            if call.excinfo.errisinstance(FlakyFailure):
                first = _first_failure(call.excinfo.value)
                if first is not None:
                    outcome.get_result().longrepr = f"{first}\n{NOT_REPRODUCIBLE}"


# Said under a failure hypothesis could not replay: its traceback group is no help to a
# reader, but the reason it could not is.
NOT_REPRODUCIBLE = (
    "(hypothesis replayed this example and the backend answered differently: the same calls "
    "do not give the same answers, so the failure may not reproduce either; dropout or "
    "sampling left on, state carried from one call to the next, or memory read before "
    "it is written)"
)


def _backend_message(error: BaseException) -> str | None:
    """The whole report of an adapter fault or of a refusal no check expected (their own
    message, not a traceback), or None for any other error."""
    from conformance.adapter import Refusal
    from conformance.guard import AdapterFault, unexpected_refusal

    if isinstance(error, AdapterFault):
        return str(error)
    if isinstance(error, Refusal):
        return unexpected_refusal(error)
    return None


def _first_failure(error: BaseException | None) -> str | None:
    """The message of the first check failure, adapter fault or unexpected refusal inside a
    hypothesis error group (through the wrappers' causes), or None."""
    if error is None:
        return None
    if isinstance(error, pytest.fail.Exception):
        return str(error)
    own = _backend_message(error)
    if own is not None:
        return own
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _first_failure(inner)
            if found is not None:
                return found
    return _first_failure(error.__cause__)


def _stop_after_a_chosen_category(item: pytest.Item, report: pytest.TestReport) -> None:
    """``--stop-on-category``: the run ends after this test when it failed a chosen category."""
    chosen = item.config.getoption("stop_on_category")
    if not chosen or not report.failed:
        return
    from spec.rules import rule

    rule_id = item.config.stash[_SESSION].rule_of(item)
    category = rule(rule_id).category
    if category.value in chosen:
        # What pytest's -x sets: the session ends after this test with status 1.
        reason = f"stopping: {rule_id} failed (--stop-on-category {category.value})"
        item.session.shouldfail = reason


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config) -> GuardedBackend:
    """The backend under test, its adapter's own errors reported as adapter errors."""
    return pytestconfig.stash[_SESSION].backend


@pytest.fixture(scope="session")
def tolerance(backend: GuardedBackend) -> ToleranceModel:
    """The error model of the backend's declared precision (``.at(config, positions)``)."""
    from spec.tolerances import tolerance_for

    return tolerance_for(backend.precision)


@pytest.fixture(scope="session")
def contract_violations(pytestconfig: pytest.Config) -> list[str]:
    """Every way the adapter breaks its contract (checked once a run)."""
    return pytestconfig.stash[_SESSION].contract_lines()


@pytest.fixture
def judge(request: pytest.FixtureRequest, backend: GuardedBackend) -> Generator[Judge, None, None]:
    """Checks for the rule the test names, failing in the suite's message shape."""
    from conformance.checks import Judge

    session = request.config.stash[_SESSION]
    yield Judge(session.rule_of(request.node), backend, session.adapter)
