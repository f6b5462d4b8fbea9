"""Where the host spends the seed's flax step: XLA's command buffer, updated or not.

The seed's program (scripts/seed_flax_mlp.py: its model, TrainState, jit with explicit shardings,
no donation) is host-bound at hidden 1024 with fusedfp8's Fp8DotGeneral. This traces its host
side with ``jax.profiler`` and reads, per step, the time of XLA's host events: the whole
executable (``GpuExecutable::ExecuteThunks``), the command buffer's ``command_buffer::update``
(re-recording the commands whose buffers moved; a custom call is re-run under stream capture)
and ``command_buffer::execute`` (the graph launch), beside the wall time per step.

Modes: those of seed_flax_mlp.py (``bf16``, ``fusedfp8``, ``fusedfp8_mlp``, ...), each with an
optional recipe tag (``fusedfp8@current``) and an optional variant after a colon, a diagnostic that changes one thing:

- ``:donate``: the step jitted with ``donate_argnums=0`` (the state's buffers reused: nothing
  moves between steps, the command buffer needs no update);
- ``:xla_gemm``: fusedfp8's GEMMs through XLA's dot (its native cuBLASLt command, as before the
  FFI GEMM) instead of the FFI GEMM, the quantizations unchanged.

Every mode's first loss is checked against bf16's (the first mode must be ``bf16``) before it is
timed. JSON to ``--out``.

    python scripts/seed_host_trace.py --out out
    python scripts/seed_host_trace.py --modes bf16,fusedfp8,fusedfp8:xla_gemm,fusedfp8:donate --out out
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
from pathlib import Path

import _bench
import jax

import seed_flax_mlp as seed

EVENTS = ("GpuExecutable::ExecuteThunks", "command_buffer::update", "command_buffer::execute")
VARIANTS = ("", "donate", "xla_gemm")
MODES = "bf16,fusedfp8,fusedfp8:xla_gemm,fusedfp8:donate,bf16:donate"


def host_events(step, state, x, y, nsteps: int):
    """(state, {event: ms per step}) of EVENTS on the host over ``nsteps`` traced steps."""
    from jax.profiler import ProfileData

    totals = dict.fromkeys(EVENTS, 0.0)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(nsteps):
                state, loss = step(state, x, y)
            jax.block_until_ready(loss)
        data = ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
        for plane in data.planes:
            if plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                for e in line.events:
                    for name in EVENTS:
                        if e.name.endswith(name):
                            totals[name] += e.duration_ns / 1e6
    return state, {k: v / nsteps for k, v in totals.items()}


def run_mode(mode: str, shape, args, bf16_first_loss):
    from fusedfp8.jax import gemm as G

    base, _, variant = mode.partition(":")
    if variant not in VARIANTS or seed.recipes.split(base)[0] not in seed.MODES:
        raise SystemExit(f"--modes: {mode!r} is not MODE[:VARIANT] with MODE in {seed.MODES}, VARIANT in {VARIANTS[1:]}")
    real = G._auto_uses_ffi
    if variant == "xla_gemm":
        G._auto_uses_ffi = lambda *a, **k: False  # traced with XLA's dot GEMM (the choice is made at trace time)
    try:
        step, state, x, y = seed.program(base, *shape, donate=variant == "donate")
        state, loss = step(state, x, y)
        first = float(loss)
        for _ in range(args.warmup):
            state, loss = step(state, x, y)
        jax.block_until_ready(loss)
    finally:
        G._auto_uses_ffi = real
    rel = None if bf16_first_loss is None else first / bf16_first_loss - 1
    if rel is not None and abs(rel) > 0.01:
        raise SystemExit(f"{mode}: first loss {first} is {rel:+.2%} from bf16's {bf16_first_loss}: not timed")

    def one():
        nonlocal state
        state, loss = step(state, x, y)
        return loss

    times = _bench.host_block_ms(one, args.block, args.reps, jax.block_until_ready)
    row = {"mode": mode, "first_loss": first, "first_loss_vs_bf16": rel, "step_ms": statistics.median(times),
           "step_ms_all": times}
    if jax.devices()[0].platform == "gpu":
        state, row["host_ms_per_step"] = host_events(step, state, x, y, args.trace_steps)
    h = row.get("host_ms_per_step", {})
    print(f"{mode:<20} {row['step_ms']:7.3f} ms/step  " + "  ".join(f"{k.split('::')[-1]} {v * 1e3:6.1f} us"
                                                              for k, v in h.items()), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=MODES, help="comma separated MODE[:VARIANT], bf16 first")
    ap.add_argument("--shape", default="1024x4096x2048", help="HIDDENxFFNxTOKENS")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--block", type=int, default=50, help="steps per timed block")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks (the median is reported)")
    ap.add_argument("--trace-steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("out"))
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != "bf16":
        ap.error("--modes: the first mode must be bf16 (the other modes' losses are checked against it)")
    shape = tuple(int(v) for v in args.shape.split("x"))
    rows, bf16_first = [], None
    for mode in modes:
        rows.append(run_mode(mode, shape, args, bf16_first))
        bf16_first = rows[0]["first_loss"]
    args.out.mkdir(parents=True, exist_ok=True)
    _bench.write_json(args.out / "seed_host_trace.json",
                      _bench.run_meta(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                                      shape=dict(zip(("hidden", "ffn", "tokens"), shape))),
                      [{"shape": args.shape, "modes": {r["mode"]: r for r in rows}}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
