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
  reference *does* use (``fma_f32``) are emulated exactly in float32 (:func:`fma_f32`), since JAX
  has no FMA primitive and float64 is off by default.
- Reassociation with constants. XLA's simplifier rewrites ``(1 + p) - 1`` to ``p``; it leaves
  sums and differences of non-constant operands as written. Every constant is therefore hidden
  (:func:`_c`) and the error-free sums (TwoSum, Veltkamp's split) are plain adds: hiding each of
  their steps as well made the emulated FMA half again as large for XLA to compile.
- Flushed denormals. XLA:CPU treats denormal inputs of float arithmetic as zero and flushes
  denormal results. The amax is therefore taken on the bits (exact, NaN-propagating), and the
  one product whose denormal input can matter (``x * scale`` of a bf16/fp32 denormal input,
  which a huge first-step scale makes a normal FP8 value) is computed from the bits as well.
  Known gap: a denormal *intermediate* inside the activations (gelu of a denormal input; the
  erf gelu and its derivative near x = -13, where erfc underflows gradually) is flushed on
  XLA:CPU, so a value below 2**-126 becomes 0. It only shows in the FP8 result when the scale is
  beyond 2**100 (a tensor whose every activation is below 2**-100), or as the sign of a zero
  in the erf gelu gradient near x = -13. XLA:GPU keeps denormals (``xla_gpu_ftz`` is off).
- Division. XLA:GPU's float32 ``/`` is ``div.full.f32`` (up to 2 ulp off; it made a scale differ by
  one ulp from the kernels' on the H200), and XLA:CPU flushes denormal quotients. Every division
  of the reference is :func:`div_rn`, an exact integer long division.
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
    """Decorator: ``fn`` under ``jax.jit``, so that its graph (hundreds to thousands of integer ops an
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


def _two_sum(a, b):
    """Knuth's TwoSum: s + err == a + b exactly. Sums and differences need no hiding: XLA
    reassociates float adds only with constants (which :func:`_c` hides) and contracts only
    products (which :func:`_mul` hides)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a):
    """Veltkamp's split of a float32 into two 12-bit halves (hi + lo == a exactly)."""
    t = _mul(_c(4097.0), a)
    hi = t - (t - a)
    return hi, a - hi


def _fma_core(a, b, c):
    p = _mul(a, b)
    ah, al = _split(a)
    bh, bl = _split(b)
    e = (((_mul(ah, bh) - p) + _mul(ah, bl)) + _mul(al, bh)) + _mul(al, bl)
    th, tl = _two_sum(c, p)
    s, err = _two_sum(tl, e)
    sb = bits(s)
    inexact = (err != 0) & ((sb & 1) == 0)
    away = (s > 0) == (err > 0)  # the exact value lies further from zero than s
    v = jnp.where(inexact, from_bits(sb + jnp.where(away, 1, -1).astype(jnp.int32)), s)
    return p, th + v


def _pow2(k) -> jax.Array:
    """2**k as float32 for int32 k in [-126, 127] (exact)."""
    return from_bits(lax.shift_left(k + 127, jnp.int32(23)))


def _scale_pow2(x, s) -> jax.Array:
    """x * 2**s for int32 s in [-252, 252], in two exact halves (no spurious over/underflow)."""
    h = lax.shift_right_arithmetic(s, jnp.int32(1))  # s // 2 (floor) in one op
    return _mul(_mul(x, _pow2(h)), _pow2(s - h))


