"""The multi-device checks of CurrentScaling across devices in JAX (tests/jax/test_jax_current_distributed.py),
in a process of its own (the flag must be set before jax is imported):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/run/jax_current_multidevice.py OUT.json

fp8_dot and fp8_mlp (LayerNorm fused) with CurrentScaling and ``axis_name`` under ``shard_map``,
the batch split over 4 CPU devices, forward and backward:

  equal      the outputs, the input gradients and the new metas (every device's) equal the
             unsharded run on the whole batch bitwise: every quantization cast with the scale of
             the global amax
  nan        a NaN in one device's rows: after the step's close, an overflow on every device, and
             every device's state identical
  one_reduce the compiled HLO of forward + backward holds exactly one all-reduce per tensor group:
             fp8_dot 2 ((x, w), dy), fp8_mlp 4 ((LayerNorm(x), w1), (gelu(z), w2), dy, the gelu
             gradient); none without axis_name

Writes one verdict per case ('ok' or the traceback) as JSON.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

CASES = ("equal", "nan", "one_reduce")
N_DEV = 4


def _setup(nan: bool = False):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import fusedfp8
    from fusedfp8.jax import functional as F
    from fusedfp8.jax import meta as JM

    recipe = fusedfp8.CurrentScaling(margin=1)
    rng = np.random.default_rng(0)
    rows = 8
    scale = np.repeat(2.0 ** np.array([-1, 2, 0, 1]), rows)[:, None]  # the max comes from device 1
    x = (rng.standard_normal((N_DEV * rows, 32)) * scale).astype(np.float32)
    if nan:
        x[rows + 3, 5] = np.nan
    w1, w2 = (rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((32, 64), (64, 32)))
    b1, b2, lw, lb = (rng.standard_normal(n).astype(np.float32) * 0.1 for n in (64, 32, 32, 32))
    params = tuple(map(jnp.asarray, (w1, b1, w2, b2, lw, lb)))
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def mlp_loss(x, m1, m2, p, axis):
        w1, b1, w2, b2, lw, lb = p
        y, n1, n2 = F.fp8_mlp_use(x, w1, b1, w2, b2, m1, m2, recipe, axis_name=axis, ln_weight=lw, ln_bias=lb,
                                  ln_eps=1e-5)
        return jnp.sum(y ** 2), y

    def dot_loss(x, m, p, axis):
        y, _ = F.fp8_dot_use(x, p[0], m, recipe, axis_name=axis)
        return jnp.sum(y ** 2), y

    def mlp_step(x, m1, m2, p, axis=None):
        (dx, n1, n2), y = jax.grad(mlp_loss, argnums=(0, 1, 2), has_aux=True)(x, m1, m2, p, axis)
        return y, dx, n1, n2

    def dot_step(x, m, p, axis=None):
        (dx, n), y = jax.grad(dot_loss, argnums=(0, 1), has_aux=True)(x, m, p, axis)
        return y, dx, n

    def sharded(step, n_meta, axis="d"):
        def local(x, *ms):
            metas = [tuple(a[0] for a in m) for m in ms]
            out = step(x, *metas, params, axis)
            return (*out[:2], *(tuple(a[None] for a in m) for m in out[2:]))
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"),) * (1 + n_meta),
                                     out_specs=(P("d"),) * (2 + n_meta)))

    def stacked(meta):
        return tuple(jnp.stack([a] * N_DEV) for a in meta)

    return dict(jax=jax, jnp=jnp, np=np, F=F, JM=JM, recipe=recipe, x=jnp.asarray(x), params=params,
                mlp_step=mlp_step, dot_step=dot_step, sharded=sharded, stacked=stacked,
                fresh=lambda: JM.fresh_meta(recipe), mesh=mesh, P=P)


def _same(a, b, what):
    import numpy as np
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
        f"{what}: {a} vs {b}"


_COMPILED: dict = {}


def _compiled(s, name: str, axis="d"):
    """The sharded step ``name`` ('mlp' or 'dot') compiled once for every case: (executable, HLO text)."""
    key = (name, axis)
    if key not in _COMPILED:
        fresh, stacked = s["fresh"], s["stacked"]
        metas = (stacked(fresh()),) * (2 if name == "mlp" else 1)
        c = s["sharded"](s[f"{name}_step"], len(metas), axis).lower(s["x"], *metas).compile()
        _COMPILED[key] = (c, c.as_text())
    return _COMPILED[key]


def _case_equal():
    s = _setup()
    jax, np = s["jax"], s["np"]
    fresh, stacked, x, p = s["fresh"], s["stacked"], s["x"], s["params"]
    want = jax.jit(s["mlp_step"])(x, fresh(), fresh(), p)
    got = _compiled(s, "mlp")[0](x, stacked(fresh()), stacked(fresh()))
    _same(got[0], want[0], "mlp y")
    _same(got[1], want[1], "mlp dx")
    for k in (2, 3):
        for f, (g, w) in enumerate(zip(got[k], want[k])):
            for d in range(N_DEV):
                _same(g[d], w, f"mlp meta{k - 1} field {f} device {d}")
    want = jax.jit(s["dot_step"])(x, fresh(), p)
    got = _compiled(s, "dot")[0](x, stacked(fresh()))
    _same(got[0], want[0], "dot y")
    _same(got[1], want[1], "dot dx")
    for f, (g, w) in enumerate(zip(got[2], want[2])):
        for d in range(N_DEV):
            _same(g[d], w, f"dot meta field {f} device {d}")
    # every device staged the global amax of x (device 1's), not its own
    staged = np.asarray(got[2][0])[:, 0, 0]
    xs = np.abs(np.asarray(x)).reshape(N_DEV, -1).max(axis=1)
    assert (staged == xs.max()).all() and (xs < xs.max()).sum() == N_DEV - 1, (staged, xs)


def _case_nan():
    s = _setup(nan=True)
    np, JM = s["np"], s["JM"]
    from fusedfp8.jax import primitives as FP
    got = _compiled(s, "mlp")[0](s["x"], s["stacked"](s["fresh"]()), s["stacked"](s["fresh"]()))
    for k in (2, 3):
        closed = [FP.update_scales(JM.meta_to_state(JM.decode(tuple(a[d] for a in got[k]))), s["recipe"])
                  for d in range(N_DEV)]
        for d in range(N_DEV):
            for f in ("amax_history", "scale", "scale_inv", "overflows", "updates"):
                _same(getattr(closed[d], f), getattr(closed[0], f), f"meta{k - 1} {f} device {d}")
        assert int(closed[0].overflows[0]) == 1, closed[0].overflows  # the layer's input saw the NaN
        assert np.isfinite(np.asarray(closed[0].scale)).all()


def _count_all_reduce(hlo: str) -> int:
    return len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))


def _case_one_reduce():
    s = _setup()
    counts = {(name, axis): _count_all_reduce(_compiled(s, name, axis)[1])
              for name, axis in (("mlp", "d"), ("dot", "d"), ("dot", None))}
    # fwd + bwd: fp8_mlp (LayerNorm(x), w1), (gelu(z), w2), dy, dgelu; fp8_dot (x, w), dy
    assert counts == {("mlp", "d"): 4, ("dot", "d"): 2, ("dot", None): 0}, counts


def main(out_path: str) -> None:
    from jax_multidevice import run_cases  # (tests/run/, this script's folder, is on sys.path)

    run_cases(CASES, globals(), out_path)


if __name__ == "__main__":
    main(sys.argv[1])
