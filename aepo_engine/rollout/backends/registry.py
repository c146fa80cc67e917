"""Generation backends by name: ``BackendConfig.kind`` names one and ``build_backend`` builds it.

A backend is registered with its builder, a function
``build(cfg, model_dir, tokenizer, *, seed, local_rank, group, lora) -> backend`` (the arguments of
``aepo_engine.rollout.backends.build_backend``) that imports the backend's module itself, so an
optional package loads only when its backend is asked for. ``hf`` and ``vllm`` are registered in
``aepo_engine/rollout/backends/__init__.py``; another backend's module registers it when imported,
which must happen before a config naming it is read (the config section checks ``kind`` here).
Standard library only: reading the config loads no torch.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

__all__ = ["BackendBuilder", "backend_builder", "backend_names", "register_backend"]

BackendBuilder = Callable[..., Any]
B = TypeVar("B", bound=BackendBuilder)

_BUILDERS: dict[str, BackendBuilder] = {}


def register_backend(name: str) -> Callable[[B], B]:
    """Decorator registering a backend's builder under ``name`` (the ``backend.kind`` that picks it).

    Raises:
        ValueError: another builder already has ``name`` (it would silently replace the backend a
            config refers to).
    """
    def decorate(build: B) -> B:
        previous = _BUILDERS.get(name)
        if previous is not None and previous is not build:
            raise ValueError(f"backend {name!r} is already registered (by {previous.__qualname__})")
        _BUILDERS[name] = build
        return build

    return decorate


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, sorted."""
    return tuple(sorted(_BUILDERS))


def backend_builder(name: str) -> BackendBuilder:
    """The builder registered under ``name``.

    Raises:
        ValueError: none is (the message lists the registered names).
    """
    try:
        return _BUILDERS[name]
    except KeyError:
        raise ValueError(f"backend kind {name!r} is not registered: expected one of "
                         f"{', '.join(map(repr, backend_names()))}") from None