@_traced_once("tiny_products")
def fma_f32(a, b, c, tiny_products: bool = True) -> jax.Array:
    """Correctly rounded float32 ``a * b + c`` (the kernels' fma.rn.f32), in float32 only.

    a and b are first scaled by powers of two into [1, 2) (c by the same total factor; a c too
    small to matter there is replaced by +-2**-100, which rounds alike), so that no partial
    product underflows; then Dekker's exact product ``a*b = p + e`` and Boldo and Melquiond's
    emulated FMA: ``(th, tl) = TwoSum(c, p)``, ``v = RO(tl + e)`` (round to odd), result
    ``RN(th + v)``, scaled back exactly. Zero, denormal, non-finite or extreme operands (where
    c dominates, or the reference's callers only produce inf, NaN or a masked-out lane) get the
    twice-rounded ``a*b + c``.

    ``tiny_products=False`` skips the scaling, for callers whose products are never below
    2**-60 unless c makes them irrelevant (the polynomials and the exp argument reduction): a
    much smaller graph, which XLA:CPU compiles several times faster.
    """
    a, b, c = (jnp.asarray(v, f32) for v in (a, b, c))
    if not tiny_products:
        p, z = _fma_core(a, b, c)
        big = _c(2.0 ** 100)
        safe = jnp.isfinite(p) & jnp.isfinite(c) & jnp.isfinite(z) & (jnp.abs(a) < big) & (jnp.abs(b) < big)
        return jnp.where(safe, z, p + c)
    exp_a = ((bits(a) >> 23) & 0xFF) - 127
    exp_b = ((bits(b) >> 23) & 0xFF) - 127
    normal = (exp_a > -127) & (exp_a < 128) & (exp_b > -127) & (exp_b < 128)
    sa, sb = jnp.clip(-exp_a, -126, 126), jnp.clip(-exp_b, -126, 126)
    a1, b1 = _mul(a, _pow2(sa)), _mul(b, _pow2(sb))
    c1 = _scale_pow2(c, sa + sb)
    small = _c(2.0 ** -100)
    c1 = jnp.where((c != 0) & (jnp.abs(c1) < small), jnp.where(jnp.signbit(c), -small, small), c1)
    z = _scale_pow2(_fma_core(a1, b1, c1)[1], -(sa + sb))
    naive = _mul(a, b) + c
    safe = normal & jnp.isfinite(c) & jnp.isfinite(c1) & (jnp.abs(c1) < _c(2.0 ** 100)) & jnp.isfinite(z)
    return jnp.where(safe, z, naive)


# ---- division ----------------------------------------------------------------------------------
# The 26 quotient bits (24 significant bits, a guard bit and one for a quotient below 1) come from
# integer divisions of at most 7 bits each: a remainder below the divisor (< 2**24) shifted
# left by 7 bits still fits in int32. Four divisions instead of a 26-step bit loop: no loop, and
# XLA never copies an integer division into the fusions that read its result.
_CHUNKS = (7, 7, 7, 4)  # the bits after the first one, 25 in all


def _unpack(ib):
    """(significand, biased exponent) of float32 bits with the sign masked off; a denormal is
    normalised (its significand shifted up to bit 23, the exponent lowered to match)."""
    frac = ib & 0x7FFFFF
    e = (ib >> 23) & 0xFF
    shift = jnp.where(e == 0, lax.clz(frac) - 8, 0)
    return jnp.where(e == 0, frac << shift, frac | 0x800000), jnp.where(e == 0, 1 - shift, e)


@_traced_once()
def div_rn(a, b) -> jax.Array:
    """IEEE float32 ``a / b``, round to nearest even: the kernels' ``div.rn.f32``, bit for bit.

    XLA:GPU lowers float32 division to ``div.full.f32`` (up to 2 ulp off; openxla/xla#37181),
    and XLA:CPU flushes a denormal quotient to zero, so neither backend's ``/`` can be the
    twin of the kernels' scale arithmetic. This is a long division of the 24-bit significands in
    int32 (26 quotient bits, 7 at a time, and a sticky bit), rounded once at the result's
    precision, denormal quotients included; specials as IEEE (x/0 = inf, 0/0 = inf/inf = NaN,
    x/inf = 0; a NaN operand propagates).
    """
    a, b = jnp.asarray(a, f32), jnp.asarray(b, f32)
    ia, ib = bits(a), bits(b)
    ma_bits, mb_bits = ia & _MAG, ib & _MAG
    ma, ea = _unpack(ma_bits)
    mb, eb = _unpack(mb_bits)
    below = ma < mb  # the quotient of the significands lies in (1/2, 1): one more bit from ma
    r = jnp.where(below, ma << 1, ma)  # in [mb, 2 * mb) where a, b != 0: the first quotient bit is 1
    q, r = jnp.ones_like(r), r - mb
    divisor = jnp.maximum(mb, 1)  # b = 0 is answered below; no integer division by zero
    for k in _CHUNKS:
        num = r << k
        q, r = (q << k) | lax.div(num, divisor), lax.rem(num, divisor)
    # |a / b| = (q + rest) * 2**(E - 25), q in [2**25, 2**26), rest in [0, 1) is nonzero iff r is.
    biased = ea - eb - below.astype(jnp.int32) + 127  # of the truncated quotient
    over = biased > 254
    biased = jnp.clip(biased, -200, 254)
    drop = jnp.minimum(2 + jnp.maximum(1 - biased, 0), 28)  # bits below the result's last place
    kept = q >> drop
    rest = q & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    up = (rest > half) | ((rest == half) & ((r != 0) | ((kept & 1) == 1)))
    mag = lax.shift_left(jnp.maximum(biased, 1) - 1, jnp.int32(23)) + kept + up.astype(jnp.int32)
    mag = jnp.where(over, _INF_BITS, jnp.minimum(mag, _INF_BITS))  # rounded past FLT_MAX: inf
    a_zero, b_zero = ma_bits == 0, mb_bits == 0
    a_inf, b_inf = ma_bits == _INF_BITS, mb_bits == _INF_BITS
    nan = (ma_bits > _INF_BITS) | (mb_bits > _INF_BITS) | (a_zero & b_zero) | (a_inf & b_inf)
    mag = jnp.where(a_inf | b_zero, _INF_BITS, jnp.where(a_zero | b_inf, 0, mag))
    # a NaN operand comes back quieted (a's first, as x86 and XLA's own division propagate it);
    # an invalid operation (0/0, inf/inf) gives the canonical NaN of CUDA
    nan_bits = jnp.where(ma_bits > _INF_BITS, ia | 0x400000,
                         jnp.where(mb_bits > _INF_BITS, ib | 0x400000, np.int32(0x7FFFFFFF)))
    return from_bits(jnp.where(nan, nan_bits, ((ia ^ ib) & _SIGN) | mag))


