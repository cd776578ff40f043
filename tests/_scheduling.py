"""How the suite shares the machine's two cores: the work units of pytest-xdist's `--dist loadgroup`.

A pytest plugin (registered in tests/conftest.py). The `whole_machine` tests (a Ray cluster, multi-rank gloo
runs: marked so; benchmarks: every tests/*/test_bench_*.py) form one group, so no two of them run side by side,
and they come first, so the longest chain of work starts at once. A test that uses a module-, class- or
package-scoped fixture goes to its module's group, so that fixture is built once, on one worker. So does a
both-forms test (`patch_form`, dsv4flash/patchseries/testing.py): its `[series]` item runs every both-forms test of
the module in one subprocess on the patched copy, cached per worker, and compares with the `[runtime]` records of
the same worker; split over two workers, the module's series subprocess would run on each, plus a runtime
subprocess for the items whose `[runtime]` ran on the other. A module with a whole_machine both-forms test puts all
its both-forms tests in the whole_machine group, since that subprocess runs them all. Every other test is
scheduled on its own.

pytest-xdist 3.8 turns an `xdist_group` mark into a `@group` suffix of the node id it reports; pytest 9.2 keeps
node ids elsewhere, where that suffix is lost and every test silently becomes its own unit, so pyproject.toml
pins pytest below 9.2 and tests/core/test_suite_timing.py checks the grouping on a real two-worker run.
"""

from __future__ import annotations

import pytest

WHOLE_MACHINE = "whole_machine"


def shares_module_state(item) -> bool:
    """Whether the test uses a fixture scoped to its module, class or package (built once for its neighbours)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in ("module", "class", "package")
               for defs in (info.name2fixturedefs.get(name) for name in info.names_closure))


def both_forms(item) -> bool:
    """Whether the test is a both-forms test (`patch_form`): its module's series subprocess runs all of them."""
    return "patch_form" in getattr(item, "fixturenames", ())


def group_of(item, machine_modules: frozenset = frozenset()) -> str | None:
    """The loadgroup unit of a test: `whole_machine`, its module's path, or None (a unit of its own). A both-forms
    test of a module in `machine_modules` (one of its both-forms tests is whole_machine) is whole_machine too: the
    series subprocess its first `[series]` item starts runs every both-forms test of the module, that one included."""
    if item.get_closest_marker(WHOLE_MACHINE) or item.path.name.startswith("test_bench_"):
        return WHOLE_MACHINE
    if both_forms(item) and item.path in machine_modules:
        return WHOLE_MACHINE
    return item.nodeid.split("::", 1)[0] if shares_module_state(item) or both_forms(item) else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Mark every test's group and put the whole_machine tests first (module order kept otherwise)."""
    machine_modules = frozenset(item.path for item in items
                                if both_forms(item) and group_of(item) == WHOLE_MACHINE)
    groups = {}
    for item in items:
        groups[item.nodeid] = group = group_of(item, machine_modules)
        if item.get_closest_marker("xdist_group") is None and group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: groups[item.nodeid] != WHOLE_MACHINE)
