"""A layer's backward split in two (ZB-H1's B and W): the input gradients now, the weight
gradients later from what B saved, without running the input-gradient chain again.

`LayerSplit` reads the layer's jaxpr once and sorts its equations:

    weight side   the parameters and what is computed from them alone (cast, RTS
                  all-gather, reshape; an activation-derived scalar such as `depend_on`'s
                  zero is allowed): recomputed by W
    uses          an equation taking a weight-side value and an activation (a matmul, a
                  norm's scale, a bias add): where a weight meets the data

`probed(x, p, probes)` runs the layer with a zero `probe` added to each use's output and
returns, beside the output, the activation operands of the weight side and the uses
(`saved`). B takes the vjp with respect to the input and the probes: the probes'
cotangents are the cotangents at every use's output, the input-gradient chain computed
once. W (`weight_grads`) takes the vjp of the uses alone with respect to the parameters, at
the saved operands and those cotangents: for a matmul `x @ w`, `x.T @ dy`, one forward's
worth; the uses' primal outputs are dead code there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Literal

from jaxpod.parallel.manual import vary_like

SAVED = "weight_split"  # what B keeps for W, and the uses' outputs: saved, not recomputed
# uses whose weight gradient does not read their data operand (a bias added)
UNREAD = ("add", "sub", "add_any")


class LayerSplit:
    """`layer(x, p) -> y` sorted once, at `x` (an array) and one layer's params `p`."""

    def __init__(self, layer: Callable, x: jax.Array, p):
        leaves, self.treedef = jax.tree.flatten(p)
        closed = jax.make_jaxpr(lambda x, *leaves: layer(x, self.treedef.unflatten(leaves)))(
            x, *leaves
        )
        jaxpr = closed.jaxpr
        self.jaxpr, self.consts = jaxpr, dict(zip(jaxpr.constvars, closed.consts, strict=True))
        self.x_var, self.p_vars = jaxpr.invars[0], jaxpr.invars[1:]
        weight = set(self.p_vars)
        self.side: list[int] = []  # equations of the weight side, in order
        self.uses: list[int] = []  # equations where a weight meets the data, in order
        saved: dict = {}
        unread: dict = {}
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [v for v in eqn.invars if not isinstance(v, Literal) and v not in self.consts]
            if not any(v in weight for v in ins):
                continue
            data = [v for v in ins if v not in weight]
            if all(np.prod(v.aval.shape) <= 1 for v in data):
                self.side.append(i)
                weight.update(eqn.outvars)
            else:
                self.uses.append(i)
            if eqn.primitive.name not in UNREAD:
                saved.update((v, None) for v in data)
            else:  # a sum's weight gradient is its cotangent: the data operand is not read
                unread.update((v, None) for v in data if v not in saved)
        if any(v in weight for v in jaxpr.outvars if not isinstance(v, Literal)):
            raise ValueError("a layer output computed from its weights alone cannot be split")
        self.saved = list(saved)
        self.unread = [v for v in unread if v not in saved]
        outs = [v for i in self.uses for v in jaxpr.eqns[i].outvars]
        self.outs = [v for v in outs if jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)]
        self.alias = _same_cotangent(jaxpr, self.uses, set(self.outs))
        self.probed_vars = [v for v in self.outs if v not in self.alias]

    def probe_zeros(self, like_leaves: int = 0) -> list[jax.Array]:
        """Zero probes, one per use output, with the outputs' types (`like_leaves`: a
        leading layer axis of that size, 0: none)."""
        lead = (like_leaves,) if like_leaves else ()
        return [typed_full(v.aval, lead) for v in self.probed_vars]

    def probed(self, x: jax.Array, p, probes: list[jax.Array]):
        """`(y, saved)`: the layer at `x`, `p` with `probes` added to the uses' outputs."""
        env = {**self.consts, self.x_var: x}
        env.update(zip(self.p_vars, jax.tree.leaves(p), strict=True))
        added = dict(zip(self.probed_vars, probes, strict=True))
        _run(self.jaxpr.eqns, env, added, named={*self.saved, *self.outs})
        return _read(env, self.jaxpr.outvars[0]), [env[v] for v in self.saved]

    def weight_grads(self, p, saved: list[jax.Array], cts: list[jax.Array]):
        """The layer's parameter gradients (like `p`) from `saved` and the uses' output
        cotangents `cts` (B's probe cotangents)."""
        side = [self.jaxpr.eqns[i] for i in self.side]
        uses = [self.jaxpr.eqns[i] for i in self.uses]

        def uses_of(p):  # each use from its saved operands: no use feeds another here
            env = {**self.consts, **dict(zip(self.saved, saved, strict=True))}
            env.update((v, typed_full(v.aval, ())) for v in self.unread)  # dead code
            env.update(zip(self.p_vars, jax.tree.leaves(p), strict=True))
            _run(side, env, {})
            outs: dict = {}
            _run(uses, env, {}, into=outs)
            return [outs[v] for v in self.outs]

        ct_of = dict(zip(self.probed_vars, cts, strict=True))
        _, vjp = jax.vjp(uses_of, p)
        return vjp([ct_of[self.alias.get(v, v)] for v in self.outs])[0]


