"""Run a function in N gloo (CPU) or NCCL (one GPU per rank) processes and turn any rank's failure
into a test failure.

Every parallel test goes through `run_distributed`. Each child gets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in its environment, one intra-op thread, and an initialized process
group (gloo by default; with backend="nccl" rank r uses GPU r, and NVLink multicast is switched off
in the parent's and the children's environment, see `NCCL_ENV`); the function's exception (with
its traceback) comes back to the parent, which raises one AssertionError naming every failed
rank; the child also prints it to stderr the moment it fails. A child that dies without a Python
exception (a segfault, os._exit) or hangs past `timeout` fails the test as well.

Ranks start as fresh interpreters (spawn), which import torch, DeepSpeed and megatron-core again
at every launch: seconds of CPU per rank. A test suite calls `fork_gloo_ranks_from(modules)` once;
gloo ranks then fork from one server process that imported those modules once (multiprocessing's
forkserver). NCCL ranks, and any rank where CUDA is available, still spawn: a CUDA runtime does not
survive a fork. Benchmarks that measure a fresh process's memory or time keep spawning.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


BACKENDS = ("gloo", "nccl")
# NVLink SHARP / multicast off in the NCCL tests' processes, so they run on hosts where multicast
# objects cannot be created (docs/environment.md): set before any NCCL communicator or
# symmetric-memory buffer exists, in every process.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


_FORK_FROM: list[str] = []  # modules the forkserver imports; empty: always spawn


def fork_gloo_ranks_from(*modules: str) -> None:
    """Gloo ranks of later `run_distributed` calls fork from a server that imported `modules` once
    (a module that fails to import is skipped). Each rank still gets the caller's environment as it
    is at the launch, and its own process: nothing a rank does reaches the next launch."""
    _FORK_FROM[:] = modules


def _start_method(backend: str) -> str:
    if _FORK_FROM and backend == "gloo" and not torch.cuda.is_available():
        return "forkserver"
    return "spawn"


def check_backend(backend: str, world_size: int) -> None:
    """Raise ValueError/RuntimeError, before any process starts, if `backend` cannot run `world_size` ranks."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown; use one of {BACKENDS}")
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("backend='nccl' asked for, but this torch build has no NCCL; use backend='gloo'")
        gpus = torch.cuda.device_count()
        if gpus < world_size:
            raise RuntimeError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, but "
                               f"{gpus} CUDA device(s) are visible; use fewer ranks or backend='gloo'")


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors, backend: str = "gloo",
           environ: dict[str, str] | None = None) -> None:
    if environ is not None:  # forked from the forkserver: its environment is the one of its start
        os.environ.clear()
        os.environ.update(environ)
        # the server's imports (~500k objects) stay out of this rank's garbage collections
        gc.freeze()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    faulthandler.enable()  # a rank killed by SIGABRT/SIGSEGV prints every thread's Python stack
    try:
        kwargs = {}
        if backend == "nccl":
            os.environ.update(NCCL_ENV)
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)  # binds the communicator to this GPU up front
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120), **kwargs)
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        report = traceback.format_exc()
        # also at once on stderr: a run cut by a time limit never gets to the parent's report
        print(f"--- rank {rank} raised:\n{report}", file=sys.stderr, flush=True)
        errors.put((rank, report))
        raise SystemExit(1)
    finally:
        _leave_distributed()


def _leave_distributed() -> None:
    """Release the DeepSpeed engines the function left behind, drop megatron-core's groups and the
    default group, then collect garbage, while the interpreter is whole: groups still referenced at
    interpreter finalization are torn down there, which can abort the process (SIGABRT) after the
    function has passed."""
    if "deepspeed.runtime.engine" in sys.modules:
        from megatron_tc.parallel.deepspeed_engine import live_engines, release_engine

        for engine in live_engines():
            release_engine(engine)
    if "megatron.core.parallel_state" in sys.modules:  # never imported just to be torn down
        from megatron_tc.parallel.state import destroy_parallel

        destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 300.0,
                    backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` in `world_size` spawned processes.

    backend: "gloo" (CPU) or "nccl" (rank r on GPU r; needs world_size visible GPUs, else an error
    before anything starts). `fn` and `args` must be picklable (a module-level function). Raises
    AssertionError if any rank raised, exited non-zero or did not finish within `timeout` seconds.
    """
    check_backend(backend, world_size)
    if backend == "nccl":
        os.environ.update(NCCL_ENV)  # spawned children inherit it; _child sets it again
    ctx = mp.get_context(_start_method(backend))
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(_FORK_FROM)  # read when the server starts: the first launch
    errors = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, errors, backend, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    reports = []
    while not errors.empty():
        rank, tb = errors.get()
        reports.append(f"--- rank {rank} raised:\n{tb}")
    reported = {int(line.split()[2]) for line in reports}
    for r, p in enumerate(procs):
        if r in hung:
            reports.append(f"--- rank {r} did not finish within {timeout:.0f} s (killed)")
        elif p.exitcode != 0 and r not in reported:
            reports.append(f"--- rank {r} exited with code {p.exitcode} without a Python exception")
    if reports:
        raise AssertionError(f"{len(reports)} of {world_size} ranks failed:\n" + "\n".join(reports))


def write_tiny_teacher(root, n_docs: int = 40, words_per_doc: tuple[int, int] = (50, 300),
                       initializer_range: float = 0.02):
    """root/teacher: a random 4-layer Llama (hidden 64, weights drawn with std `initializer_range`)
    saved as an HF directory with a 320-piece sentencepiece tokenizer trained on synthetic text;
    root/text: `n_docs` synthetic documents. Returns `root` (a pathlib.Path)."""
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from megatron_tc.data.synthetic import train_tiny_tokenizer, write_synthetic_corpus

    root = Path(root)
    tok = AutoTokenizer.from_pretrained(str(train_tiny_tokenizer(root / "teacher", vocab_size=320)))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         initializer_range=initializer_range)
    LlamaForCausalLM(config).save_pretrained(str(root / "teacher"))
    write_synthetic_corpus(root / "text", n_docs=n_docs, words_per_doc=words_per_doc)
    return root
