"""The multi-device checks of tests/jax/test_jax_distributed.py, in a process of its own:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/run/jax_multidevice.py OUT.json

fusedfp8.jax on several (CPU) devices: the staged amaxes MAX-reduced over a mesh axis. (The
pytest process has imported jax with one device already; the flag must be set before jax is
imported.) Writes one verdict per case ('ok' or the traceback) as JSON.

  update     update_scales(axis_name=...) under shard_map, different staged amaxes per device:
             every device ends with the same state, bitwise the numpy reference rule applied to
             the elementwise max; a NaN / inf on one device is an overflow on all; denormal and
             not-run (0) columns; a tuple axis name over a 2x2 mesh.
  flax_step  a jitted data-parallel train step (shard_map, batch sharded over 4 devices) of Fp8MLP
             and of nn.Dense(dot_general_cls=Fp8DotGeneral): after every step the FP8 state is
             identical on every device except row 0 (each device's own staged amaxes), and equals
             the unsharded run on the full batch (same weights) bitwise, row 0 as the max over the
             devices; a NaN input row on one device is an overflow on all at the next update.
             Under first_step='current' the devices agree from the first update on (step 0's
             scales come from local amaxes), so only the agreement is checked there.
             Plain jax.jit on a sharded batch (no axis name) gives the one-device state bitwise.
  one_reduce the compiled HLO of the update, and of the fp8_mlp forward (two metas), holds
             exactly one all-reduce; none without axis_name.
"""
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

CASES = ("update", "flax_step", "one_reduce")


def _case_update():
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import fusedfp8
    from fusedfp8.jax import primitives as FP
    from fusedfp8.state import ScalingState, apply_update

    f32 = np.float32
    for shape, names, L in (((4,), ("d",), 5), ((2, 2), ("a", "b"), 31)):
        recipe = fusedfp8.DelayedScaling(amax_history_len=L)
        axis = names[0] if len(names) == 1 else names
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        rng = np.random.default_rng(L)
        n = 7
        grad = (False, True, False, True, False, False, True)
        past = rng.uniform(0.5, 300, (L - 1, n)).astype(f32)
        staged = rng.uniform(0.5, 300, (4, n)).astype(f32)  # columns 0, 1: ordinary, different per device
        staged[:, 2] = [0, 0, 7.25, 0]                   # ran on one device only
        staged[:, 3] = [0, 0, 0, 0]                      # ran nowhere: unchanged
        staged[:, 4] = [3.0, np.nan, 5.0, 1.0]           # NaN on one device: overflow on all
        staged[:, 5] = [0, 1e-40, 0, 3e-41]              # denormals (XLA:CPU's float max flushes them)
        staged[:, 6] = [2.0, 9.0, np.inf, 1.0]           # inf on one device
        scale = rng.uniform(0.5, 2, n).astype(f32)
        overflows = np.array([0, 1, 0, 2, 0, 0, 3], np.int32)
        updates = np.array([4, 4, 0, 4, 4, 4, 4], np.int32)

        def per_device(d):
            return (np.concatenate([staged[d:d + 1], past]), scale, (1 / scale).astype(f32), overflows, updates)

        stacked = tuple(np.stack(a) for a in zip(*(per_device(d) for d in range(4))))

        def local(*arrays):
            st = ScalingState(*(a[0] for a in arrays), grad)
            new = FP.update_scales(st, recipe, axis_name=axis)
            return tuple(getattr(new, f)[None] for f in ("amax_history", "scale", "scale_inv", "overflows",
                                                            "updates"))

        spec = P(axis)
        out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5))(*stacked)
        out = [np.asarray(o) for o in out]

        reduced = np.where(np.isfinite(staged), staged, np.inf).max(axis=0)
        want = ScalingState(np.concatenate([reduced[None], past]), scale.copy(), (1 / scale).astype(f32),
                            overflows.copy(), updates.copy(), grad)
        want = apply_update(want, recipe)
        for d in range(4):
            for name, got in zip(("amax_history", "scale", "scale_inv", "overflows", "updates"), out):
                w = getattr(want, name)
                assert got[d].tobytes() == np.asarray(w).tobytes(), (shape, d, name, got[d], w)
        # the update did happen, and the non-finite columns are overflows on every device
        assert not np.array_equal(out[1][0, :2], scale[:2])
        assert (out[3][:, [4, 6]] == overflows[[4, 6]] + 1).all() and (out[1][:, [4, 6]] == scale[[4, 6]]).all()
        assert (out[4][:, 5] == updates[5] + 1).all() and out[0][0, -1, 5] == np.float32(1e-40)


