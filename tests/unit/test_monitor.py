"""Rank-0 logging, TensorBoard writer and progress bars."""
import io
import logging

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_tc.monitor import TBWriter, get_logger, get_rank, progress, progress_enabled, setup_logging


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def read_events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_rank_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert get_rank() == 3
    monkeypatch.delenv("RANK")
    assert get_rank() == 0


def test_tb_writer_rank0_writes_readable_events(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with TBWriter(tmp_path / "tb") as tb:
        tb.scalar("loss/kl", torch.tensor(0.5), step=1)
        tb.scalar("loss/kl", 0.25, step=2)
        tb.scalars({"lr": 1e-4, "grad_norm": 2.0}, step=2, prefix="train")
        tb.histogram("stats/A_log", torch.linspace(-1, 1, 100), step=0)
        tb.text("config", "run: {}", step=0)
    acc = read_events(tmp_path / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("loss/kl")] == [(1, 0.5), (2, 0.25)]
    assert acc.Scalars("train/lr")[0].value == pytest.approx(1e-4)
    assert acc.Scalars("train/grad_norm")[0].value == 2.0
    hist = acc.Histograms("stats/A_log")[0].histogram_value
    assert hist.num == 100 and hist.min == -1.0 and hist.max == 1.0
    assert "config/text_summary" in acc.Tags()["tensors"]


def test_tb_writer_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    tb = TBWriter(tmp_path / "tb")
    assert not tb.enabled
    tb.scalar("loss", 1.0, 0)
    tb.scalars({"a": 1.0}, 0)
    tb.histogram("h", torch.ones(3), 0)
    tb.text("t", "x")
    tb.flush()
    tb.close()
    assert not (tmp_path / "tb").exists()
    assert not TBWriter(tmp_path / "off", enabled=False).enabled  # explicitly off on rank 0 too


def test_progress_bar_off_without_terminal_or_when_configured_off(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert not progress_enabled(True, io.StringIO())  # not a TTY (also what pytest gives stderr)
    bar = progress(range(3), desc="x", file=io.StringIO())
    assert bar.disable and list(bar) == [0, 1, 2]  # a disabled bar still iterates
    assert progress_enabled(True, FakeTTY())
    tty = FakeTTY()
    bar = progress(range(3), desc="stage2", file=tty)
    assert not bar.disable and list(bar) == [0, 1, 2]
    bar.close()
    assert "stage2" in tty.getvalue()
    assert progress(range(3), enabled=False, file=FakeTTY()).disable
    monkeypatch.setenv("RANK", "1")
    assert progress(range(3), file=FakeTTY()).disable


def test_logging_rank0_info_other_ranks_warnings_only(monkeypatch):
    stream = io.StringIO()
    setup_logging("INFO", stream=stream)
    log = get_logger("distill")
    assert log.name == "megatron_tc.distill"
    monkeypatch.setenv("RANK", "0")
    log.info("hello %d", 7)
    monkeypatch.setenv("RANK", "1")
    log.info("hidden")
    log.warning("careful")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("[rank 0] INFO megatron_tc.distill: hello 7")
    assert lines[1].endswith("[rank 1] WARNING megatron_tc.distill: careful")
    assert lines[0][:4].isdigit()  # starts with the time
    setup_logging("WARNING", stream=stream)  # idempotent: one handler, new level
    assert len([h for h in logging.getLogger("megatron_tc").handlers if getattr(h, "_megatron_tc", False)]) == 1
    monkeypatch.setenv("RANK", "0")
    log.info("now hidden")
    assert "now hidden" not in stream.getvalue()
    setup_logging("INFO")


def _rank_scalars_worker(rank: int, world_size: int, log_dir: str) -> None:
    from megatron_tc.monitor import RankScalars

    tb = TBWriter(log_dir)  # writes on rank 0 only
    curves = RankScalars(tb)
    for layer in (rank, rank + 2):  # rank r "aligned" layers r and r + 2
        for step in range(3):
            curves.scalar(f"align/L{layer:02d}/train", 10 * layer + step, step)
        curves.scalar("align/best_relative_mse", layer / 10, layer)
    curves.scalar("shared", 1.5, 0)  # logged by both ranks: written once
    written = curves.gather()
    tb.close()
    assert written == (4 * 3 + 4 + 1 if rank == 0 else 0)


def test_rank_scalars_reach_rank0s_log_from_every_rank(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_tc.testing import run_distributed

    run_distributed(_rank_scalars_worker, 2, str(tmp_path / "tb"))
    assert len(list((tmp_path / "tb").glob("events.*"))) == 1  # one writer, one run
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    for layer in range(4):
        events = acc.Scalars(f"align/L{layer:02d}/train")
        assert [(e.step, e.value) for e in events] == [(s, 10 * layer + s) for s in range(3)]
    best = acc.Scalars("align/best_relative_mse")
    assert [e.step for e in best] == [0, 1, 2, 3]
    assert [e.value for e in best] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert [(e.step, e.value) for e in acc.Scalars("shared")] == [(0, 1.5)]
