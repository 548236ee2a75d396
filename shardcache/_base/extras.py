"""Optional parts: what each extra installs, and the MissingExtraError when one is absent.

A part that needs an extra calls :func:`require_extras` before importing it, so a user
without the extra gets ``pip install 'shardcache[NAME]'`` instead of a bare
``ModuleNotFoundError``. Only a module that is not installed at all counts as missing: an
installed module that fails to import raises its own error, which says what is broken.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from typing import Any

from .errors import MissingExtraError

# extra -> the top-level modules shardcache imports from it
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    # moto's server (python -m moto.server) needs its "server" extra, flask and flask_cors.
    "testing": ("moto", "flask", "flask_cors", "boto3"),
    "prometheus": ("prometheus_client",),
    "gcs": ("gcsfs",),
    "azure": ("adlfs",),
    "plot": ("matplotlib",),
}


def installed(module: str) -> bool:
    """Whether the top-level ``module`` can be imported (imports nothing; a ``None`` in
    ``sys.modules`` counts as absent, as ``import`` treats it)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def missing_extras(what: str, *extras: str) -> MissingExtraError | None:
    """The :class:`MissingExtraError` for ``what`` if a module of one of ``extras`` is not
    installed, else None. Its message names the missing modules and gives one ``pip
    install`` for every missing extra (``exc.extra``: the names between the brackets)."""
    absent = {extra: [m for m in EXTRA_MODULES[extra] if not installed(m)] for extra in extras}
    missing = [extra for extra, modules in absent.items() if modules]
    if not missing:
        return None
    modules = [m for extra in missing for m in absent[extra]]
    names = ",".join(missing)
    return MissingExtraError(
        f"{what} needs {', '.join(modules)}, which {'is' if len(modules) == 1 else 'are'} "
        f"not installed: pip install 'shardcache[{names}]'",
        extra=names,
        modules=modules,
    )


def require_extras(what: str, *extras: str) -> None:
    """Raise :func:`missing_extras`' error, if any."""
    error = missing_extras(what, *extras)
    if error is not None:
        raise error


class _Unavailable(type):
    """The type of a stand-in for a public class whose extra is not installed: making an
    instance, or reading an attribute the class would have, raises MissingExtraError."""

    _error: MissingExtraError

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise copy.copy(cls._error)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise copy.copy(cls._error)


def stand_in(name: str, error: MissingExtraError) -> type:
    """A class ``shardcache.<name>`` that raises ``error`` when used: ``shardcache`` exports
    it in place of a class whose extra is not installed, so importing names from the
    package never fails and using one says what to install."""
    return _Unavailable(
        name,
        (),
        {
            "__module__": "shardcache",
            "__qualname__": name,
            "__doc__": f"Unavailable: {error}",
            "_error": error,
        },
    )
