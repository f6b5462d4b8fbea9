"""fusedfp8.numerics.jnp: the reference numerics in jax.numpy, byte for byte against
fusedfp8.numerics.reference under jax.jit, guarded against XLA's FMA contraction, flushed
denormals and inexact division (a control test shows the hazards are real on this XLA). The
division is checked on the CPU and, with jax's GPU backend, on the GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedfp8.formats import E4M3, E5M2
from fusedfp8.numerics import jnp as jn
from fusedfp8.numerics import jnp_gelu as jg
from fusedfp8.numerics import reference as ref
from support.shapes import special_values

f32 = np.float32


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


# ---- numerics ----------------------------------------------------------------------------------
def test_fma_is_correctly_rounded(rng):
    n = 200_000
    # exponents over +-80: products and results from denormal to huge (XLA:CPU flushes denormal
    # results of its float32 arithmetic); random bit patterns too (denormals, inf, NaN)
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-80, 80, n))).astype(f32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-80, 80, n))).astype(f32)
    with np.errstate(over="ignore"):
        c_exact = (-(a.astype(np.float64) * b)).astype(f32)  # near-cancellation: the hard cases
    c_rand = (rng.standard_normal(n) * np.exp2(rng.integers(-150, 60, n))).astype(f32)
    noise = rng.integers(0, 2**32, (3, n), dtype=np.uint64).astype(np.uint32).view(f32)
    fma = jax.jit(jn.fma_f32)
    for x, y, c in ((a, b, c_rand), (a, b, c_exact), (a, b, np.nextafter(c_exact, f32(np.inf))), noise):
        with np.errstate(all="ignore"):
            want = ref.fma_f32(x, y, c)
        got = np.asarray(fma(x, y, c))
        assert np.array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(u8(got[~np.isnan(want)]), u8(want[~np.isnan(want)]))
    assert (np.abs(ref.fma_f32(a, b, c_rand)) < 2.0 ** -126).sum() > 500  # denormal results among them


def test_plain_xla_would_not_match():
    """The hazards numerics/jnp.py guards against are real on this XLA: a * b + c is contracted,
    denormals are flushed, float adds are reassociated with constants."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(10_000).astype(f32) for _ in range(3))
    naive = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
    assert (naive != (a * b + c)).any()  # contracted into an fma (two roundings expected)
    assert np.asarray(jax.jit(lambda x: x * f32(2.0 ** 100))(np.float32(1e-40))) == 0  # denormals flushed
    p = np.float32(1e-10)
    assert np.asarray(jax.jit(lambda p: (1 + p) - 1)(p)) == p  # reassociated with the constants (exact: 0)
    assert np.asarray(jax.jit(lambda p: (jn._c(1.0) + p) - jn._c(1.0))(p)) == 0  # a hidden constant is not


# A hidden product read by an add, in programs small enough for XLA:CPU to fuse a zero it can see
# into the add's fusion (where LLVM folds the xor and contracts the product): (program, NumPy's).
HIDDEN = {
    "product + c": (lambda a, b, c: jn._mul(a, b) + c, lambda a, b, c: a * b + c),
    "c - product": (lambda a, b, c: c - jn._mul(a, b), lambda a, b, c: c - a * b),
    "hidden constant factor": (lambda a, b, c: jn._mul(a, jn._c(1.1)) + c, lambda a, b, c: a * f32(1.1) + c),
    "stored factor": (lambda a, b, c: jn._mul(a, jn.computed_once(b)) + c, lambda a, b, c: a * b + c),
    "jn.mul": (lambda a, b, c: jn.mul(a, b) + c, lambda a, b, c: a * b + c),
    "two products": (lambda a, b, c: jn._mul(a, b) + jn._mul(b, c), lambda a, b, c: a * b + b * c),
}


