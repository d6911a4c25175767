"""Stop a training stage cleanly on a signal: a checkpoint at the end of the current step, then exit.

Slurm sends SIGTERM at a job's time limit and on `scancel` (and, ahead of the limit, any signal
asked for with `#SBATCH --signal=USR1@120`); `timeout` and the DeepSpeed launcher send SIGTERM too.
Killed mid-step, a run loses everything since its last checkpoint. While a training stage runs
(pretrain, stage1, stage2), the pipeline installs `ExitSignals(cfg.run.exit_signals)`: a listed
signal then only sets a flag, which the training loop reads once per step. All ranks agree on it
through one all-reduce (ranks receive a signal at slightly different times and must stop at the
same step), write a checkpoint and stop; the CLI exits with 128 + the signal's number, the code a
shell reports for a process that signal ended, so Slurm, `timeout` and the grid see an unfinished
run, and the same command resumes it. Megatron-LM's `--exit-signal-handler` works the same way.
Outside the training loops the signals keep their default action: the other stages write their
outputs atomically and start over when interrupted.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Sequence

_ACTIVE: "ExitSignals | None" = None


def signal_numbers(names: Sequence[str]) -> list[int]:
    """['SIGTERM', 'USR1'] -> their numbers; ValueError naming the valid choices for an unknown one."""
    known = {s.name: s for s in signal.Signals}
    out = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in known or full in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{name!r} is not a signal a process can handle; use e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT")
        out.append(int(known[full]))
    return out


class ExitSignals:
    """Context manager: while active, the signals in `names` set `received` instead of ending the
    process (handlers only in the main thread; the previous ones are restored on exit)."""

    def __init__(self, names: Sequence[str] = ()):
        self.signums = signal_numbers(names)
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._outer: ExitSignals | None = None

    def __enter__(self) -> "ExitSignals":
        global _ACTIVE
        if threading.current_thread() is threading.main_thread():
            for signum in self.signums:
                self._previous[signum] = signal.signal(signum, self._handle)
        self._outer, _ACTIVE = _ACTIVE, self  # nested (a grid running a pipeline in its process): restored on exit
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        _ACTIVE, self._outer = self._outer, None

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
        if self._outer is not None:  # the enclosing loop (a grid's) stops after this one, too
            self._outer._handle(signum, frame)

    def agreed(self, device: Any = "cpu") -> int | None:
        """The signal received by any rank, or None: the same answer on every rank (collective over
        the world group when one with several ranks exists; `device`: where NCCL reduces)."""
        import torch  # here: the config checks import this module, and they run without torch
        import torch.distributed as dist

        local = self.received or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([local], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        if local and self.received is None:
            self.received = local  # another rank's signal: this rank stops for it too
        return local or None


def active() -> ExitSignals | None:
    """The innermost ExitSignals in force, if any."""
    return _ACTIVE


def stop_requested(device: Any = "cpu") -> int | None:
    """The signal that asks the running training stage to stop (agreed by every rank), or None when
    none was received or no `ExitSignals` is active. Collective while one is active: every rank of
    a training loop calls it at every step."""
    return None if _ACTIVE is None else _ACTIVE.agreed(device)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
