"""Float16 weights updated with round-to-nearest and with stochastic rounding
(`jaxpod.optim.precision.stochastic_round`): the rounding error, and the stall.

A float16 weight at 1.0 has an ulp of 2**-10. An update of a tenth of an ulp rounds away to
nothing with round-to-nearest, every time: the weight never moves. Stochastic rounding
rounds up or down with the probabilities that make the expected result exact, so the weight
follows the float32 trajectory on average.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpod.optim.precision import stochastic_round

ULP = 2.0**-10  # float16 spacing in [1, 2)


def rounding_errors(n: int = 200_000, seed: int = 1) -> dict[str, np.ndarray]:
    """Rounding error, in ulps, of `n` float32 values in [1, 1 + 4 ulp) rounded to float16."""
    xs = 1.0 + jax.random.uniform(jax.random.key(seed), (n,), maxval=4.0) * ULP
    nearest = xs.astype(jnp.float16).astype(jnp.float32)
    stoch = stochastic_round(xs, jax.random.key(seed + 1), jnp.float16).astype(jnp.float32)
    return {
        "round to nearest": np.asarray(nearest - xs) / ULP,
        "stochastic": np.asarray(stoch - xs) / ULP,
    }


def stall(steps: int = 1000, delta: float = -1e-4, seed: int = 3) -> dict[str, np.ndarray]:
    """A weight at 1.0 after each of `steps` updates of `delta`, in float32 and in float16
    with either rounding (one `lax.scan`, seeded: the same curve every time)."""

    def step(w, key):
        f32, near, sr = w
        f32 = f32 + delta
        near = (near.astype(jnp.float32) + delta).astype(jnp.float16)
        sr = stochastic_round(sr.astype(jnp.float32) + delta, key, jnp.float16)
        return (f32, near, sr), (f32, near, sr)

    keys = jax.random.split(jax.random.key(seed), steps)
    init = (jnp.float32(1.0), jnp.float16(1.0), jnp.float16(1.0))
    _, (f32, near, sr) = jax.jit(lambda k: jax.lax.scan(step, init, k))(keys)
    names = ("float32", "float16, round to nearest", "float16, stochastic rounding")
    return {n: np.asarray(v, np.float64) for n, v in zip(names, (f32, near, sr), strict=True)}


def draw_errors(ax, errors: dict[str, np.ndarray]) -> None:
    """Histogram of each rounding's error; the mean error in the legend."""
    bins = np.linspace(-1, 1, 41)
    for name, err in errors.items():
        ax.hist(err, bins=bins, histtype="step", lw=1.5, label=f"{name}: mean {err.mean():+.4f}")
    ax.set(
        xlabel="rounding error (ulp)",
        ylabel="values",
        title=f"{len(next(iter(errors.values()))):,} values in [1, 1 + 4 ulp) to float16",
    )
    ax.legend(fontsize=8, loc="lower center")


def draw_stall(ax, trajectories: dict[str, np.ndarray], delta: float = -1e-4) -> None:
    """The weight after each update, for every rounding of `stall`."""
    styles = {
        "float32": ("k", "--"),
        "float16, round to nearest": ("C3", "-"),
        "float16, stochastic rounding": ("C0", "-"),
    }
    for name, w in trajectories.items():
        colour, ls = styles.get(name, (None, "-"))
        ax.plot(np.arange(1, len(w) + 1), w, ls, color=colour, lw=1.5, label=name)
    steps = len(next(iter(trajectories.values())))
    ax.set(
        xlabel="update",
        ylabel="weight",
        title=f"{steps} updates of {delta:g} (0.1 ulp) to a weight at 1.0",
    )
    ax.legend(fontsize=8)