@pytest.mark.parametrize("transform", ["jit", "vmap"])
@pytest.mark.parametrize("name", list(HIDDEN))
def test_a_hidden_product_is_rounded_before_the_add(name, transform, jax_device):
    """Every product that numerics.jnp hides is rounded before an add reads it, however small the
    program (``jit(lambda a, b, c: _mul(a, b) + c)`` was one ulp off NumPy on a quarter of the
    results: XLA:CPU had fused the hiding zero in as a constant) and under vmap; on the CPU no
    xor of the compiled program has an operand XLA knows is 0."""
    from support import hlo

    program, numpy = HIDDEN[name]
    rng = np.random.default_rng(3)
    a, b, c = (jax.device_put(rng.standard_normal((40, 2500)).astype(f32), jax_device) for _ in range(3))
    fn = jax.jit(program if transform == "jit" else jax.vmap(program))
    compiled = fn.lower(a, b, c).compile()
    np.testing.assert_array_equal(u8(compiled(a, b, c)), u8(numpy(*(np.asarray(v) for v in (a, b, c)))))
    if jax_device.platform == "cpu":
        assert not hlo.xors_with_zero(compiled.as_text())


GRID = np.concatenate([np.linspace(-30, 30, 120_001, dtype=np.float32),
                       np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30, 3e38, -3e38], np.float32)])
# the documented gap: where the reference's erf intermediates are denormal (gradual underflow),
# XLA:CPU flushes them
ERF_DENORMAL = (GRID > -13.25) & (GRID < -12.9)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_activations_match_reference(approximate):
    keep = ~ERF_DENORMAL if approximate == "none" else np.ones(GRID.shape, bool)
    g = np.asarray(jax.jit(lambda x: jg.gelu_f32(x, approximate))(GRID))
    d = np.asarray(jax.jit(lambda x: jg.dgelu_f32(x, approximate))(GRID))
    np.testing.assert_array_equal(u8(g)[np.repeat(keep, 4)], u8(ref.gelu_f32(GRID, approximate))[np.repeat(keep, 4)])
    np.testing.assert_array_equal(u8(d)[np.repeat(keep, 4)], u8(ref.dgelu_f32(GRID, approximate))[np.repeat(keep, 4)])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_matches_reference(fmt, rng):
    v = special_values(rng)
    v = np.concatenate([v, np.nextafter(v, f32(np.inf)), np.nextafter(v, f32(-np.inf)), [np.nan, -np.nan]]).astype(f32)
    v = v[np.abs(v) >= 2.0 ** -126]  # denormal *products* are flushed, and are fp8 zero anyway
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: jn.cast_to_fp8(v, fmt))(v)),
                                  u8(ref.cast_to_fp8(v, fmt)))


def test_amax_is_exact_with_denormals_and_nan():
    x = np.array([1e-40, -3e-39, 0.0], f32)
    assert jn.amax(x) == f32(3e-39)
    assert np.isnan(jn.amax(np.array([1.0, np.nan, np.inf], f32)))
    assert jn.amax(np.array([1.0, -np.inf], f32)) == np.inf
    assert jn.amax(np.zeros((0, 4), f32)) == 0


def test_mul_is_rounded_once_with_denormal_operands(jax_device, rng):
    """jnp.mul is NumPy's float32 product bit for bit, denormal products included, with denormal
    operands (which XLA:CPU reads as 0) against normal ones up to 2**127, both orders, and random
    bit patterns."""
    n = 200_000
    den = (rng.integers(1, 2 ** 23, n, dtype=np.int64) | (rng.integers(0, 2, n, dtype=np.int64) << 31))
    den = den.astype(np.uint32).view(f32)
    big = (rng.uniform(1, 2, n) * np.exp2(rng.integers(60, 128, n)) * rng.choice([-1, 1], n)).astype(f32)
    anything = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(f32)
    a = np.concatenate([den, big, anything, den, f32([3e-39, 1e-45, -1e-45, 3e-39, 0.0, -0.0, np.inf])])
    b = np.concatenate([big, den, anything, den, f32([1.7e38, 2.0 ** 127, 2.0 ** 126, -0.0, 1e-40, np.inf, 1e-40])])
    put = lambda v: jax.device_put(v, jax_device)  # noqa: E731
    got = np.asarray(jax.jit(jn.mul)(put(a), put(b)))
    with np.errstate(over="ignore", invalid="ignore"):
        want = a * b
    normal = ~(np.abs(want) < f32(2.0 ** -126))  # normal, inf or NaN
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert (~normal & (want != 0)).sum() > 1000  # denormal products among them
    assert normal[:2 * n].mean() > 0.9  # the denormal-times-large cases are mostly normal products


