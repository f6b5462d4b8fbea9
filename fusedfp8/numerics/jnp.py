"""The reference numerics (:mod:`fusedfp8.numerics.reference`) in ``jax.numpy``: the CPU backend
of the JAX primitives, and their twin on any backend. Here the guarded arithmetic (bits, hidden
products, exact fused multiply-adds and divisions), the scaling rule's namespace, the amax, the
scale and the FP8 cast; the activations are :mod:`fusedfp8.numerics.jnp_gelu`, LayerNorm
:mod:`fusedfp8.numerics.jnp_layernorm`, both written on these.

XLA does not keep NumPy's operation order by itself, so everything here is written against these
habits of it, and tested byte for byte against the reference:

- FMA contraction. XLA:CPU (and LLVM on GPU) fuse ``a * b + c`` into one fused multiply-add,
  which rounds once instead of twice. Every product is passed through :func:`_mul`, which hides
  it behind a bit-level identity (bitcast, xor with a zero that XLA cannot see is zero, bitcast
  back), so no add ever sees a multiply to fuse with; on the CPU that zero is a loop's result,
  which XLA cannot fuse into the add's kernel (:func:`_new_zero`). The fused multiply-adds the
  reference *does* use (``fma_f32``) are computed in float64 (:func:`fma_f32`): JAX has no FMA
  primitive.
- Reassociation with constants. XLA's simplifier rewrites ``(1 + p) - 1`` to ``p``; it leaves
  sums and differences of non-constant operands as written. Every constant is therefore hidden
  (:func:`_c`) and the error-free sum of :func:`fma_f32` (TwoSum) is plain adds, its operands
  hidden once at the entry.
- Flushed denormals. XLA:CPU treats denormal inputs of float arithmetic as zero and flushes
  denormal results. The amax is therefore taken on the bits (exact, NaN-propagating), and the
  one product whose denormal input can matter (``x * scale`` of a bf16/fp32 denormal input,
  which a huge first-step scale makes a normal FP8 value) is :func:`mul`, exact in float64.
  Known gap: a denormal *intermediate* inside the activations (gelu of a denormal input; the
  erf gelu and its derivative near x = -13, where erfc underflows gradually) is flushed on
  XLA:CPU, so a value below 2**-126 becomes 0. It only shows in the FP8 result when the scale is
  beyond 2**100 (a tensor whose every activation is below 2**-100), or as the sign of a zero
  in the erf gelu gradient near x = -13. XLA:GPU keeps denormals (``xla_gpu_ftz`` is off).
- Division. XLA:GPU's float32 ``/`` is ``div.full.f32`` (up to 2 ulp off; it made a scale differ by
  one ulp from the kernels' on the H200), and XLA:CPU flushes denormal quotients. Every division
  of the reference is :func:`div_rn`, the float64 quotient rounded to float32.
- float64 inside, float32 outside. The correctly rounded float32 operations (:func:`fma_f32`,
  :func:`div_rn`, :func:`mul`, the LayerNorm's square root) compute in float64 under
  ``jax.enable_x64`` and round once more to float32, which is exact (their section says why);
  their integer emulations in float32 were most of the programs XLA:CPU compiled.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..formats import Format, get_format
from . import scaling
from .xp import NumpyNamespace

f32 = jnp.float32
_SIGN = np.int32(-0x80000000)
_MAG = np.int32(0x7FFFFFFF)
_INF_BITS = np.int32(0x7F800000)


def _c(v) -> jax.Array:
    """A float32 constant (the reference's hex literals, exact), hidden from XLA's algebraic
    simplifier, which otherwise reassociates float adds with constants ((1 + p) - 1 -> p)."""
    return _hide(jnp.asarray(np.float32(v), f32))


def _traced_once(*static_argnames: str):
    """Decorator: ``fn`` under ``jax.jit``, so that its graph (dozens to thousands of ops an
    element) is traced once per shape and dtype (and value of the static arguments) and reused by
    every later call, traced or eager, instead of being traced again at each call site. Under an
    outer ``jit`` XLA inlines the call, so the compiled program is the same; eagerly it is one
    compiled program instead of thousands of dispatched ops: tracing was a fifth of the CPU test
    suite's time.

    The hidden zero (:func:`one_hidden_zero`) is an argument: the caller's, so that a program
    has one however many of these it calls, or one made from the arguments. Read from the
    enclosing block instead, it would be a tracer of the first caller's trace kept in the cache."""

    def wrap(fn):
        sig = inspect.signature(fn)

        def traced(*args, _zero, **kwargs):
            token = _ZERO.set(_zero)
            try:
                return fn(*args, **kwargs)
            finally:
                _ZERO.reset(token)

        traced.__name__ = traced.__qualname__ = fn.__name__  # the program's function name in HLO dumps
        traced.__signature__ = sig.replace(parameters=[*sig.parameters.values(),
                                                       inspect.Parameter("_zero", inspect.Parameter.KEYWORD_ONLY)])
        jitted = jax.jit(traced, static_argnames=static_argnames)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            zero = _ZERO.get()
            if zero is None:
                zero = _new_zero(*jax.tree.leaves((args, kwargs)))
            return jitted(*args, _zero=zero, **kwargs)

        return call

    return wrap


# ---- bit-level helpers -------------------------------------------------------------------------
def bits(a) -> jax.Array:
    return lax.bitcast_convert_type(a, jnp.int32)


def from_bits(b) -> jax.Array:
    return lax.bitcast_convert_type(b, f32)


_ZERO = contextvars.ContextVar("fusedfp8_hidden_zero", default=None)


def _new_zero(*like) -> jax.Array:
    """An int32 0 that neither XLA nor LLVM can see is 0, computed from the first nonempty array
    among ``like`` (a value XLA cannot know in advance).

    On the CPU it is what a while loop leaves of a counter that starts at 0 or 1 (whether that
    value's first element is nonzero) and counts down to 0. XLA:CPU removes optimization barriers
    before it fuses; a zero out of a barrier then becomes a constant that XLA may fuse into its
    reader, where LLVM folds the xor away and contracts the product it hid (``jit(lambda a, b,
    c: _mul(a, b) + c)`` was one ulp off NumPy on a quarter of the elements). A loop is never
    fused, so its result reaches every reader as a buffer, and ``vmap`` keeps it a loop (a
    conditional on a batched predicate becomes a select of its two results, which XLA folds).

    Elsewhere the zero comes out of an optimization barrier: on the GPU this module runs the
    train step's state update, not the quantization (the kernels do that), and a loop there
    would cost a host round trip a step. So it does where ``like`` holds no traced element:
    nothing to hide from a compiler (eager values are computed op by op), or nothing to make
    the zero from."""
    seed = next((a for a in like if isinstance(a, jax.core.Tracer) and a.size), None)
    if seed is None:
        return lax.optimization_barrier(jnp.zeros((), jnp.int32))

    def first_nonzero(v):  # 0 or 1; varying over a shard_map's axes where v is
        return (jnp.ravel(v)[0] != 0).astype(jnp.int32)

    def cpu(v):
        return lax.while_loop(lambda n: n > 0, lambda n: n - 1, first_nonzero(v))

    return lax.platform_dependent(seed, cpu=cpu, default=lambda v: lax.optimization_barrier(first_nonzero(v) & 0))


@contextlib.contextmanager
def one_hidden_zero(*like):
    """Within the block every hidden product and constant shares one zero, made on entry from
    ``like`` (:func:`_new_zero`). Outside any block each hidden value makes its own from itself:
    as exact, but a loop each for XLA:CPU to compile; and a constant, having no traced value to
    make it from, gets the barrier's zero, which XLA:CPU may see through.

    A function under ``jax.jit`` that hides takes its caller's zero as an argument
    (:func:`_traced_once` does) or opens its own block: its trace is cached and reused by later
    calls, and must not keep a tracer of its first caller's."""
    token = _ZERO.set(_new_zero(*like))
    try:
        yield
    finally:
        _ZERO.reset(token)


def shares_one_zero(fn):
    """Decorator: the values ``fn`` hides share one zero, the enclosing block's or one made from
    ``fn``'s arguments (:func:`one_hidden_zero`). For the twin's entry points that are not
    :func:`_traced_once`, and for the jnp backend's branch of each primitive."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _ZERO.get() is not None:
            return fn(*args, **kwargs)
        with one_hidden_zero(*jax.tree.leaves((args, kwargs))):
            return fn(*args, **kwargs)

    return run


def _hidden_zero(v) -> jax.Array:
    """An int32 0 that XLA cannot see is 0: the enclosing :func:`one_hidden_zero` block's, else
    one made from ``v``."""
    zero = _ZERO.get()
    return _new_zero(v) if zero is None else zero


def _hide(v) -> jax.Array:
    """``v`` unchanged, bit for bit, but opaque to XLA: no simplification or contraction sees
    through it."""
    return from_bits(bits(v) ^ _hidden_zero(v))


def computed_once(v) -> jax.Array:
    """float32 ``v``, bit for bit, computed once and stored. XLA:CPU drops optimization barriers
    before it fuses, and copies a producer made of cheap ops into every fusion that reads it: an
    emulated activation (thousands of integer ops an element) read by the amax, the cast and the
    transpose was compiled, and run, once per reader. An integer division counts as expensive to
    XLA's fusion pass, which never duplicates one: dividing the bits by a 1 it cannot see stops
    the copying there."""
    return from_bits(lax.div(bits(v), _hidden_zero(v) + 1))


def _mul(a, b) -> jax.Array:
    """``a * b`` rounded once, never contracted into a following add."""
    return _hide(jnp.multiply(a, b))


# ---- float64 arithmetic ------------------------------------------------------------------------
# The reference's fused multiply-add, division and square root are correctly rounded float32
# operations. Each is computed here in float64 and rounded once more to float32, which is exact:
# a product of two float32 is exact in float64, and a float64 quotient or square root is within
# 2**-52 of the exact value (two roundings, where XLA turns a division by a broadcast divisor into
# a product with its reciprocal), while a float32 result's rounding boundary is never closer than
# 2**-49 to it, except for a quotient exactly halfway between two denormals (div_rn finds those).
# float64 is on only inside these functions (``jax.enable_x64``); their operands and results are
# float32. XLA:CPU reads a denormal float32 as 0 when it converts it, and flushes a denormal
# float32 result of a conversion: both ends go through the bits.
_F32_MIN_NORMAL = 2.0 ** -126


def _f64(x) -> jax.Array:
    """float32 ``x`` as float64, exactly, denormals included (made from their integer significand)."""
    b = bits(x)
    frac = b & 0x7FFFFF
    denormal = ((b & _INF_BITS) == 0) & (frac != 0)
    signed = jnp.where(b < 0, -frac, frac).astype(jnp.float64)
    return jnp.where(denormal, signed * 2.0 ** -149, x.astype(jnp.float64))


def _f32_rn(y) -> jax.Array:
    """float64 ``y`` rounded to the nearest float32, ties to even, denormal results included (an
    integer count of 2**-149, rounded as a float64 integer)."""
    ay = jnp.abs(y)
    k = lax.round(ay * 2.0 ** 149, lax.RoundingMethod.TO_NEAREST_EVEN).astype(jnp.int32)
    denormal = from_bits(jnp.where(jnp.signbit(y), _SIGN, np.int32(0)) | k)
    return jnp.where(ay < _F32_MIN_NORMAL, denormal, y.astype(f32))


@_traced_once("denormals")
def fma_f32(a, b, c, denormals: bool = True) -> jax.Array:
    """Correctly rounded float32 ``a * b + c`` (the kernels' fma.rn.f32).

    In float64: the product ``p`` is exact, the sum ``s = p + c`` is rounded to odd (its TwoSum
    error, where nonzero, moves an even ``s`` one place towards the exact value), and a value
    rounded to odd with 29 bits to spare rounds to float32 as the exact value would. Non-finite
    operands give float64's IEEE result. An FMA contraction of ``p + c`` changes nothing, as
    ``p`` is exact; the operands are hidden, so that no constant is reassociated into the sum.

    ``denormals=False`` converts plainly, for the activations' polynomials and argument
    reductions, whose operands and results are normal wherever they matter: on XLA:CPU a
    denormal operand then reads as 0 and a denormal result is flushed, as everywhere else in the
    activation's float32 arithmetic; a graph a third smaller for XLA:CPU to compile."""
    a, b, c = (_hide(jnp.asarray(v, f32)) for v in (a, b, c))
    with jax.enable_x64(True):
        up = _f64 if denormals else (lambda v: v.astype(jnp.float64))
        a64, b64, c64 = up(a), up(b), up(c)
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        sb = lax.bitcast_convert_type(s, jnp.int64)
        even = jnp.isfinite(s) & (err != 0) & ((sb & 1) == 0)
        away = (s > 0) == (err > 0)  # the exact value lies further from zero than s
        s = jnp.where(even, lax.bitcast_convert_type(sb + jnp.where(away, 1, -1), jnp.float64), s)
        return _f32_rn(s) if denormals else s.astype(f32)


@_traced_once()
def div_rn(a, b) -> jax.Array:
    """IEEE float32 ``a / b``, round to nearest even: the kernels' ``div.rn.f32``, bit for bit.

    XLA:GPU lowers float32 division to ``div.full.f32`` (up to 2 ulp off; openxla/xla#37181),
    and XLA:CPU flushes a denormal quotient to zero, so neither backend's float32 ``/`` can be
    the twin of the kernels' scale arithmetic. The float64 quotient rounded to float32 is (see
    above), but for a quotient exactly halfway between two denormals, which the float64 product
    with a rounded reciprocal may miss by an ulp: such a quotient ``m * 2**-150`` (m odd) is
    recognised by ``m * b * 2**-150 == a``, exact in float64. Specials as IEEE (x/0 = inf, 0/0 =
    inf/inf = NaN, x/inf = 0); a NaN operand comes back as float64 propagates it (quieted, a's
    first, on x86); an invalid operation (0/0, inf/inf) gives the canonical NaN of CUDA.
    """
    a, b = jnp.asarray(a, f32), jnp.asarray(b, f32)
    ia, ib = bits(a), bits(b)
    with jax.enable_x64(True):
        a64, b64 = _f64(a), _f64(b)
        q = a64 / b64
        aq = jnp.abs(q)
        m = lax.round(aq * 2.0 ** 150, lax.RoundingMethod.TO_NEAREST_EVEN)
        tie = ((aq < _F32_MIN_NORMAL) & ((m.astype(jnp.int32) & 1) == 1)
               & (m * jnp.abs(b64) * 2.0 ** -150 == jnp.abs(a64)))
        q = jnp.where(tie, jnp.where(q < 0, -m, m) * 2.0 ** -150, q)
        out = _f32_rn(q)
    invalid = jnp.isnan(out) & ((ia & _MAG) <= _INF_BITS) & ((ib & _MAG) <= _INF_BITS)
    return jnp.where(invalid, from_bits(np.int32(0x7FFFFFFF)), out)


# ---- the array namespace of the scaling rule ---------------------------------------------------
class JnpNamespace(NumpyNamespace):
    """jax.numpy, traced or concrete. Its ``/`` is not IEEE (XLA:GPU's ``div.full.f32`` is up to
    2 ulp off, XLA:CPU flushes denormal quotients): ``divide`` is the correctly rounded division
    of :func:`fusedfp8.numerics.jnp.div_rn`."""

    def __init__(self):
        super().__init__(jnp)

    def asarray(self, value, dtype, like):
        arr = self.m.asarray(value, dtype=dtype)
        if like is not None and not isinstance(like, jax.core.Tracer) and hasattr(like, "devices"):
            arr = jax.device_put(arr, next(iter(like.devices())))
        return arr

    def bits(self, a):
        return lax.bitcast_convert_type(a, self.m.int32)

    def divide(self, a, b):
        return computed_once(div_rn(a, b))  # a few dozen ops: not copied into every reader


# ---- amax, scaling, the FP8 cast ------------------------------------------------------------------
@shares_one_zero
def amax(y) -> jax.Array:
    """max |y| as a float32 scalar from the bits: exact with denormals, NaN-propagating
    (canonical NaN), 0 for an empty array."""
    mag = bits(jnp.asarray(y, f32)) & _MAG
    m = jnp.max(mag, initial=np.int32(0)) if mag.size else jnp.int32(0)
    return jnp.where(m > _INF_BITS, _c(np.nan), from_bits(m))


@shares_one_zero
def nan_max(a, b) -> jax.Array:
    """max of two amaxes (>= 0 or NaN), NaN-propagating, exact with denormals."""
    m = from_bits(jnp.maximum(bits(a) & _MAG, bits(b) & _MAG))
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), _c(np.nan), m)


