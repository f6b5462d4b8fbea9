"""fusedfp8/numerics/constants.py and cuda_src/common.cuh hold the same float32 literals: both
files are parsed (not imported) and compared literal by literal, so an edited coefficient on one
side only fails here before any GPU run could show it."""
import ast
import math
import re
from pathlib import Path

import numpy as np
import pytest

import fusedfp8
from fusedfp8.numerics import constants

ROOT = Path(fusedfp8.__file__).resolve().parent
PY = (ROOT / "numerics" / "constants.py").read_text()
CUH = (ROOT.parent / "cuda_src" / "common.cuh").read_text()

FLOAT = r"-?(?:0x[0-9a-fA-F.]+p[+-]?\d+|\d+\.\d*(?:e[+-]?\d+)?)f"  # a C float literal (hex or decimal)
UINT = r"0x[0-9a-fA-F]+u"  # a C unsigned hex literal


def c_value(literal: str) -> np.float32:
    """The float32 value of a C float literal ('0x1.715476p+0f', '-87.0f', '3.402823466e38f')."""
    text = literal[:-1]
    return np.float32(float.fromhex(text) if "0x" in text.lower() else float(text))


def py_literals() -> dict:
    """name -> the literal text(s) of constants.py, read from its syntax tree: ``_hex("...")`` gives
    one hex string, ``tuple(_hex(h) for h in (...))`` a list, ``f32(-87.0)`` a number."""
    out = {}
    for node in ast.parse(PY).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name, v = node.targets[0].id, node.value
        if isinstance(v, ast.Call) and getattr(v.func, "id", None) == "_hex":
            out[name] = v.args[0].value
        elif isinstance(v, ast.Call) and getattr(v.func, "id", None) == "tuple":
            out[name] = [e.value for e in v.args[0].generators[0].iter.elts]
        elif isinstance(v, ast.Call) and getattr(v.func, "id", None) == "f32" and isinstance(v.args[0], ast.Constant):
            out[name] = repr(v.args[0].value)
        elif isinstance(v, ast.Call) and getattr(v.func, "id", None) == "f32" and isinstance(v.args[0], ast.UnaryOp):
            out[name] = "-" + repr(v.args[0].operand.value)
        elif (isinstance(v, ast.Call) and getattr(v.func, "attr", None) == "uint32"
              and isinstance(v.args[0], ast.Constant)):
            out[name] = int(v.args[0].value)  # an integer constant (a bit pattern)
        else:
            out[name] = None  # computed (FLT_MAX): compared by value below
    return out


def cuh_defines() -> dict:
    """NAME -> literal of every ``#define FF8_NAME <float literal>`` in common.cuh."""
    return {m.group(1): m.group(2) for m in re.finditer(rf"^#define FF8_(\w+) ({FLOAT})\s*$", CUH, re.M)}


def cuh_int_defines() -> dict:
    """NAME -> value of every ``#define FF8_NAME 0x...u`` (an unsigned bit pattern) in common.cuh."""
    return {m.group(1): int(m.group(2)[:-1], 16) for m in re.finditer(rf"^#define FF8_(\w+) ({UINT})\s*$", CUH, re.M)}


def cuh_function(name: str) -> str:
    m = re.search(rf"float {name}\([^)]*\) \{{(.*?)\n\}}", CUH, re.S)
    assert m, f"common.cuh has no function {name}"
    return m.group(1)


def cuh_polynomial(function: str) -> list[str]:
    """The coefficients of the Horner polynomial ``p`` of a common.cuh function, highest first."""
    body = cuh_function(function)
    first = re.search(rf"float p = ({FLOAT});", body).group(1)
    rest = re.findall(rf"p = ffma\(p, \w+, ({FLOAT})\);", body)
    return [first, *rest]


def same(py_hex: str, c_literal: str) -> bool:
    """The same literal text (C's trailing 'f' aside) and the same float32 bits."""
    text_ok = py_hex.lower() == c_literal[:-1].lower()
    bits_ok = np.float32(float.fromhex(py_hex)).tobytes() == c_value(c_literal).tobytes()
    return text_ok and bits_ok


PY_LITERALS = py_literals()
SCALARS = sorted(n for n, v in PY_LITERALS.items() if isinstance(v, str) and v.lower().lstrip("-").startswith("0x"))


def test_both_files_were_parsed():
    assert len(SCALARS) >= 9 and len(cuh_defines()) >= 9
    assert set(PY_LITERALS) >= {"LOG2E", "EXP2_POLY", "ERFC_POLY", "EXP_MIN_ARG", "FLT_MAX"}


@pytest.mark.parametrize("name", SCALARS)
def test_scalar_constant_is_the_same_literal(name):
    defines = cuh_defines()
    assert name in defines, f"common.cuh has no #define FF8_{name}"
    assert same(PY_LITERALS[name], defines[name]), (name, PY_LITERALS[name], defines[name])
    assert getattr(constants, name).tobytes() == c_value(defines[name]).tobytes()  # and the module's value


