"""Small helpers every layer shares: ``async with`` for resources, argument checks, lazy exports.

The checks exist so that every public entry point rejects bad input the
same way: with a typed :mod:`aiokvo.errors` exception that names the
argument and shows the value, before any state changes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import operator
import re
import textwrap
from collections.abc import Collection, Mapping, MutableMapping
from types import TracebackType
from typing import Any, Self, TypeVar

from aiokvo.errors import AiokvoError, ConfigError

__all__ = [
    "EXTRA_OF",
    "AsyncResource",
    "check_choice",
    "check_int",
    "check_name",
    "check_text",
    "lazy_export",
]

_T = TypeVar("_T")


class AsyncResource:
    """``async with x:`` returns ``x`` and awaits ``x.aclose()`` on the way out.

    One mixin instead of the same two methods in every resource class; it
    has no state (empty ``__slots__``), so slotted classes stay slotted.
    """

    __slots__ = ()

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def check_int(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[AiokvoError] = ConfigError,
) -> int:
    """``value`` as a plain int, or ``error`` naming ``name`` and showing the value.

    Accepts ints and integer-like objects (numpy integers); refuses ``bool``,
    floats and strings, which ``int()`` would quietly convert.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{name} must be an int{_bounds(minimum, maximum)}, got {value!r}") from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise error(f"{name} must be an int{_bounds(minimum, maximum)}, got {value!r}")
    return number


def check_choice(
    name: str, value: object, choices: Collection[_T], *, error: type[AiokvoError] = ConfigError
) -> _T:
    """``value`` if it is one of ``choices``, else ``error`` listing them."""
    try:
        if value in choices:
            return value  # type: ignore[return-value]
    except TypeError:  # unhashable, for a set of choices
        pass
    listed = ", ".join(repr(c) for c in choices)
    raise error(f"{name} must be one of {listed}, got {value!r}")


_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


def check_name(name: str, value: object, *, error: type[AiokvoError] = ConfigError) -> str:
    """``value`` if it is safe inside a file name (1-200 of ``[A-Za-z0-9._-]``, no
    leading ``.``), else ``error``: no separators, no ``..``, no hidden files."""
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    raise error(
        f"{name} must be 1-200 characters from [A-Za-z0-9._-] not starting with '.', got {value!r}"
    )


def check_text(
    name: str, value: object, *, printable: bool = False, error: type[AiokvoError] = ConfigError
) -> str:
    """``value`` if it is a string with something besides white space in it (and, with
    ``printable``, no control characters), else ``error`` naming ``name``."""
    if isinstance(value, str) and value.strip() and (not printable or value.isprintable()):
        return value
    kind = "non-empty printable string" if printable else "non-empty string"
    raise error(f"{name} must be a {kind}, got {value!r}")


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in {minimum}..{maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def lazy_export(namespace: MutableMapping[str, Any], where: Mapping[str, str], name: str) -> Any:
    """A package's PEP 562 ``__getattr__``: ``name`` from module ``where[name]``, imported now.

    Packages list heavy names (torch, asyncio, Mooncake behind them) this way
    so that importing the package's pure parts loads none of it. The value is
    cached in ``namespace`` (the package's ``globals()``), so each name
    resolves once.
    """
    module = where.get(name)
    if module is None:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        raise ModuleNotFoundError(
            f"{namespace['__name__']}.{name} needs {exc.name}, which is not installed: "
            f"pip install 'aiokvo[{extra}]'",
            name=exc.name,
        ) from exc
    value = getattr(imported, name)
    namespace[name] = value
    return value


def missing_extra(exc: ModuleNotFoundError, what: str, extra: str) -> ModuleNotFoundError:
    """The error for ``what`` importing an optional module that is not installed: it
    names the extra that installs it (raise it ``from exc``)."""
    return ModuleNotFoundError(
        f"{what} needs {exc.name}, which is not installed: pip install 'aiokvo[{extra}]'",
        name=exc.name,
    )


_FIELD_DOCS: dict[type, dict[str, str]] = {}


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings written under a (data)class's fields, by field name,
    base classes' included (a subclass's own win). Read from the source, once:
    snapshots document each field where it is declared, and exporters reuse it
    as help text rather than a second copy that would drift."""
    cached = _FIELD_DOCS.get(cls)
    if cached is not None:
        return cached
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    _FIELD_DOCS[cls] = docs
    return docs

EXTRA_OF: Mapping[str, str] = {
    "xxhash": "disk",
    "mooncake": "mooncake",
    "zmq": "kv-events",
    "msgspec": "kv-events",
    "prometheus_client": "prometheus",
    "rich": "watch",
    "pytest": "testing",
    "pytest_asyncio": "testing",
    "vllm": "vllm",
}
"""The extra (pyproject.toml) that installs each optional top-level module: a lazily
exported name whose module is missing says what to install."""