def _same_cotangent(jaxpr, uses: list[int], outs: set) -> dict:
    """`{v: w}`: the use outputs `v` whose cotangent is use output `w`'s, `v` read only by
    the sum (`UNREAD`) that makes `w` (a matmul's output and its bias added): one probe."""
    readers: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, Literal):
                readers[v] = readers.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            readers[v] = readers.get(v, 0) + 1
    alias = {}
    for i in uses:
        eqn = jaxpr.eqns[i]
        if eqn.primitive.name in ("add", "add_any") and eqn.outvars[0] in outs:
            for v in eqn.invars:
                if v in outs and readers.get(v) == 1:
                    alias[v] = eqn.outvars[0]
    for v in alias:  # a chain of sums: the last one's
        while alias[v] in alias:
            alias[v] = alias[alias[v]]
    return alias


def typed_full(aval, lead: tuple, value: float = 0.0) -> jax.Array:
    """`value` in `aval`'s shape and dtype (after `lead`), varying over its manual axes."""
    full = jax.numpy.full((*lead, *aval.shape), value, aval.dtype)
    manual = aval.manual_axis_type
    varying = () if manual is None else tuple(sorted(manual.varying))
    return jax.lax.pcast(full, varying, to="varying") if varying else full


def _read(env: dict, v):
    return v.val if isinstance(v, Literal) else env[v]


def _run(eqns, env: dict, added: dict, into: dict | None = None, named=frozenset()) -> None:
    """Evaluate `eqns` reading `env` (`jax.core.eval_jaxpr`'s loop), their outputs written
    to `into` (default `env`), `added[v]` added to each output `v` it names, the outputs in
    `named` tagged `SAVED` for the remat policy."""
    into = env if into is None else into
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for v, out in zip(eqn.outvars, outs, strict=True):
            out = out + added[v] if v in added else out
            into[v] = checkpoint_name(out, SAVED) if v in named else out


def slot_of(held, slot: jax.Array):
    """Slot `slot` of B's buffers `held` (leaves `[slots, ...]`)."""
    return jax.tree.map(lambda b: b[slot], held)


def no_slot(held):
    """Zeros in one slot's types of B's buffers `held`: what a tick's op other than B
    returns for them (`put_slot` writes nothing then)."""
    return jax.tree.map(lambda b: vary_like(jax.numpy.zeros(b.shape[1:], b.dtype), b), held)


def put_slot(held, slot: jax.Array, values, when: jax.Array):
    """`held` with one slot's `values` written into `slot` where `when` (B ran this tick),
    after the tick's `lax.switch`. The switch's branches read the buffers and return only
    the slot's values, so XLA updates the scan's carry in place: a switch that returned the
    buffers updated would hold them twice (the carry, and the copy its branches write). The
    write goes out of bounds (dropped) where not `when`: no read of the slot to write back."""
    put = lambda b, v: b.at[jax.numpy.where(when, slot, len(b))].set(v, mode="drop")  # noqa: E731
    return jax.tree.map(put, held, values)


class StageSplit:
    """A stage's layers for B and W: `layer(x, p_l) -> y` one layer, `stack_of(p, r)` the
    `[L_r, ...]` layer params of this stage's chunk r, a function of the whole params (its
    vjp puts W's gradients back into their tree). `prepare(params, x)` sorts the layer
    (`LayerSplit`) at an activation `x` before the ticks; then `forward` is the stage with
    probes under the remat policy (`remat_fn`), B's function, and `weights` is W."""

    def __init__(self, layer: Callable, stack_of: Callable, remat_fn: Callable, unroll: bool):
        self.layer, self.stack_of, self.remat_fn, self.unroll = layer, stack_of, remat_fn, unroll
        self.split: LayerSplit | None = None
        self.layers = 0

    def prepare(self, params, x: jax.Array) -> None:
        stacked = self.stack_of(params, 0)
        self.layers = jax.tree.leaves(stacked)[0].shape[0]
        self.split = LayerSplit(self.layer, x, jax.tree.map(lambda a: a[0], stacked))

    def held(self, slots: int, fill: float, like: jax.Array):
        """B's buffer for `slots` micro-batches: `(saved, cts)` lists of `[slots, L, ...]`,
        varying like `like` too (a slot index traced from the table varies like it)."""
        lead = (slots, self.layers)
        full = lambda v: vary_like(typed_full(v.aval, lead, fill), like)  # noqa: E731
        return [full(v) for v in self.split.saved], [full(v) for v in self.split.probed_vars]

    def probes(self) -> list[jax.Array]:
        return self.split.probe_zeros(self.layers)

    def forward(self, p, x: jax.Array, probes: list[jax.Array], r=0):
        """`(y, saved)`: chunk r's layers over `x` with `probes` (`[L, ...]` each), and each
        layer's saved operands (`[L, ...]` each)."""
        body = self.remat_fn(lambda x, pz: self.split.probed(x, *pz))
        return jax.lax.scan(body, x, (self.stack_of(p, r), probes), unroll=self.unroll)

    def weights(self, p, saved: list[jax.Array], cts: list[jax.Array], r=0):
        """The parameter gradients (like `p`) of chunk r's layers from B's `saved` and `cts`
        (`[L, ...]` each): a scan of each layer's `weight_grads`."""
        stacked, put_back = jax.vjp(lambda p: self.stack_of(p, r), p)

        def one(_, layer):
            return None, self.split.weight_grads(*layer)

        _, grads = jax.lax.scan(one, None, (stacked, saved, cts), unroll=self.unroll)
        return put_back(grads)[0]
