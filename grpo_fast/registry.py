"""A table of named entries that grows by registration: the loss types (`loss_types.py`), the rollout
modes (`modes/`). One place says what registering twice and an unknown name do."""

from __future__ import annotations


class Registry(dict):
    """name -> entry (anything with a `name`), in registration order. `option` is the config field that
    names an entry, for the error of an unknown name."""

    def __init__(self, option: str):
        super().__init__()
        self.option = option

    def register(self, entry):
        if entry.name in self:
            raise ValueError(f"{self.option} {entry.name!r} is registered already")
        self[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self.pop(name, None)

    def lookup(self, name: str):
        """The entry of `name`; an unknown name raises naming the known ones."""
        try:
            return self[name]
        except (KeyError, TypeError):  # (TypeError: an unhashable value)
            raise ValueError(f"{self.option}={name!r} is not supported; expected one of {list(self)}") from None
