"""The fault runner tells the outcomes apart: a case that hangs, leaks a traceback, leaves files behind or
completes when it should refuse is reported as such (so a passing fault suite means something)."""

from __future__ import annotations

import os

from dsv4flash.faultcases import Case, Failure, LeftBehind, run_case


def _case(fn, expect="clean error", timeout_s=5.0) -> Case:
    return Case("bridge", fn.__name__, fn, expect, None, (), timeout_s)


def test_a_blocking_open_is_reported_as_hung(fault_context):
    def opens_a_fifo(ctx):
        os.mkfifo(ctx.tmp / "fifo")
        open(ctx.tmp / "fifo").read()  # blocks: no writer
    assert run_case(_case(opens_a_fifo, timeout_s=1.0), fault_context).outcome == "hung"


def test_completing_instead_of_refusing_is_silent_wrong(fault_context):
    result = run_case(_case(lambda ctx: ctx.must_fail(lambda: 42)), fault_context)
    assert (result.outcome, result.detail) == ("silent wrong", "completed without an error")


def test_raw_and_multiline_errors_are_unclean(fault_context):
    def raw(ctx):
        return ctx.must_fail(lambda: [][1])

    def multiline(ctx):
        return Failure("error: first\nsecond", exit_code=2)

    def traceback_cli(ctx):
        return ctx.cli_must_fail("lifecycle", "--root", ctx.tmp, "policies", "--no-such-flag")
    assert run_case(_case(raw), fault_context).outcome == "unclean error"
    assert run_case(_case(multiline), fault_context).outcome == "unclean error"
    assert run_case(_case(traceback_cli), fault_context).outcome == "unclean error"  # argparse: usage + exit 2


def test_leftovers_and_clean_errors(fault_context):
    def leaves(ctx):
        (ctx.tmp / "out.partial").mkdir()
        failure = ctx.must_fail(lambda: int("x"))
        ctx.nothing_at(ctx.tmp / "out.partial")
        return failure

    def clean(ctx):
        return ctx.must_fail(lambda: int("x"))
    assert run_case(_case(leaves), fault_context).outcome == "left behind"
    result = run_case(_case(clean), fault_context)
    assert result.outcome == "clean error" and "invalid literal" in result.detail
    assert isinstance(LeftBehind("x"), BaseException) and not isinstance(LeftBehind("x"), Exception)
