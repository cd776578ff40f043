"""Pytest harness for "both forms tested": one test body, run with the runtime twin and on the patched copy.

A test module sets `PATCH_ID = "..."` and writes tests that take the `patch_form` fixture and record what
they observe with `patch_form.record(name, value)`. Each such test is collected twice:

* `[runtime]` runs in this process against the stock upstream with the runtime twin applied;
* `[series]` re-runs the same test function in a fresh `python -m pytest` subprocess whose `PYTHONPATH`
  starts with a patched copy of the pinned upstream release (`copies.patched_copy`), where the twin is
  not applied and its upstream probe must report the fix as present. The two runs must pass and record
  identical values (within a per-record tolerance for floats).

Register it once as a plugin in the root conftest (`pytest_plugins = ["dsv4flash.patchseries.testing"]`); its
hooks only act on tests that request `patch_form`.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FORMS = ("runtime", "series")
FORM_ENV = "DSV4FLASH_PATCH_FORM"
RESULTS_ENV = "DSV4FLASH_PATCH_FORM_RESULTS"
COPY_ENV = "DSV4FLASH_PATCHED_COPY"
SOURCE_ENV = "DSV4FLASH_PATCH_SOURCE"  # index | installed | auto (default auto)

_runtime_records: dict[str, dict] = {}
_child_runs: dict[tuple[str, str], dict] = {}
_child_results: dict[str, dict] = {}
_child_keys: dict[str, str] = {}


@dataclass
class PatchForm:
    """What a both-forms test sees: the form's name and a place to record observed values."""

    name: str
    patch_id: str
    records: dict[str, Any] = field(default_factory=dict)

    def record(self, key: str, value: Any, atol: float = 0.0, rtol: float = 0.0) -> None:
        """Remember `value` under `key`; the other form must record an equal value (floats within atol/rtol)."""
        if key in self.records:
            raise KeyError(f"record {key!r} written twice")
        self.records[key] = {"value": encode(value), "atol": atol, "rtol": rtol}


def encode(value: Any) -> Any:
    """A JSON-able description of a recorded value (tensors keep dtype and shape)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of the project
        torch = None
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {"tensor": t.tolist(), "dtype": str(t.dtype), "shape": list(t.shape)}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record a {type(value).__name__}; record tensors, numbers, strings or lists")


def _close(a: Any, b: Any, atol: float, rtol: float) -> bool:
    """Structural equality with float tolerance."""
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            return False
        return a == b or (math.isfinite(a) and abs(a - b) <= atol + rtol * abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, atol, rtol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], atol, rtol) for k in a)
    return a == b


def compare_records(runtime: dict, series: dict) -> list[str]:
    """Human-readable differences between the two forms' records (empty when they agree)."""
    out = []
    for key in sorted(set(runtime) | set(series)):
        if key not in runtime or key not in series:
            out.append(f"{key!r} recorded only by the {'runtime' if key in runtime else 'series'} form")
            continue
        r, s = runtime[key], series[key]
        if not _close(r["value"], s["value"], r["atol"], r["rtol"]):
            out.append(f"{key!r}: runtime {json.dumps(r['value'])[:300]} != series {json.dumps(s['value'])[:300]}")
    return out


def test_key(item: pytest.Item) -> str:
    """Identity of a test across processes and forms: function name plus its non-form parameters."""
    callspec = getattr(item, "callspec", None)
    params = {k: v for k, v in (callspec.params.items() if callspec else ()) if k != "patch_form"}
    suffix = ",".join(f"{k}={v!r}" for k, v in sorted(params.items()))
    return f"{Path(str(item.fspath)).name}::{item.originalname}[{suffix}]"


def _twin(patch_id: str):
    """The registered runtime twin for a Patch-Id (all twins discovered)."""
    from dsv4flash.patching import twins

    return twins.discover(os.environ.get("DSV4FLASH_TWIN_PACKAGE") or twins.TWIN_PACKAGE_ROOT).get(patch_id)