def test_every_float_define_of_the_header_is_in_constants_py():
    assert set(cuh_defines()) <= set(SCALARS), set(cuh_defines()) - set(SCALARS)


@pytest.mark.parametrize("name, function", [("EXP2_POLY", "pow2_poly"), ("ERFC_POLY", "erfc_of_abs")])
def test_polynomial_is_the_same_literals_in_the_same_order(name, function):
    py, cu = PY_LITERALS[name], cuh_polynomial(function)
    assert len(py) == len(cu), (py, cu)
    for k, (a, b) in enumerate(zip(py, cu)):
        assert same(a, b), (name, k, a, b)
    assert [v.tobytes() for v in getattr(constants, name)] == [c_value(c).tobytes() for c in cu]


INLINE = {  # constants written inline in a common.cuh function: (function, pattern of the literal)
    "EXP_MIN_ARG": ("exp_f32", rf"if \(HALF \? a > {FLOAT} : a < ({FLOAT})\) return 0\.0f;"),
    "EXP_HALF_MAX_ARG": ("exp_f32", rf"if \(HALF \? a > ({FLOAT}) : a < {FLOAT}\) return 0\.0f;"),
    "ERFC_MAX_ARG": ("gelu_erf", rf"fmin_nan\(fabs_bits\(x\), ({FLOAT})\)"),
}


@pytest.mark.parametrize("name", list(INLINE))
def test_inline_constant_is_the_same_literal(name):
    function, pattern = INLINE[name]
    found = re.search(pattern, cuh_function(function))
    assert found, f"common.cuh's {function} has no {pattern!r}"
    assert c_value(found.group(1)) == np.float32(float(PY_LITERALS[name])) == getattr(constants, name)


def test_integer_constants_are_the_same_bits():
    ints = {n: v for n, v in PY_LITERALS.items() if isinstance(v, int)}
    assert ints == cuh_int_defines()
    for name, v in ints.items():
        assert int(getattr(constants, name)) == v


def test_flt_max():
    flt_max = re.search(rf"0x7f800000u \? ({FLOAT}) : s;", CUH).group(1)  # scale_from_amax: inf -> FLT_MAX
    assert c_value(flt_max).tobytes() == constants.FLT_MAX.tobytes() == np.finfo(np.float32).max.tobytes()


def test_every_constant_of_constants_py_is_compared():
    """A constant added on one side only fails here: each name is a #define, a polynomial, an
    inline literal of a named function, or FLT_MAX."""
    covered = set(SCALARS) | {"EXP2_POLY", "ERFC_POLY", "FLT_MAX"} | set(INLINE) | set(cuh_int_defines())
    names = {n for n in PY_LITERALS if n.isupper()}
    assert names <= covered, names - covered


LOG2E64, S64 = 1 / math.log(2), math.sqrt(2 / math.pi)
DERIVED = {  # each constant is the float32 rounding of this float64 value
    "LOG2E": LOG2E64,
    "GELU_K2": -2 * S64 * LOG2E64,
    "GELU_KC1": -2 * S64 * 0.044715 * LOG2E64,
    "GELU_M0": 2 * S64,
    "GELU_M3": 2 * S64 * 3 * 0.044715,
    "ERFC_T_SCALE": 1 / (2 * math.sqrt(2)),
    "INV_SQRT_2PI": 1 / math.sqrt(2 * math.pi),
}


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_constant_is_the_rounded_exact_value(name):
    assert getattr(constants, name) == np.float32(DERIVED[name])


def test_log2e_split():
    """LOG2E + LOG2E_LO is 1 / ln 2 to float64 precision (the tail is the rounded remainder)."""
    assert constants.LOG2E_LO == np.float32(LOG2E64 - float(constants.LOG2E))
    assert abs(float(constants.LOG2E) + float(constants.LOG2E_LO) - LOG2E64) < 2.0 ** -49


def test_erfc_polynomial_is_one_at_t_one():
    """R(1) = 1 exactly in the float32 Horner evaluation, so erfc(0) = 1 and gelu'(0) = 0.5 exactly."""
    from fusedfp8.numerics.reference import fma_f32

    p = constants.ERFC_POLY[0]
    for c in constants.ERFC_POLY[1:]:
        p = fma_f32(p, np.float32(1.0), c)
    assert p == 1


def test_gelu_x_max_keeps_the_exponent_in_range():
    """At +-X_MAX the exponent b = x (K2 + KC1 x^2) stays inside [-125, 125] with margin, so 2**b,
    1 + 2**b and its reciprocal are normal floats; beyond it the float32 gelu' is 1 (or 0: the select)."""
    x = float(constants.GELU_X_MAX)
    b = x * (float(constants.GELU_K2) + float(constants.GELU_KC1) * x * x)
    assert -125 < b < -100
