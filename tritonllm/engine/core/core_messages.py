"""The engine core's inbox: what other threads may ask of it. `CoreLoop` queues these and the core thread
applies them between steps (`EngineCore.apply`); nothing else changes the core."""

from __future__ import annotations

from dataclasses import dataclass

from tritonllm.engine.core.sequence import CoreRequest


@dataclass(frozen=True)
class AddRequest:
    request: CoreRequest


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request's sequences: those of `indices` (stop strings ended them), else all of them."""

    request_id: str
    indices: tuple[int, ...] | None = None


@dataclass(frozen=True)
class AbortAll:
    """Stop every request (shutdown)."""


CoreMessage = AddRequest | AbortRequest | AbortAll
