"""`dsv4flash patches check --run-tests`: run every patch's Tests once and judge each patch on both forms.

All Tests files run in one `python -m pytest` (strict about skips, JUnit XML report). A both-forms test is
collected as `name[runtime]` and `name[series]` (see `testing`); each patch is then judged on the files
that declare its Patch-Id: any failed or errored test is an error naming the patch and the test, and so
is a form in which no test passed (unless every test of that form was skipped for want of a GPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from dsv4flash.patchseries.series import Problem, Series, both_forms_tests
from dsv4flash.patchseries.testing import FORMS

TWIN_PACKAGE_ENV = "DSV4FLASH_TWIN_PACKAGE"
GPU_SKIPS = ("needs a CUDA device", "needs more than one CUDA device")
_FORM_RE = re.compile(r"\[(?P<params>[^\]]*)\]$")


@dataclass(frozen=True)
class CaseResult:
    """One collected test: its file, name, form (runtime | series | None) and outcome."""

    file: str
    name: str
    form: str | None
    outcome: str  # passed | failed | error | skipped
    message: str = ""


def _form_of(name: str) -> str | None:
    """`runtime` / `series` from a parametrised test name (`test_x[series-alltoall]`), else None."""
    match = _FORM_RE.search(name)
    if not match:
        return None
    found = [f for f in FORMS if f in match.group("params").split("-")]
    return found[0] if len(found) == 1 else None


def parse_junit(xml_text: str, files: list[str]) -> list[CaseResult]:
    """Test cases of a JUnit report, each mapped to the Tests file (repo-relative) it came from."""
    modules = {f.split("::")[0].removesuffix(".py").replace("/", "."): f.split("::")[0] for f in files}
    out = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        file = next((path for module, path in modules.items()
                     if classname == module or classname.startswith(module + ".")), classname)
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "").strip()
                break
        out.append(CaseResult(file, name, _form_of(name), outcome, message))
    return out


def run_tests(root: Path, files: list[str], twin_package: str) -> tuple[list[CaseResult], str]:
    """Run the files in one strict pytest; returns the cases and the tail of pytest's output."""
    with tempfile.TemporaryDirectory(prefix="dsv4flash-patch-tests-") as tmp:
        report = Path(tmp) / "junit.xml"
        env = {**os.environ, "DSV4FLASH_STRICT_SKIPS": "1", TWIN_PACKAGE_ENV: twin_package}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               "-o", "junit_family=xunit2", *sorted({f.split("::")[0] for f in files})]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        xml_text = report.read_text() if report.is_file() else ""
    output = (proc.stdout + proc.stderr)[-4000:]
    return (parse_junit(xml_text, files) if xml_text else []), output


def judge(series_map: dict[str, Series], root: Path, cases: list[CaseResult], output: str) -> list[Problem]:
    """Per patch: errors for failing tests and for a form (runtime / series) in which nothing passed."""
    problems: list[Problem] = []
    for series in series_map.values():
        for patch in series.patches:
            where = f"{series.folder}/{patch.name}"
            own = {t.split("::")[0] for t in both_forms_tests(patch, root)}
            mine = [c for c in cases if c.file in own or c.file in patch.many("Tests")]
            if not mine:
                problems.append(Problem(where, f"none of its Tests ran (pytest collected nothing from "
                                               f"{', '.join(patch.many('Tests'))}):\n{output}"))
                continue
            for case in mine:
                if case.outcome in ("failed", "error"):
                    first = case.message.splitlines()[0].removeprefix("Failed: ") if case.message else "(no message)"
                    problems.append(Problem(where, f"test {case.file}::{case.name} {case.outcome}: {first}"))
            for form in FORMS:
                in_form = [c for c in mine if c.file in own and c.form == form]
                if any(c.outcome == "passed" for c in in_form):
                    continue
                if in_form and all(c.outcome == "skipped" and any(g in c.message for g in GPU_SKIPS)
                                   for c in in_form):
                    problems.append(Problem(where, f"{form} form only has GPU tests; not run on this machine",
                                            "warning"))
                    continue
                problems.append(Problem(where, f"no test passed in the {form} form "
                                               f"({'no such test' if not in_form else 'all failed or skipped'})"))
    return problems


def check_tests(series_map: dict[str, Series], root: Path, twin_package: str) -> list[Problem]:
    """Run every patch's Tests (both forms) and return the per-patch problems."""
    files = sorted({t for s in series_map.values() for p in s.patches for t in p.many("Tests")})
    if not files:
        return []
    cases, output = run_tests(root, files, twin_package)
    return judge(series_map, root, cases, output)