# ---- the array namespace of the scaling rule ---------------------------------------------------
class JnpNamespace(NumpyNamespace):
    """jax.numpy, traced or concrete. Its ``/`` is not IEEE (XLA:GPU's ``div.full.f32`` is up to
    2 ulp off, XLA:CPU flushes denormal quotients): ``divide`` is the exact long division of
    :func:`fusedfp8.numerics.jnp.div_rn`."""

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
        return computed_once(div_rn(a, b))  # dozens of integer ops: not copied into every reader


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


def _denormal(vb) -> jax.Array:
    """Whether float32 bits ``vb`` are a denormal (nonzero, exponent field 0)."""
    return ((vb & _MAG) != 0) & ((vb & _MAG) < np.int32(0x00800000))


def _times_2_64(vb) -> jax.Array:
    """``v * 2**64`` for the denormal of bits ``vb``, exact and normal, built from the bits:
    XLA:CPU reads a denormal operand as 0."""
    m = _mul(lax.convert_element_type(vb & _MAG, f32), _c(2.0 ** -85))
    return jnp.where(vb < 0, -m, m)


@_traced_once()
def mul(a, b) -> jax.Array:
    """``a * b`` rounded once, also when one operand is denormal (a denormal scale, ``1 / FLT_MAX``
    as a scale_inv, a denormal input), which XLA:CPU would read as 0: that operand is multiplied by
    2**64 (exact, from its bits) and the other by 2**-64, so the product is the same real number
    and is rounded once. Where the other operand is below 2**-62 (its scaled copy inexact) or
    both are denormal, the product is below 2**-188 and rounds to a zero of its sign either way.
    A product that is itself denormal may still be flushed on XLA:CPU (it quantizes to an FP8
    zero of the same sign either way)."""
    a, b = jnp.asarray(a, f32), jnp.asarray(b, f32)
    ab, bb = bits(a), bits(b)
    a_den, b_den = _denormal(ab), _denormal(bb)
    a1 = jnp.where(a_den, _times_2_64(ab), jnp.where(b_den, _mul(a, _c(2.0 ** -64)), a))
    b1 = jnp.where(b_den & ~a_den, _times_2_64(bb), jnp.where(a_den & ~b_den, _mul(b, _c(2.0 ** -64)), b))
    return _mul(a1, b1)


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
    # fmt_max is only ever divided (integer ops on its bits): a plain constant, which XLA folds
    return scaling.current_scale(JnpNamespace(), a, np.float32(fmt.max), margin_operand(margin_factor), fallback)


def margin_operand(margin_factor: float):
    """The margin factor as the scale formula's divisor: the Python float 1.0 when it is 1 (margin
    0, the default), which :func:`fusedfp8.numerics.scaling.compute_scale` does not divide by; else
    the hidden float32 constant."""
    return 1.0 if float(margin_factor) == 1.0 else _c(margin_factor)