def test_div_rn_is_ieee_division(jax_device):
    """jnp.div_rn is NumPy's float32 division bit for bit (XLA:GPU's `/` is div.full.f32, up to 2
    ulp off; XLA:CPU flushes denormal quotients): random bit patterns, denormals, specials, the
    scale rule's fmt_max / amax and 1 / scale; on the GPU a million random pairs more (the count
    of XLA:GPU's own misses is printed, not asserted)."""
    rng = np.random.default_rng(7)
    n = 200_000 if jax_device.platform == "cpu" else 1_000_000
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(f32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(f32)
    edge = np.array([0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38,
                     3.4028235e38, 1, 2, 3, 448, 57344, 0.5, 3163.3286, 4.6875, 0.9375], f32)
    ea, eb = (v.ravel() for v in np.meshgrid(edge, edge))
    denormal = rng.integers(1, 2**23, 20_000).astype(np.uint32).view(f32)
    normal = rng.standard_normal(20_000).astype(f32)
    a = np.concatenate([a, ea, np.full(20_000, 448, f32), np.ones(20_000, f32), denormal, normal])
    b = np.concatenate([b, eb, denormal, normal * f32(1e36), normal, denormal])
    if jax_device.platform != "cpu":
        a[:1000], b[:1000] = 448.0, rng.uniform(1e-6, 1e3, 1000).astype(f32)  # fmt_max / amax
    a, b = jax.device_put(a, jax_device), jax.device_put(b, jax_device)
    got = np.asarray(jax.jit(jn.div_rn)(a, b))
    a, b = np.asarray(a), np.asarray(b)
    with np.errstate(all="ignore"):
        want = a / b
    both_nan = np.isnan(got) & np.isnan(want)
    assert np.array_equal(got.view(np.uint32)[~both_nan], want.view(np.uint32)[~both_nan])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    # the denormal quotients that XLA:CPU's own division flushes are kept
    tiny = np.asarray(jax.jit(jn.div_rn)(*(jax.device_put(f32(v), jax_device) for v in (1.0, 3.4028235e38))))
    assert tiny == f32(1.0) / f32(3.4028235e38) and tiny > 0
    # an invalid operation gives CUDA's canonical NaN (x86's is 0xFFC00000)
    num, den = (jax.device_put(np.array(v, f32), jax_device)
                for v in ([0.0, -0.0, np.inf, -np.inf], [0.0, 0.0, np.inf, np.inf]))
    got = np.asarray(jax.jit(jn.div_rn)(num, den))
    assert (got.view(np.uint32) == 0x7FFFFFFF).all()
    if jax_device.platform != "cpu":
        xla = np.asarray(jax.jit(jnp.divide)(jax.device_put(a, jax_device), jax.device_put(b, jax_device)))
        keep = ~(np.isnan(got) & np.isnan(want))
        print(f"XLA:GPU '/' differs from IEEE on {(xla.view(np.uint32) != want.view(np.uint32))[keep].sum()} of "
              f"{keep.sum()}")


def test_div_rn_by_a_broadcast_divisor_keeps_denormal_ties(jax_device):
    """XLA turns a division by a broadcast divisor into a product with the divisor's reciprocal
    (two roundings, in float64 too). The one float32 quotient that can then round the wrong way
    is one exactly halfway between two denormals: (B * M) * 2**-149 / (2 * B), M odd, is
    M * 2**-150. Every such quotient of three divisors whose float64 reciprocal is inexact, each a
    scalar broadcast over the dividends, and the same dividends over a row of divisors."""
    for divisor in (49, 103, 237):
        m = np.arange(1, 2**24 // divisor, 2)
        a = ((divisor * m).astype(np.float64) * 2.0 ** -149).astype(f32)
        b = f32(2 * divisor)
        want = a / b
        assert (want.view(np.uint32) & 1 == 0).all()  # ties to even, the check's premise
        got = np.asarray(jax.jit(jn.div_rn)(jax.device_put(a, jax_device), jax.device_put(b, jax_device)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        rows = jax.device_put(a[:4096].reshape(-1, 1), jax_device)
        row = jax.device_put(np.array([[b, -b, 2 * b]], f32), jax_device)
        with np.errstate(all="ignore"):
            want = a[:4096].reshape(-1, 1) / np.asarray(row)
        np.testing.assert_array_equal(np.asarray(jax.jit(jn.div_rn)(rows, row)).view(np.uint32), want.view(np.uint32))
