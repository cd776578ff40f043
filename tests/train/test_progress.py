"""The local engine's progress output (dsv4flash/engine/progress.py) on an injected clock: no sleeping, no timing."""

import io

from dsv4flash.engine.progress import ProgressLog, RateLine, format_duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_line_throttles_to_one_line_per_interval_and_always_shows_first_and_last():
    clock = Clock()
    line = RateLine("train", 100, unit="steps", every_s=15.0, clock=clock)
    shown = {}
    for done in range(1, 101):
        clock.now += 2.0  # 0.5 steps/s
        text = line.update(done, status=f"loss {1 / done:.3f}")
        if text is not None:
            shown[done] = text
    # the first update, then one per 15 s of clock (every 8th step at 2 s/step), then the last
    assert list(shown) == [1, 9, 17, 25, 33, 41, 49, 57, 65, 73, 81, 89, 97, 100]
    assert shown[1] == "train 1/100 (1%)  0.5 steps/s  elapsed 2s  ETA 3m18s  loss 1.000"
    assert shown[9].startswith("train 9/100 (9%)  0.5 steps/s  elapsed 18s  ETA 3m02s")
    assert shown[100] == "train 100/100 (100%)  0.5 steps/s  elapsed 3m20s  done  loss 0.010"


def test_rate_line_rate_counts_from_the_resume_point_and_has_no_eta_before_progress():
    clock = Clock()
    line = RateLine("train", 10, unit="steps", start=4, clock=clock)
    assert line.update(4) == "train 4/10 (40%)  - steps/s  elapsed 0s"
    clock.now += 4.0
    assert line.format(6, clock.now) == "train 6/10 (60%)  0.5 steps/s  elapsed 4s  ETA 8s"


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 60, 187, 3600 + 125)] == ["0s", "59s", "1m00s", "3m07s", "1h02m"]


def test_piped_progress_log_prints_throttled_lines_and_keeps_them_in_the_run_log(tmp_path):
    clock, out = Clock(), io.StringIO()
    log = ProgressLog("auto", tmp_path / "run" / "train.log", stream=out, clock=clock)
    assert not log.enabled  # not a terminal: plain lines
    log.print("decoder_lora: sft on geometry")
    with log.task("train", 4, unit="steps") as train:
        for _ in range(4):
            clock.now += 1.0
            with log.task("eval@x", 8, unit="examples") as ev:  # nested, as the engine's evaluations are
                ev.advance(8)
            train.advance(1, "loss 0.5")
    console = out.getvalue().splitlines()
    assert console[0] == "decoder_lora: sft on geometry"
    assert [c.split("  ")[0] for c in console[1:]] == ["eval@x 8/8 (100%)", "train 1/4 (25%)"] + \
        ["eval@x 8/8 (100%)"] * 3 + ["train 4/4 (100%)"]
    logged = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert [entry.split(" ", 1)[1] for entry in logged] == console  # each line behind its time of day


def test_terminal_bar_keeps_plain_lines_in_the_run_log_only(tmp_path):
    clock, out = Clock(), io.StringIO()
    log = ProgressLog("on", tmp_path / "train.log", stream=out, clock=clock)
    with log.task("train", 2, unit="steps") as train:
        for _ in range(2):
            clock.now += 3.0
            with log.task("eval@x", 4, unit="examples") as ev:
                ev.advance(4)
            train.advance(1)
    logged = [entry.split(" ", 1)[1] for entry in (tmp_path / "train.log").read_text().splitlines()]
    assert logged[-1] == "train 2/2 (100%)  0.333 steps/s  elapsed 6s  done"
    assert not any(line.startswith("train ") for line in out.getvalue().splitlines() if "elapsed" in line)


def test_a_step_silent_for_longer_than_the_interval_gets_a_heartbeat_line(tmp_path):
    clock, out = Clock(), io.StringIO()
    log = ProgressLog("off", stream=out, clock=clock)
    with log.task("eval@0", 32, unit="examples") as ev:
        ev.advance(1)  # the first line
        clock.now += 14.0
        ev.heartbeat()  # younger than 15 s: nothing
        clock.now += 2.0
        ev.heartbeat()  # a slow batch: the step says it is still at it
        ev.heartbeat()  # once per interval
        clock.now += 20.0
        ev.advance(31)  # the last line
        ev.heartbeat()  # done: no heartbeat after the last line
    assert out.getvalue().splitlines() == [
        "eval@0 1/32 (3%)  - examples/s  elapsed 0s",
        "eval@0 1/32 (3%)  0.0625 examples/s  elapsed 16s  ETA 8m16s  working",
        "eval@0 32/32 (100%)  0.889 examples/s  elapsed 36s  done"]


def test_piped_output_runs_one_heartbeat_timer_per_step_and_stops_it_with_the_step():
    import threading

    log = ProgressLog("off", stream=io.StringIO(), heartbeat_s=3600.0)
    with log.task("train", 2) as train:
        assert [t.name for t in threading.enumerate()].count("progress-train") == 1
        train.advance(2)
    assert "progress-train" not in [t.name for t in threading.enumerate()]