@_traced_once()
def mul(a, b) -> jax.Array:
    """``a * b`` rounded once, denormal operands and products included (a denormal scale,
    ``1 / FLT_MAX`` as a scale_inv, a denormal input), which XLA:CPU would read or write as 0: the
    exact float64 product rounded to float32 (:func:`fma_f32`'s section)."""
    a, b = jnp.asarray(a, f32), jnp.asarray(b, f32)
    with jax.enable_x64(True):
        return _f32_rn(_f64(a) * _f64(b))


def scale_input(x, s) -> jax.Array:
    """``float32(x) * s`` rounded once, also for a denormal x or s (:func:`mul`)."""
    return mul(x, s)


@shares_one_zero
def cast_to_fp8(v, fmt: str | Format) -> jax.Array:
    """``cvt.rn.satfinite`` as uint8 codes: RNE, saturating, NaN -> the canonical NaN byte."""
    fmt = get_format(fmt)
    v = jnp.asarray(v, f32)
    clipped = jnp.clip(v, -_c(fmt.max), _c(fmt.max))
    q = lax.bitcast_convert_type(clipped.astype(jnp.dtype(fmt.dtype_name)), jnp.uint8)
    return jnp.where(jnp.isnan(v), jnp.uint8(fmt.nan_bits), q)


@shares_one_zero
def current_scale(a, fmt: Format, margin_factor: float, fallback) -> jax.Array:
    """First-step scale from the amax ``a`` (scalar), or ``fallback`` where a is 0 or non-finite
    (:func:`fusedfp8.numerics.scaling.current_scale`)."""
    # fmt_max is only ever divided (exactly, in float64): a plain constant, which XLA folds
    return scaling.current_scale(JnpNamespace(), a, np.float32(fmt.max), margin_operand(margin_factor), fallback)


def margin_operand(margin_factor: float):
    """The margin factor as the scale formula's divisor: the Python float 1.0 when it is 1 (margin
    0, the default), which :func:`fusedfp8.numerics.scaling.compute_scale` does not divide by; else
    the hidden float32 constant."""
    return 1.0 if float(margin_factor) == 1.0 else _c(margin_factor)
