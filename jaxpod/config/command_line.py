"""The KEY=VALUE overrides of a command line, each key once: a key given twice is refused, as
a key given twice in a YAML mapping is (`jaxpod.config.safe_yaml`), since the last would win
silently. The library's own override lists may repeat a key to replace it (`load_config`
applies them in order); a user's may not. Jax-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpod.config.fields import fail


def _shown(text: str) -> str:
    """`repr(text)`, cut to a readable length (a message never prints an unbounded value)."""
    shown = repr(text)
    return shown if len(shown) <= 60 else shown[:45] + "..." + shown[-12:]


def check_once(overrides: Sequence[str]) -> None:
    """One-line `ConfigError` naming a key that `overrides` give twice, and both spellings."""
    seen: dict[str, str] = {}
    for text in overrides:
        key = text.partition("=")[0].strip()
        if key in seen:
            twice = f"{_shown(seen[key])} and {_shown(text)}"
            fail(
                f"key '{_shown(key)[1:-1]}' is given twice on the command line ({twice}); keep one"
            )
        seen[key] = text
