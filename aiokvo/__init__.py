"""aiokvo: asyncio-first offloading of LLM KV-cache blocks between GPU and CPU memory.

Every public name is importable from here. The names are listed once, as
imports in ``__init__.pyi`` (which type checkers read), and resolved lazily
(PEP 562), so that ``import aiokvo.manager`` -- the pure, synchronous core --
pulls in neither asyncio, torch nor CUDA; only the names you touch load
their layer.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def _read_exports() -> dict[str, tuple[str, str]]:
    """``{public name: (module, attribute)}`` from the imports in ``__init__.pyi``."""
    stub = ast.parse(Path(__file__).with_name("__init__.pyi").read_text(encoding="utf-8"))
    exports: dict[str, tuple[str, str]] = {}
    for node in stub.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                exports[alias.asname or alias.name] = (node.module, alias.name)
    return exports


_EXPORTS = _read_exports()

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'aiokvo' has no attribute {name!r}")
    module, attribute = target
    if module == __name__:  # a submodule, e.g. aiokvo.errors
        value: Any = importlib.import_module(f"{__name__}.{attribute}")
    else:
        value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
