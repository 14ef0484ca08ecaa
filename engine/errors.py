"""Typed errors raised by the engine. Every one leaves the engine usable."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of all errors the engine raises on bad input or exhausted resources."""


class CheckpointError(EngineError):
    """A model directory is missing, incomplete, corrupt or does not match its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture (or a feature of it) is not implemented."""


class DrafterMismatchError(CheckpointError):
    """A drafter checkpoint was trained for a different target (hidden size, vocab, depth)."""


class ContextLengthError(EngineError):
    """A prompt does not fit the model's context window."""


class KVPoolExhaustedError(EngineError):
    """The paged KV pool cannot hold a request, even after evicting every unpinned page."""


class RequestError(EngineError):
    """A request's parameters are invalid (sampling settings, ids outside the vocabulary, ...)."""