def _mlp_setup(first_step="unit", dense=False):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fusedfp8
    from fusedfp8.jax.flax import Fp8MLP

    recipe = fusedfp8.DelayedScaling(amax_history_len=4, first_step=first_step)
    B, H, F = 16, 16, 32
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((B, H)) * (1 + 3 * t)).astype(np.float32) for t in range(4)]
    batches[3][5, 3] = np.nan  # the last step: a non-finite input on device 1 only (rows 4..7)
    if dense:  # nn.Dense with the drop-in Fp8DotGeneral
        import functools

        import flax.linen as nn

        from fusedfp8.jax.flax import Fp8DotGeneral

        sharded = nn.Dense(F, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe, axis_name="d"))
        full = nn.Dense(F, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))
    else:
        sharded = Fp8MLP(ffn=F, recipe=recipe, axis_name="d")
        full = Fp8MLP(ffn=F, recipe=recipe)
    variables = jax.jit(full.init)(jax.random.key(0), jnp.asarray(batches[0]))  # eager init: ~100 tiny compiles
    return recipe, B, batches, sharded, full, variables


def _case_flax_step():
    _flax_step("unit")
    _flax_step("current")
    _flax_step("unit", dense=True)
    _gspmd_step()


def _gspmd_step():
    """Plain jax.jit on a batch sharded over 4 devices, no axis name: XLA makes the amaxes global
    itself; the new FP8 state equals the one-device run bitwise (first_step='current' too)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT as OWG

    recipe, B, batches, _, full, variables = _mlp_setup("current")
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def step(params, fp8, x):
        loss = lambda p, f: jnp.sum(full.apply({"params": p, OWG: f}, x) ** 2) / B  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(params, fp8)[1]

    f = jax.jit(step)
    xs = (jax.device_put(batches[0], NamedSharding(mesh, P("d"))), jax.device_put(batches[0], jax.devices()[0]))
    got, want = (f(variables["params"], variables[OWG], x) for x in xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), (g, w)


def _flax_step(first_step, dense=False):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT as OWG

    recipe, B, batches, sharded, full, variables = _mlp_setup(first_step, dense)
    layers = tuple(variables[OWG])
    assert layers == (("Fp8DotGeneral_0",) if dense else ("fc1", "fc2")), layers
    mesh = Mesh(np.array(jax.devices()), ("d",))
    lr = 0.05

    def loss(model, params, fp8, x):
        y = model.apply({"params": params, OWG: fp8}, x)
        return jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) ** 2) / B  # the same output gradient sharded or not

    def step(model, params, fp8, x):
        gp, new_fp8 = jax.grad(lambda p, f: loss(model, p, f, x), argnums=(0, 1))(params, fp8)
        return gp, new_fp8

    def local(params, fp8, x):  # one device: fp8 carries a leading device axis of 1
        gp, new = step(sharded, params, jax.tree.map(lambda a: a[0], fp8), x)
        # params come in replicated, so their gradient is already summed over 'd' (shard_map's
        # transpose of the implicit broadcast); the FP8 state is per device and is not summed
        return jax.tree.map(lambda p, g: p - lr * g, params, gp), jax.tree.map(lambda a: a[None], new)

    train = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P("d"))))
    ref = jax.jit(lambda params, fp8, x: step(full, params, fp8, x)[1])

    # inputs placed as the step returns them, so that each function compiles once
    dev0 = jax.devices()[0]
    params = jax.device_put(variables["params"], NamedSharding(mesh, P()))
    fp8_s = jax.device_put(jax.tree.map(lambda a: jnp.stack([a] * 4), variables[OWG]), NamedSharding(mesh, P("d")))
    fp8_r = jax.device_put(variables[OWG], dev0)
    xs_sharding = NamedSharding(mesh, P("d"))
    for t, xb in enumerate(batches):
        params_before = params
        params, fp8_s = train(params, fp8_s, jax.device_put(xb, xs_sharding))
        # the unsharded reference: the same weights, the whole batch, on one device
        fp8_r = ref(jax.device_put(params_before, dev0), fp8_r, jax.device_put(xb, dev0))
        for layer in layers:
            s = {k: np.asarray(v) for k, v in fp8_s[layer].items()}
            if first_step == "current":
                # the first step's scales come from each device's own amaxes (no collective in the
                # quantization); from the first update on, the devices agree, but the run differs
                # from the unsharded one, which quantized step 0 with the whole batch's amaxes
                for k in s:
                    rows = slice(1, None) if k == "amax_history" else slice(None)
                    if t > 0 or k not in ("scale", "scale_inv"):
                        assert all(s[k][d][rows].tobytes() == s[k][0][rows].tobytes() for d in range(4)), (t, k, s[k])
                continue
            r = {k: np.asarray(v) for k, v in fp8_r[layer].items()}
            for k in s:
                rows = slice(1, None) if k == "amax_history" else slice(None)
                for d in range(4):
                    assert s[k][d][rows].tobytes() == r[k][rows].tobytes(), (t, layer, k, d, s[k][d], r[k])
            staged = np.where(np.isfinite(s["amax_history"][:, 0]), s["amax_history"][:, 0], np.inf).max(0)
            want = np.where(np.isfinite(r["amax_history"][0]), r["amax_history"][0], np.inf)
            assert staged.tobytes() == want.tobytes(), (t, layer, s["amax_history"][:, 0], r["amax_history"][0])
            assert len({s["amax_history"][d, 0].tobytes() for d in range(4)}) > 1, (t, layer, s["amax_history"][:, 0])
    if first_step == "current":
        return
    # the scales were updated (the fourth forward applied steps 0..2)
    fc1 = {k: np.asarray(v) for k, v in fp8_r[layers[0]].items()}
    assert (fc1["updates"] == 3).all() and (fc1["scale"] != 1).all(), fc1

    # the NaN staged on device 1 alone is an overflow on every device at the next update
    from fusedfp8.jax import meta as JM
    from fusedfp8.jax import primitives as FP

    def update(*m):
        st = FP.update_scales(JM.meta_to_state(tuple(a[0] for a in m)), recipe, axis_name="d")
        return tuple(a[None] for a in JM.state_to_meta(st))

    names = JM.META_FIELDS  # (the state's arrays, in the order of STATE_FIELDS, first)
    staged = np.asarray(fp8_s[layers[0]]["amax_history"])[:, 0, 0]
    assert np.isnan(staged[1]) and np.isfinite(staged[[0, 2, 3]]).all(), staged
    new = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("d"),) * len(names), out_specs=(P("d"),) * len(names)))(
        *(fp8_s[layers[0]][k] for k in names))
    new = [np.asarray(a) for a in new]
    assert (new[3][:, 0] == 1).all() and (new[1][:, 0] == np.asarray(fp8_s[layers[0]]["scale"])[:, 0]).all(), new
    assert all(a[d].tobytes() == a[0].tobytes() for a in new for d in range(4))


def _count_all_reduce(hlo: str) -> int:
    import re

    return len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))


def _case_one_reduce():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import fusedfp8
    from fusedfp8.jax import functional as F
    from fusedfp8.jax import meta as JM
    from fusedfp8.jax import primitives as FP
    from fusedfp8.state import ScalingState

    recipe = fusedfp8.DelayedScaling(amax_history_len=16)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    n = 12
    arrays = (jnp.ones((4, 16, n)), jnp.ones((4, n)), jnp.ones((4, n)), jnp.zeros((4, n), jnp.int32),
              jnp.zeros((4, n), jnp.int32))
    counts = {}
    for axis in ("d", None):
        def local(*a, axis=axis):
            new = FP.update_scales(ScalingState(*(x[0] for x in a), (False,) * n), recipe, axis_name=axis)
            return new.scale[None]

        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"),) * 5, out_specs=P("d")))
        counts[("update", axis)] = _count_all_reduce(f.lower(*arrays).compile().as_text())

    recipe, B, batches, _, _, variables = _mlp_setup()
    p = variables["params"]
    meta = tuple(jax.tree.map(lambda a: jnp.stack([a] * 4), tuple(variables["_overwrite_with_gradient"][k][v]
                                                                  for v in JM.META_FIELDS))
                 for k in ("fc1", "fc2"))

    def mlp(x, m1, m2):
        m1, m2 = (tuple(a[0] for a in m) for m in (m1, m2))
        return F.fp8_mlp(x, p["fc1"]["kernel"], p["fc1"]["bias"], p["fc2"]["kernel"], p["fc2"]["bias"], m1, m2,
                         recipe, axis_name="d")

    f = jax.jit(jax.shard_map(mlp, mesh=mesh, in_specs=(P("d"), P("d"), P("d")), out_specs=P("d")))
    counts[("fp8_mlp", "d")] = _count_all_reduce(f.lower(jnp.asarray(batches[0]), *meta).compile().as_text())
    assert counts == {("update", "d"): 1, ("update", None): 0, ("fp8_mlp", "d"): 1}, counts


def run_cases(cases, namespace: dict, out_path: str) -> None:
    """Run ``namespace['_case_<name>']`` for each name of ``cases`` on the 4 devices and write one
    verdict per case ('ok' or the traceback) to ``out_path`` as JSON."""
    import jax

    assert jax.device_count() == 4, jax.devices()
    verdicts = {}
    for name in cases:
        t0 = time.monotonic()
        try:
            namespace[f"_case_{name}"]()
            verdicts[name] = "ok"
        except Exception:  # noqa: BLE001  (reported to the parent test)
            verdicts[name] = traceback.format_exc()
        print(f"{name}: {time.monotonic() - t0:.1f} s", flush=True)
    with open(out_path, "w") as f:
        json.dump(verdicts, f)


def main(out_path: str) -> None:
    run_cases(CASES, globals(), out_path)


if __name__ == "__main__":
    main(sys.argv[1])
