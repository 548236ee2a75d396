"""The surface shared by the loopback servers used in tests and the demo."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import TypeVar

HOST = "127.0.0.1"
_S = TypeVar("_S", bound="LoopbackService")


class LoopbackService(abc.ABC):
    """A server on 127.0.0.1 (or ``_host``): ``port``/``endpoint_url`` once started; a
    context manager.

    Subclasses set ``self._port`` when listening and implement ``start``/``stop``.
    """

    _port: int | None = None
    _host: str = HOST

    @abc.abstractmethod
    def start(self: _S) -> _S:
        """Start listening and return self once ready."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop and release every socket and thread (idempotent)."""

    @property
    def port(self) -> int:
        """The listening port (only valid once started)."""
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__} is not running; call start() first")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` (or the address it listens on)."""
        return f"http://{self._host}:{self.port}"

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