def _upstream_module(twin) -> Any:
    """The deepest importable module named by the twin's first Touches entry."""
    parts = twin.meta.touches[0].split(".")
    for cut in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
    raise ImportError(f"none of {twin.meta.touches[0]} is importable")


@pytest.fixture
def patch_form(request: pytest.FixtureRequest):
    """Set up one form for the current test (see module docstring)."""
    patch_id = getattr(request.module, "PATCH_ID", None)
    if not patch_id:
        raise pytest.UsageError(f"{request.module.__name__} uses patch_form but defines no PATCH_ID")
    form = PatchForm(request.param, patch_id)
    twin = _twin(patch_id)
    child = os.environ.get(FORM_ENV)
    if form.name == "series" and not child:
        yield form  # placeholder: pytest_pyfunc_call runs this test in a subprocess instead
        return
    if twin.installed_version() is None:
        pytest.skip(f"{twin.meta.distribution} is not installed")
    module = _upstream_module(twin)
    copy_root = os.environ.get(COPY_ENV)
    from_copy = copy_root is not None and Path(module.__file__).resolve().is_relative_to(Path(copy_root).resolve())
    if form.name == "series":
        assert from_copy, f"{module.__name__} imported from {module.__file__}, not the patched copy {copy_root}"
        assert not twin.applied, "the runtime twin must stay out of the series form"
        if twin.has_probe:
            assert twin.upstream_has_it(), f"{patch_id}: the upstream probe does not see the fix in the patched copy"
        try:
            yield form
        finally:
            _child_records_for(request.node)["records"] = form.records
    else:
        assert not from_copy, f"runtime form must run on the stock {twin.meta.distribution}"
        from dsv4flash.patching import twins

        active_before = {t.meta.patch_id for t in twins.REGISTRY.all() if t.applied}
        outcome = twin.apply(mode="auto")
        if not outcome.active:
            pytest.skip(f"runtime twin {patch_id} not applied here ({outcome.value})")
        if outcome.value == "upstream-has-it":
            pytest.skip(f"installed {twin.meta.distribution} {twin.installed_version()} already has {patch_id}")
        try:
            yield form
        finally:
            # Revert this twin and the Depends-On twins it pulled in, so no test leaves twins behind.
            for other in reversed(twins.REGISTRY.all()):
                if other.applied and other.meta.patch_id not in active_before:
                    other.revert()
            if not child:
                _runtime_records[test_key(request.node)] = form.records
            else:
                _child_records_for(request.node)["records"] = form.records


