"""Every fault case of `dsv4flash.faultcases` (the table `python -m dsv4flash.bench faults` also runs) has exactly
its registered outcome: a clean one-line error matching its pattern, or a correct result."""

from __future__ import annotations

import re

import pytest

from dsv4flash.faultcases import all_cases, run_case

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault_case(case, fault_context, request):
    if "postgres" in case.needs:
        fault_context.postgres_server = request.getfixturevalue("pg_server")
    result = run_case(case, fault_context)
    assert result.outcome == case.expect, f"{case.name}: {result.outcome}: {result.detail}"
    if case.match is not None:
        assert re.search(case.match, result.detail), f"{case.name}: message {result.detail!r} !~ {case.match!r}"


def test_the_table_covers_every_area_and_enough_cases():
    areas = {c.area for c in CASES}
    assert areas == {"bridge", "lifecycle", "service"}
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)  # ids are unique
    assert all(c.match for c in CASES if c.expect == "clean error")  # every refusal names what it expects
