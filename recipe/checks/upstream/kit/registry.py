"""The checker's registry type: library name -> `Library`, filled by one explicit line per
plugin in `recipe/checks/upstream/registry.py`. A name registered twice is refused at import, so
two plugins can never shadow each other silently."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from recipe.upstream.releases import Library


class DuplicateLibrary(ValueError):
    pass


class Registry(Mapping):
    """An ordered, append-only mapping of library names to their `Library` (the `--all` table's
    order is the order of registration)."""

    def __init__(self) -> None:
        self._libraries: dict[str, Library] = {}

    def register(self, name: str, library: Library) -> None:
        if not isinstance(library, Library):
            raise TypeError(f"{name}: register a Library, got {type(library).__name__}")
        if name in self._libraries:
            raise DuplicateLibrary(
                f"library {name!r} is registered twice (a plugin's name must be unique)"
            )
        self._libraries[name] = library

    def __getitem__(self, name: str) -> Library:
        return self._libraries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._libraries)

    def __len__(self) -> int:
        return len(self._libraries)
