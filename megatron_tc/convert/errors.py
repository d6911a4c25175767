"""Errors raised by the converters: bad input, detected before anything is written."""
from __future__ import annotations


class ConversionError(ValueError):
    """The input cannot be converted as asked (unsupported model, TP/PP that does not fit, ...)."""


class CheckpointError(RuntimeError):
    """A megatron_tc checkpoint directory is missing, incomplete or corrupted."""
