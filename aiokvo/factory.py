"""Find the offloading spec a config names, importing it only when needed.

Specs are registered by name with the module and class that define them, and
nothing is imported at registration: a spec that is never chosen costs no
import (and none of its heavy dependencies). A name that is not registered is
looked up as ``config.spec_name`` inside ``config.spec_module_path``, which is
how out-of-tree specs are used without registering them.
"""

from __future__ import annotations

import importlib
import inspect
from typing import ClassVar

from aiokvo.config import OffloadConfig
from aiokvo.errors import SpecLoadError
from aiokvo.offloading_spec import OffloadingSpec

__all__ = ["OffloadingSpecFactory"]


class OffloadingSpecFactory:
    """Registry of offloading specs by name, loaded lazily.

    The registry lives on the class. A subclass starts with a copy of its
    parent's registry and changes only its own, which gives tests (or an
    embedding engine) an isolated registry: ``class MyFactory(OffloadingSpecFactory): ...``.
    """

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._registry = dict(cls._registry)

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Make ``name`` resolve to ``module_path.class_name``; imports nothing now."""
        for field, value in (
            ("name", name),
            ("module_path", module_path),
            ("class_name", class_name),
        ):
            if not isinstance(value, str) or not value:
                raise SpecLoadError(f"{field} must be a non-empty string, got {value!r}")
        if name in cls._registry:
            module, klass = cls._registry[name]
            raise SpecLoadError(
                f"offloading spec {name!r} is already registered (as {module}.{klass})"
            )
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def unregister_spec(cls, name: str) -> None:
        """Forget ``name``; raises :class:`SpecLoadError` if it is not registered."""
        if name not in cls._registry:
            raise SpecLoadError(f"offloading spec {name!r} is not registered")
        del cls._registry[name]

    @classmethod
    def registered_specs(cls) -> dict[str, tuple[str, str]]:
        """``{name: (module_path, class_name)}``, a copy."""
        return dict(cls._registry)

    @classmethod
    def create_spec(cls, config: OffloadConfig) -> OffloadingSpec:
        """Construct the spec ``config.spec_name`` names, with ``config``.

        The registry is consulted first, then ``config.spec_module_path``.
        Every failure to find or import the class raises
        :class:`~aiokvo.errors.SpecLoadError` naming what was missing.
        """
        name = config.spec_name
        if name in cls._registry:
            module_path, class_name = cls._registry[name]
        elif config.spec_module_path is not None:
            module_path, class_name = config.spec_module_path, name
        else:
            known = ", ".join(sorted(cls._registry)) or "none"
            raise SpecLoadError(
                f"unknown offloading spec {name!r}: it is not registered "
                f"(registered: {known}) and no spec_module_path was given"
            )
        spec_cls = _load_spec_class(name, module_path, class_name)
        return spec_cls(config)


def _load_spec_class(name: str, module_path: str, class_name: str) -> type[OffloadingSpec]:
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise SpecLoadError(
            f"cannot import module {module_path!r} for offloading spec {name!r}: {exc}"
        ) from exc
    try:
        candidate = getattr(module, class_name)
    except AttributeError:
        raise SpecLoadError(
            f"module {module_path!r} has no class {class_name!r} (offloading spec {name!r})"
        ) from None
    if not isinstance(candidate, type) or not issubclass(candidate, OffloadingSpec):
        raise SpecLoadError(
            f"{module_path}.{class_name} is not an OffloadingSpec subclass "
            f"(offloading spec {name!r}), got {candidate!r}"
        )
    if inspect.isabstract(candidate):
        raise SpecLoadError(
            f"{module_path}.{class_name} is abstract and cannot be constructed "
            f"(offloading spec {name!r})"
        )
    return candidate


OffloadingSpecFactory.register_spec(
    "CPUOffloadingSpec", "aiokvo.offloading_spec", "CPUOffloadingSpec"
)
