"""The pytest plugin: options, fixtures and the hooks that tie tests to rules.

Registered as a ``pytest11`` entry point. Everything it does is inert unless conformance
tests are collected; the work lives in :mod:`conformance.session` and
:mod:`conformance.report`, imported when needed.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

from conformance.profiles import PROFILES, select_profile

if TYPE_CHECKING:
    from conformance.adapter import Backend
    from conformance.checks import Judge
    from conformance.session import SuiteSession
    from spec.tolerances import Tolerance

_SESSION: pytest.StashKey[SuiteSession] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("decoder-conformance", "decoder conformance suite")
    group.addoption(
        "--adapter",
        help="backend to check: a registered adapter name or package.module:attribute "
        "(default: $DECODER_CONFORMANCE_ADAPTER, else 'reference')",
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
        "--conformance-profile",
        choices=sorted(PROFILES),
        default="default",
        help="hypothesis profile of the suite: ci (small, derandomized), default, thorough",
    )
    group.addoption("--conformance-json", help="write the rule-by-rule report as JSON here")
    group.addoption("--conformance-markdown", help="write the rule-by-rule report as Markdown here")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "rule(rule_id): the spec rule a conformance test checks")
    config.addinivalue_line(
        "markers", "needs(*capabilities): backend capabilities the test cannot run without"
    )
    select_profile(config.getoption("conformance_profile"))
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
        ordered = sorted(
            conformance_items, key=lambda item: position.get(session.rule_of(item), len(position))
        )
        others = [item for item in items if not _is_conformance_test(item)]
        items[:] = ordered + others
    for item in items:
        if not _is_conformance_test(item):
            continue
        rule_id = session.rule_of(item)
        item.user_properties.append(("rule", rule_id))
        if session.expected_failures is not None:
            reason = session.expected_failures.reason_for(item, rule_id)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
    if session.expected_failures is not None:
        for number, entry in session.expected_failures.unmatched():
            item_warning = pytest.PytestConfigWarning(
                f"{session.expected_failures.path.name} line {number} ({entry!r}) matches no test"
            )
            config.issue_config_time_warning(item_warning, stacklevel=2)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not any("conformance" in str(arg) for arg in config.args):
        return None
    identity = config.stash[_SESSION].identity()
    return [
        f"decoder-conformance {identity.suite_version}: backend {identity.backend} "
        f"{identity.backend_version}, precision {identity.precision}, profile {identity.profile}",
        f"capabilities: {', '.join(identity.capabilities) or 'none'}",
    ]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _is_conformance_test(item):
        return
    backend = item.config.stash[_SESSION].backend
    begin_test = getattr(backend, "begin_test", None)
    if callable(begin_test):
        begin_test()  # a backend may keep per-test state, such as a remembered fault
    for marker in item.iter_markers("needs"):
        for capability in marker.args:
            if capability not in backend.capabilities:
                pytest.skip(f"needs capability '{capability}', which backend {backend.name} lacks")


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config) -> Backend:
    """The backend under test."""
    return pytestconfig.stash[_SESSION].backend


@pytest.fixture(scope="session")
def tolerance(backend: Backend) -> Tolerance:
    """Value and gradient tolerances for the backend's declared precision."""
    from spec.tolerances import tolerance_for

    return tolerance_for(backend.precision)


@pytest.fixture
def judge(request: pytest.FixtureRequest, backend: Backend) -> Generator[Judge, None, None]:
    """Checks for the rule the test names, failing in the suite's message shape."""
    from conformance.checks import Judge

    session = request.config.stash[_SESSION]
    yield Judge(session.rule_of(request.node), backend, session.adapter)
