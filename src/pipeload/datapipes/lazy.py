"""Lazy initialisation: heavy setup made where and when a pipe is first used, never pickled."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from pipeload.datapipes.base import TRANSIENT_PREFIX

R = TypeVar("R")


class lazy_init(Generic[R]):  # noqa: N801  (used as a decorator, like property)
    """A pipe attribute computed on first access, in the process (worker) that reads it.

    The value is cached on the pipe but never pickled or copied, so a pipe holding a model, a
    tokenizer or an open connection travels to workers as its description, and each worker (each
    thread worker's copy too) makes its own on first use.

    Example:
        >>> class Tokenize(IterDataPipe):
        ...     def __init__(self, source, vocab_path):
        ...         self.source, self.vocab_path = source, vocab_path
        ...     @lazy_init
        ...     def vocab(self):
        ...         return load_vocab(self.vocab_path)  # runs in the worker, once
        ...     def __iter__(self):
        ...         return (self.vocab.encode(text) for text in self.source)
    """

    def __init__(self, factory: Callable[[Any], R]) -> None:
        self._factory = factory
        self._key = TRANSIENT_PREFIX + "lazy_" + factory.__name__
        self._lock = threading.Lock()  # two threads reading it first make it once
        self.__doc__ = factory.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = TRANSIENT_PREFIX + "lazy_" + name

    @overload
    def __get__(self, instance: None, owner: type) -> lazy_init[R]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> R: ...

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        cache = instance.__dict__
        if self._key not in cache:
            with self._lock:
                if self._key not in cache:
                    cache[self._key] = self._factory(instance)
        return cache[self._key]

    def __set__(self, instance: Any, value: R) -> None:
        instance.__dict__[self._key] = value

    def is_ready(self, instance: Any) -> bool:
        """Whether ``instance`` has made its value already."""
        return self._key in instance.__dict__
