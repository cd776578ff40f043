"""`dsv4flash --help`, `--version` and argument errors of every subcommand answer without importing torch & co.

One child process runs every path in turn through `dsv4flash.cli.main` and reports the first path after which
a heavy module is in `sys.modules` (so a regression names the command that brought it in). The latency itself is
a figure of `python -m dsv4flash.bench main`, not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from dsv4flash.cli import SUBCOMMANDS

HEAVY = ("torch", "transformers", "safetensors", "numpy")

CHILD = textwrap.dedent("""
    import contextlib, io, json, sys
    from dsv4flash.cli import main
    heavy, paths, seen = json.loads(sys.argv[1]), json.loads(sys.argv[2]), []
    for argv in paths:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code
        loaded = [m for m in heavy if m in sys.modules]
        seen.append({"argv": argv, "rc": rc, "loaded": loaded, "stdout": out.getvalue(), "stderr": err.getvalue()})
        if loaded:
            break
    print(json.dumps(seen))
""")


def _paths() -> list[list[str]]:
    paths = [["--help"], ["--version"], ["no-such-command"]]
    for name in SUBCOMMANDS:
        paths += [[name, "--help"], [name, "--no-such-option"]]
    paths += [["lifecycle", "--root", "/nonexistent/store", "policies"],  # no store there
              ["lifecycle", "export", "--format", "nope", "a", "b"],
              ["census", "--config"],  # option without its value
              ["serve", "--port", "eighty"],
              ["train", "+recipe=decoder_lora", "lora.rank=-1"]]  # a recipe error the schema check refuses
    return paths


def test_help_and_argument_errors_do_not_import_torch(tmp_path):
    paths = _paths()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(HEAVY), json.dumps(paths)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert [s["argv"] for s in seen] == paths, f"{seen[-1]['argv']} imported {seen[-1]['loaded']}"
    by_argv = {tuple(s["argv"]): s for s in seen}
    for s in seen:
        expected = 0 if s["argv"][-1] in ("--help", "--version") else 2
        assert s["rc"] == expected, s
        if expected == 2:
            assert s["stderr"].strip() and "Traceback" not in s["stderr"], s
    assert by_argv[("--version",)]["stdout"].startswith("dsv4flash ")
    assert "train" in by_argv[("--help",)]["stdout"]
    assert "no adapter store here" in by_argv[("lifecycle", "--root", "/nonexistent/store", "policies")]["stderr"]
    assert by_argv[("train", "+recipe=decoder_lora", "lora.rank=-1")]["stderr"].strip() == \
        "error: lora.rank must be a positive int, got -1"
    assert not list(tmp_path.iterdir()), "a refused train run must leave no run directory"
