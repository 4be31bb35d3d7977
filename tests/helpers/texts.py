"""A small text corpus for the tokenized-data tests: made-up Python documents, one a file.

Seeded, so a corpus is the same in every test that writes it; jax-free.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NAMES = ["alpha", "beta", "gamma", "delta", "value", "count", "total", "index"]


def documents(n: int = 120, seed: int = 0) -> list[str]:
    """`n` small Python documents, each different: `list[str]`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (str(x) for x in rng.choice(NAMES, 2, replace=False))
        out.append(f"def {a}_{i}({b}):\n    return {b} * {i} + len({a!r})\n" * 3)
    return out


def write_corpus(root: Path, n: int = 120, seed: int = 0) -> Path:
    """`documents(n, seed)` written as `root/doc_NNN.py`, one a file; returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(documents(n, seed)):
        (root / f"doc_{i:03d}.py").write_text(text)
    return root
