"""Shared helpers of the kernel tests."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def count_calls(targets: list[tuple[Any, str]], patch: Callable[[Any, str, Any], None] = setattr) -> dict[str, int]:
    """Wrap each module.name so its calls are counted (the real function still runs).

    Pass `monkeypatch.setattr` as `patch` to have the wrappers removed after a test.
    """
    calls: dict[str, int] = {}
    for module, name in targets:
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)
        patch(module, name, counted)
    return calls
