"""Finding a backend by name: the ``kubeproxy.backends`` entry points, the one way.

Our binaries (:mod:`kubeproxy.cmd.modes`), the flow-case kit (``--backend NAME``) and the
benchmarks all look a backend up here, so ours (``nftables``, ``iptables``, ``ipvs``,
registered in our ``pyproject.toml``) and anyone else's (registered in theirs) are found
alike. The core imports no backend: it reads entry points, and loads the one asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, cast

from kubeproxy.backend import BackendFactory

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "BACKEND_GROUP",
    "BackendNotFound",
    "backend_entry_point",
    "installed_backends",
    "load_backend",
]

BACKEND_GROUP: Final = "kubeproxy.backends"
"""The entry-point group a backend factory registers under (``name = "module:factory"``)."""


class BackendNotFound(LookupError):
    """No backend of that name is installed, or its entry point does not load."""


def _entry_points() -> tuple[EntryPoint, ...]:
    # Imported here: importlib.metadata costs a noticeable part of a second to import.
    from importlib.metadata import entry_points

    return tuple(entry_points(group=BACKEND_GROUP))


def installed_backends() -> list[str]:
    """The names of the installed backends, sorted."""
    return sorted({entry.name for entry in _entry_points()})


def backend_entry_point(name: str) -> EntryPoint:
    """The entry point of the backend called ``name``; :class:`BackendNotFound` naming the
    installed backends when there is none."""
    found = _entry_points()
    for entry in found:
        if entry.name == name:
            return entry
    installed = ", ".join(sorted({entry.name for entry in found})) or "none"
    raise BackendNotFound(
        f"no backend {name!r} is installed (installed backends: {installed}; a backend "
        f'registers in the "{BACKEND_GROUP}" entry-point group)'
    )


def load_backend(name: str) -> BackendFactory:
    """The factory of the backend called ``name``: :class:`BackendNotFound` when none is
    installed; an :class:`ImportError` of its own (a missing extra, say) as it is."""
    entry = backend_entry_point(name)
    try:
        return cast(BackendFactory, entry.load())
    except ImportError:
        raise
    except Exception as err:  # whatever importing a third party's module raises
        raise BackendNotFound(f"backend {name!r} ({entry.value}) failed to load: {err}") from err