def _child_records_for(item: pytest.Item) -> dict:
    """The result slot of a test inside a child run."""
    return _child_results.setdefault(test_key(item), {"outcome": "not run", "records": {}, "longrepr": ""})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise `patch_form` over both forms (or only the child's form inside a subprocess)."""
    if "patch_form" in metafunc.fixturenames:
        child = os.environ.get(FORM_ENV)
        metafunc.parametrize("patch_form", [child] if child else list(FORMS), indirect=True, ids=lambda f: f)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a child run keep only both-forms tests and remember their keys."""
    if not os.environ.get(FORM_ENV):
        return
    keep = [i for i in items if "patch_form" in getattr(i, "fixturenames", ())]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep
    for item in keep:
        _child_keys[item.nodeid] = test_key(item)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In a child run, collect each test's outcome (the worst of setup/call/teardown)."""
    key = _child_keys.get(report.nodeid)
    if key is None:
        return
    slot = _child_results.setdefault(key, {"outcome": "not run", "records": {}, "longrepr": ""})
    if report.failed or (report.skipped and slot["outcome"] != "failed") or (
            report.when == "call" and slot["outcome"] == "not run"):
        slot["outcome"] = report.outcome
        if report.longrepr is not None:
            slot["longrepr"] = (report.longreprtext or str(report.longrepr))[-4000:]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a child run, write every collected result for the parent."""
    path = os.environ.get(RESULTS_ENV)
    if os.environ.get(FORM_ENV) and path:
        Path(path).write_text(json.dumps(_child_results))


def _series_for(patch_id: str, rootpath: Path):
    """(the loaded Series folder that contains `patch_id`, every loaded folder by name)."""
    from dsv4flash.patchseries.series import load_series

    patches_dir = rootpath / "patches"
    series_map = load_series(patches_dir)
    for series in series_map.values():
        if patch_id in series.by_id():
            return series, series_map
    raise LookupError(f"Patch-Id {patch_id} has no format-patch under {patches_dir}")


def _run_child(item: pytest.Function, form: str) -> dict:
    """Run every both-forms test of the item's module in a subprocess for `form` (cached per session)."""
    module_path = str(item.fspath)
    cache_key = (module_path, form)
    if cache_key in _child_runs:
        return _child_runs[cache_key]
    import tempfile

    from dsv4flash.patchseries import copies, fetch

    env = {**os.environ, FORM_ENV: form}
    env.pop(COPY_ENV, None)
    if form == "series":
        patch_id = item.module.PATCH_ID
        series, series_map = _series_for(patch_id, item.config.rootpath)
        opts = fetch.FetchOptions(source=os.environ.get(SOURCE_ENV, "auto"))
        try:
            copy = copies.patched_copy(series, (patch_id,), opts)
            # A patch on another upstream's patches (Depends-On: <folder>/<Patch-Id>) runs on both patched trees.
            others = copies.upstream_dependency_copies(series_map, series.by_id()[patch_id], opts)
        except fetch.FetchError as exc:
            pytest.skip(f"no pinned upstream release to patch on this machine: {exc}")
        env[COPY_ENV] = str(copy.root)
        paths = [str(copy.sys_path), *(str(other.sys_path) for other in others)]
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="dsv4flash-forms-") as tmp:
        results_path = Path(tmp) / "results.json"
        env[RESULTS_ENV] = str(results_path)
        cmd = [sys.executable, "-m", "pytest", module_path, "-q", "-p", "no:cacheprovider",
               "--rootdir", str(item.config.rootpath)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(item.config.rootpath))
        results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    run = {"results": results, "output": (proc.stdout + proc.stderr)[-6000:], "returncode": proc.returncode}
    _child_runs[cache_key] = run
    return run


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """Parent side of a `[series]` item: run the module's tests on the patched copy, compare with runtime."""
    if os.environ.get(FORM_ENV):
        return None
    callspec = getattr(pyfuncitem, "callspec", None)
    if callspec is None or callspec.params.get("patch_form") != "series":
        return None
    key = test_key(pyfuncitem)
    series_run = _run_child(pyfuncitem, "series")
    series = series_run["results"].get(key)
    if series is None:
        pytest.fail(f"the series-form subprocess did not run {key}:\n{series_run['output']}")
    if series["outcome"] == "skipped":
        pytest.skip(f"series form skipped: {series['longrepr']}")
    if series["outcome"] != "passed":
        pytest.fail(f"series form (patched upstream copy) failed:\n{series['longrepr']}", pytrace=False)
    runtime = _runtime_records.get(key)
    if runtime is None:  # the [runtime] item was deselected or ran elsewhere: run it in a subprocess too
        runtime_run = _run_child(pyfuncitem, "runtime")
        entry = runtime_run["results"].get(key)
        if entry is None or entry["outcome"] != "passed":
            pytest.fail(f"runtime form failed in a subprocess:\n{(entry or {}).get('longrepr') or runtime_run['output']}")
        runtime = entry["records"]
    diffs = compare_records(runtime, series["records"])
    if diffs:
        pytest.fail("runtime twin and patched upstream disagree:\n" + "\n".join(diffs), pytrace=False)
    if not runtime:
        pytest.fail(f"{key} recorded nothing; both-forms tests must record what they observe", pytrace=False)
    return True
