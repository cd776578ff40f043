"""The service benchmark's sampling and GRPO parts run and report their figures (no timing assertions: timings belong to
`python -m dsv4flash.bench service`)."""

from __future__ import annotations

import argparse

import pytest


def test_service_bench_sampling_part_quick(one_thread, tmp_path):
    from dsv4flash.bench import service

    parser = argparse.ArgumentParser()
    service.add_arguments(parser)
    args = parser.parse_args(["--part", "sampling", "--seq", "9", "--decode-tokens", "2", "--repeats", "1",
                              "--plot", str(tmp_path / "service.png")])
    report = service.run(args)
    figures = report.as_dict()
    for key in ("sampling_recompute_N8", "sampling_separate_N8", "sampling_shared_prefill_N8", "sampling_shared_N8",
                "sampling_shared_per_adapter_N8",
                "sampling_encoder_step_ms", "sampling_decoder_step_ms", "sampling_amdahl_bound_N8"):
        assert figures[key] > 0, key
    assert len(report.targets) == 1 and "same continuation" in report.targets[0]
    assert (tmp_path / "service.png").stat().st_size > 0


def test_service_bench_shared_part_reports_all_three_modes(one_thread, tmp_path):
    from dsv4flash.bench import service

    parser = argparse.ArgumentParser()
    service.add_arguments(parser)
    args = parser.parse_args(["--part", "shared", "--batch", "1", "--seq", "5", "--repeats", "1",
                              "--plot", str(tmp_path / "shared.png")])
    report = service.run(args)
    figures = report.as_dict()
    for n in (1, 2, 4, 8):
        for key in (f"separate_N{n}", f"shared_per_adapter_N{n}", f"shared_exact_N{n}", f"shared_N{n}",
                    f"shared_exact_N{n}/separate_N{n}"):
            assert figures[key] > 0, key
    assert len(report.targets) == 2 and "bit-exact (batched decoders" in report.targets[0]
    assert "fp32 rounding" in report.targets[1] and (tmp_path / "shared.png").stat().st_size > 0


@pytest.mark.slow
def test_service_bench_grpo_part_reports_busy_idle_and_setup(one_thread):
    from dsv4flash.bench import service

    parser = argparse.ArgumentParser()
    service.add_arguments(parser)
    args = parser.parse_args(["--part", "grpo", "--grpo-runs", "1", "--grpo-steps", "1", "--reward-latency", "0.01"])
    figures = service.run(args).as_dict()
    for key in ("grpo_sequential_makespan", "grpo_concurrent_makespan", "grpo_sequential_base_busy",
                "grpo_concurrent_base_busy", "grpo_sequential_setup", "grpo_concurrent_setup",
                "grpo_ratio_after_setup", "grpo_concurrent_bound_from_busy", "grpo_concurrent_idle_before_update"):
        assert figures[key] > 0 or key.startswith("grpo_concurrent_idle"), key
    # busy time is part of the makespan in both modes
    assert figures["grpo_sequential_base_busy"] < figures["grpo_sequential_makespan"]
    assert figures["grpo_concurrent_base_busy"] < figures["grpo_concurrent_makespan"]
