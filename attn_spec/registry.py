"""The implementation registry both frameworks share: one entry per (variant, implementation),
the rule for implementation=None, and the checks every public function applies (framework-free;
each framework supplies its entries, its `Call` and its rule)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


class UnknownImplementationError(ValueError, NotImplementedError):
    """`implementation` names no implementation of the variant (a ValueError and a NotImplementedError)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One (variant, implementation).

    fn: runs the call (the variant's signature; see each framework's registry).
    unsupported_reason(call): why it cannot serve the call (device, dtype, head dim, features), or None.
    config_type(): its tile config class, or None for an implementation that takes none (a function,
      so that a backend's module is imported only when asked).
    default_config(call): the config a call gets when none is given.
    config_reason(config, call): why a (valid) config cannot serve the call, or None.
    """

    variant: str
    name: str
    fn: Callable
    unsupported_reason: Callable[[Any], str | None]
    config_type: Callable[[], type | None] = lambda: None
    default_config: Callable[[Any], Any] = lambda call: None
    config_reason: Callable[[Any, Any], str | None] = lambda config, call: None


class Registry(dict):
    """variant -> canonical name -> `Entry`, with the rule for None (`choose(variant, call)`) and
    accepted older spellings (`aliases`: spelling -> canonical name)."""

    def __init__(self, entries, choose: Callable[[str, Any], str], aliases: dict[str, str] | None = None):
        variants = dict.fromkeys(e.variant for e in entries)
        super().__init__({v: {e.name: e for e in entries if e.variant == v} for v in variants})
        self._choose = choose
        self.aliases = dict(aliases or {})

    def _check_variant(self, variant: str) -> None:
        if variant not in self:
            raise ValueError(f"unknown variant={variant!r}; choose one of {tuple(self)}")

    def canonical(self, variant: str, implementation) -> str:
        """The canonical name of `implementation` for `variant`, or UnknownImplementationError."""
        self._check_variant(variant)
        names = self[variant]
        name = self.aliases.get(implementation, implementation) if isinstance(implementation, str) else implementation
        if not isinstance(name, str) or name not in names:
            choices = ", ".join(repr(n) for n in names)
            spellings = ", ".join(f"{old!r} for {new!r}" for old, new in self.aliases.items() if new in names)
            also = f" (also accepted: {spellings})" if spellings else ""
            raise UnknownImplementationError(
                f"unknown implementation={implementation!r}; choose one of None, {choices}{also}")
        return name

    def choose(self, variant: str, call) -> str:
        """The canonical name implementation=None picks for `call`."""
        self._check_variant(variant)
        return self._choose(variant, call)

    def resolve(self, variant: str, implementation: str | None, call) -> Entry:
        """The entry that computes `call`: `implementation` (a canonical name or an accepted
        spelling), or the rule's choice for None. Raises UnknownImplementationError for an unknown
        name and NotImplementedError, saying why, for an implementation that cannot serve the call."""
        name = self.choose(variant, call) if implementation is None else self.canonical(variant, implementation)
        entry = self[variant][name]
        if reason := entry.unsupported_reason(call):
            raise NotImplementedError(f"implementation={name!r} cannot serve this call: {reason}")
        return entry

    @staticmethod
    def check_config(entry: Entry, config, call):
        """The tile config a call runs with: `config` validated against the entry (TypeError for the
        wrong type, ValueError if it cannot serve the call), or the entry's default for None."""
        if config is None:
            return entry.default_config(call)
        config_type = entry.config_type()
        if config_type is None:
            raise TypeError(f"implementation={entry.name!r} takes no tile config; got config={config!r} "
                            f"(pass config=None)")
        if not isinstance(config, config_type):
            raise TypeError(f"config must be a {config_type.__module__}.{config_type.__name__} for "
                            f"implementation={entry.name!r}, got {type(config).__name__}")
        if reason := entry.config_reason(config, call):
            raise ValueError(f"config={config} cannot serve this call: {reason}")
        return config
