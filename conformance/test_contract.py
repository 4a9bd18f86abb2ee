"""The adapter contract: what every backend returns, before any rule looks at the numbers."""

from __future__ import annotations

import pytest

from conformance.checks import Judge


@pytest.mark.rule("ADAPTER-CONTRACT")
def test_the_adapter_keeps_its_contract(judge: Judge, contract_violations: list[str]) -> None:
    """Numpy arrays of the declared precision, the stable names, a dict of every gradient,
    the declared refusals and capabilities (conformance.contract; checked once a run)."""
    judge.check(
        not contract_violations,
        f"adapter contract ({len(contract_violations)} violations)",
        "; ".join(contract_violations),
        "no violation",
    )
