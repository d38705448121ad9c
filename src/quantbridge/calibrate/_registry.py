"""The registry of calibration methods: method name -> observer class, and the factory.

``@register_observer("minmax")`` on an ``Observer`` subclass makes it reachable as
``make_observer("minmax", granularity, **options)``. A recipe names the method as a string, so
this table is the one place where names meet classes. An unknown name is a ``ValueError`` that
lists the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from quantbridge.numerics import PerChannel, PerTensor

from ._base import Observer

_OBSERVERS: dict[str, type[Observer]] = {}

ObserverT = TypeVar("ObserverT", bound=type[Observer])


def register_observer(method: str) -> Callable[[ObserverT], ObserverT]:
    """Class decorator: register an ``Observer`` subclass under ``method`` (a unique name)."""

    def decorate(cls: ObserverT) -> ObserverT:
        if not (isinstance(cls, type) and issubclass(cls, Observer)):
            raise TypeError(f"@register_observer({method!r}) needs an Observer subclass")
        if method in _OBSERVERS and _OBSERVERS[method] is not cls:
            raise ValueError(
                f"calibration method {method!r} is already registered to "
                f"{_OBSERVERS[method].__name__}"
            )
        cls.method = method
        _OBSERVERS[method] = cls
        return cls

    return decorate


def registered_methods() -> tuple[str, ...]:
    """The registered method names, sorted."""
    return tuple(sorted(_OBSERVERS))


def observer_class(method: str) -> type[Observer]:
    """The class registered under ``method``; ValueError listing the names if there is none."""
    try:
        return _OBSERVERS[method]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown calibration method {method!r}; registered methods: "
            f"{', '.join(registered_methods())}"
        ) from None


def make_observer(
    method: str, granularity: PerTensor | PerChannel | None = None, **options: Any
) -> Observer:
    """A fresh observer of the registered ``method`` (options go to its constructor)."""
    return observer_class(method)(granularity, **options)
