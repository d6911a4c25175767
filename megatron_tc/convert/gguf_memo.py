"""Reading one GGUF file through transformers without repeating its pure, costly set-up work.

transformers parses the whole GGUF header (every metadata field, including the tokenizer's vocabulary
and merges: hundreds of thousands of strings) once for the config, once for the weights and once for
the tokenizer, and while mapping weight names it builds gguf's `TensorNameMap` for the architecture
again for every submodule of the model (hundreds of times; each build formats the names of all
blocks). For SmolLM2-135M on one CPU core the two cost about 20 s of a 25 s read, where the
dequantisation itself (gguf's vectorised numpy) takes about 2 s.

`gguf_reading()` makes both memoised while it is open: one `GGUFReader` per file (a read-only view of
a memory map) and one `TensorNameMap` per (architecture, block count). transformers imports both
names from the `gguf` module at call time, so replacing the module attributes is enough. Nested
uses share the outer cache; the originals are restored (and the readers released) on leaving the
outermost.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

_lock = threading.Lock()
_depth = 0
_readers: dict[tuple[str, str], Any] = {}
_name_maps: dict[tuple[Any, int], Any] = {}
_originals: tuple[Any, Any] | None = None  # (GGUFReader, get_tensor_name_map) while patched


def _memo_reader(original: type):
    def reader(path: str | os.PathLike, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in _readers:
            _readers[key] = original(path, mode)
        return _readers[key]
    return reader


def _memo_name_map(original: Any):
    def name_map(arch: Any, n_blocks: int):
        key = (arch, n_blocks)
        if key not in _name_maps:
            _name_maps[key] = original(arch, n_blocks)
        return _name_maps[key]
    return name_map


@contextlib.contextmanager
def gguf_reading() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader` and `gguf.get_tensor_name_map` are memoised."""
    global _depth, _originals
    try:
        import gguf
    except ImportError:  # transformers names the missing package when it needs it
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            _originals = (gguf.GGUFReader, gguf.get_tensor_name_map)
            gguf.GGUFReader = _memo_reader(_originals[0])
            gguf.get_tensor_name_map = _memo_name_map(_originals[1])
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = _originals
                _originals = None
                _readers.clear()
                _name_maps.clear()
