"""Rank-aware console logging, a TensorBoard writer that only rank 0 uses (with RankScalars for
the scalars other ranks produce), and progress bars.

    from megatron_tc.monitor import setup_logging, get_logger, TBWriter, progress
    setup_logging(cfg.logging.level)
    log = get_logger(__name__)
    with TBWriter(cfg.logging.tensorboard_dir or f"{cfg.run.run_dir}/tensorboard") as tb:
        for step in progress(range(steps), desc="stage2", enabled=cfg.logging.progress_bar):
            tb.scalar("loss/kl", loss, step)

The rank comes from torch.distributed when a process group exists, else from the RANK
environment variable (set by torchrun, deepspeed and launch/distill.sh), else 0. torch is not
imported here unless a TensorBoard writer is actually created.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, Mapping

ROOT_LOGGER = "megatron_tc"
LOG_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def get_rank() -> int:
    dist = sys.modules.get("torch.distributed")  # no process group can exist unless it is imported
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def is_rank0() -> bool:
    return get_rank() == 0


# ---- console logging ---------------------------------------------------------------------------
class _RankFilter(logging.Filter):
    """Stamps the current rank on every record (rank read at emit time: groups may come later)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = get_rank()
        return True


class _RankLevelFilter(logging.Filter):
    """Rank 0 logs at the configured level; other ranks only warnings and errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return get_rank() == 0 or record.levelno >= logging.WARNING


def setup_logging(level: str | int = "INFO", stream=None) -> logging.Logger:
    """Configure the `megatron_tc` logger: one stream handler (stderr), time and rank in each line.

    Idempotent: calling again replaces the handler (e.g. with a new level)."""
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in list(logger.handlers):
        if getattr(handler, "_megatron_tc", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler._megatron_tc = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler.addFilter(_RankFilter())
    handler.addFilter(_RankLevelFilter())
    logger.addHandler(handler)
    logger.setLevel(level if isinstance(level, int) else level.upper())
    logger.propagate = False
    return logger


def get_logger(name: str | None = None) -> logging.Logger:
    """A logger under `megatron_tc` (configured by `setup_logging`, on first use with INFO)."""
    root = logging.getLogger(ROOT_LOGGER)
    if not any(getattr(h, "_megatron_tc", False) for h in root.handlers):
        setup_logging()
    if not name or name == ROOT_LOGGER:
        return root
    if name.startswith(ROOT_LOGGER + "."):
        return logging.getLogger(name)
    return root.getChild(name)


# ---- TensorBoard -------------------------------------------------------------------------------
def _to_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


class TBWriter:
    """TensorBoard writer that writes on rank 0 and is a no-op on every other rank.

    `enabled=None` means "rank 0 only"; False turns it off everywhere (e.g. in tests). The event
    directory is created only by a writer that writes."""

    def __init__(self, log_dir: str | os.PathLike, enabled: bool | None = None, flush_secs: int = 30):
        self.log_dir = str(log_dir)
        self.enabled = is_rank0() if enabled is None else bool(enabled)
        self._writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs)

    def scalar(self, tag: str, value: Any, step: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar(tag, _to_float(value), global_step=step)

    def scalars(self, values: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """One scalar per key, tagged `prefix/key` (plain tags, not add_scalars' sub-runs)."""
        for key, value in values.items():
            self.scalar(f"{prefix}/{key}" if prefix else key, value, step)

    def histogram(self, tag: str, values: Any, step: int) -> None:
        if self._writer is not None:
            if hasattr(values, "detach"):
                values = values.detach().float().cpu()
            self._writer.add_histogram(tag, values, global_step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TBWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RankScalars:
    """Scalars only some ranks produce (e.g. the curves of the layers a rank aligned), for a
    TBWriter that writes on rank 0: every rank buffers its own with `scalar(tag, value, step)`,
    and `gather()` (collective over the world) hands them all to rank 0, which writes them in
    (tag, step) order into the one run directory. A (tag, step) logged by several ranks (replicas)
    is written once."""

    def __init__(self, tb: TBWriter):
        self.tb = tb
        self.records: list[tuple[str, float, int]] = []

    def scalar(self, tag: str, value: Any, step: int) -> None:
        self.records.append((tag, _to_float(value), int(step)))

    add_scalar = scalar  # the SummaryWriter spelling some callers use

    def gather(self) -> int:
        """Write every rank's scalars through rank 0's writer; returns how many were written there."""
        dist = sys.modules.get("torch.distributed")
        parts = [self.records]
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, self.records)
        self.records = []
        seen: set[tuple[str, int]] = set()
        for tag, value, step in sorted((r for part in parts for r in part), key=lambda r: (r[0], r[2])):
            if (tag, step) not in seen:
                seen.add((tag, step))
                self.tb.scalar(tag, value, step)
        self.tb.flush()
        return len(seen) if self.tb.enabled else 0


# ---- progress bars -----------------------------------------------------------------------------
def progress_enabled(enabled: bool = True, file=None) -> bool:
    """Bars show on rank 0, when configured on, and only when the stream is a terminal."""
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(enabled) and is_rank0() and bool(isatty and isatty())


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str | None = None,
             enabled: bool = True, file=None, **kwargs: Any):
    """A tqdm bar (rank 0, terminal only, `enabled` from logging.progress_bar); disabled bars
    still iterate and accept update(), so callers need no branches."""
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    return tqdm(iterable, total=total, desc=desc, file=stream,
                disable=not progress_enabled(enabled, stream), dynamic_ncols=True, **kwargs)
