"""Ragged and padded shapes on the GPU, byte for byte against the NumPy reference (issue 19.1, the
speed of a ragged token count): the tiled kernel's edge tiles take its vector path, decided per
thread row (16-byte loads for a row of 16 columns wholly inside, element loads where a row crosses
cols, nothing past rows; the pad's FP8 bytes masked to 0; q and q_t stored 16 bytes at a time
wherever the padded pitches allow), and a quantization padded in rows only, without q_t or dbias,
takes the flat kernel with the pad's zeros written by the same launch (npad).

The shapes put the edge where each of those paths starts: rows % 16 in {1, 2, 8, 15}, across a
row tile (128 rows) and between a thread's two rows of a tile (64 apart); cols a multiple of 16,
ragged with cols % 8 == 0 (a thread row that ends inside its 16 columns, 16-byte loads elsewhere)
and cols % 8 != 0 (element loads everywhere, stores still 16 bytes wide when padded), narrower
than a tile. Every input dtype, transpose on and off, dgelu with and without dbias, pad_to 1 and
16, and inputs that are not 16-byte aligned. (test_current_quantize.py covers the same edges in
the one-launch current-scaling kernels; tests/pytorch/test_ragged.py the padded bytes against the
unpadded ones and the layers; test_launch_shim.py which kernel each plan launches.)"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import fusedfp8
from fusedfp8.numerics import reference as ref
from support import shapes as S
from support.frameworks import bytes_of, np_dtype, to_np, to_torch

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]
SHAPES = [(129, 192), (66, 200), (200, 203), (79, 16), (271, 1000), (1, 72), (8190, 64), (15, 9), (130, 4096)]
OPS = [("identity", False), ("gelu", False), ("dgelu", False), ("dgelu", True)]


def seeded(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def run(op, x, b, scale, transpose, dbias, pad_to):
    if op == "identity":
        return fusedfp8.quantize(x, scale, "e4m3", transpose=transpose, pad_to=pad_to)
    if op == "gelu":
        return fusedfp8.gelu_quantize(x, scale, "e4m3", approximate="tanh", transpose=transpose, pad_to=pad_to)
    return fusedfp8.dgelu_quantize(x, b, scale, "e5m2", approximate="tanh", transpose=transpose, dbias=dbias,
                                   pad_to=pad_to)


def reference(op, xn, bn, scale, transpose, dbias):
    s = np.float32(scale)
    if op == "identity":
        return ref.quantize(xn, s, "e4m3", transpose)
    if op == "gelu":
        return ref.gelu_quantize(xn, s, "e4m3", "tanh", transpose)
    return ref.dgelu_quantize(xn, bn, s, "e5m2", "tanh", transpose, dbias)


def assert_matches(got, want, shape, pad_to, transpose, dbias, where):
    """q (and q_t) are the reference's bytes in the top-left corner of zeros of the padded shape;
    amax its bits; dbias within float32 summation order of its float64 sums."""
    rows, cols = shape
    prows, pcols = -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to
    q = want.data if pad_to == 1 else ref.pad2d(want.data.reshape(rows, cols), prows, pcols)
    assert tuple(got.data.shape) == q.shape, where
    assert bytes_of(got.data) == np.ascontiguousarray(q).tobytes(), f"{where}: q"
    assert bytes_of(got.amax) == np.float32(want.amax).tobytes(), f"{where}: amax"
    if transpose:
        q_t = want.data_t if pad_to == 1 else ref.pad2d(want.data_t, pcols, prows)
        assert bytes_of(got.data_t) == np.ascontiguousarray(q_t).tobytes(), f"{where}: q_t"
    else:
        assert got.data_t is None
    if dbias:
        assert got.dbias.shape == (cols,)
        np.testing.assert_allclose(to_np(got.dbias), want.dbias, rtol=2e-5, atol=1e-5 * float(
            np.nanmax(np.abs(want.dbias), initial=1.0)), err_msg=where)


def edge_input(rng, shape, dtype, fmt, edges=True):
    """S.make_input, with the edge values (NaN, inf, the FP8 boundaries, +-0, denormals) also in the
    last elements: the end of the last row, in the last row tile and column strip."""
    v = S.make_input(rng, shape, dtype, fmt, edges).reshape(-1)
    with np.errstate(over="ignore"):  # (1e30 in float16 is inf: an edge value too)
        e = S.edge_values(fmt).astype(v.dtype)
    if edges and v.size >= 2 * len(e):
        v[-len(e):] = e
    return v.reshape(shape)


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transpose"])
@pytest.mark.parametrize("op, dbias", OPS, ids=[o + ("-dbias" if d else "") for o, d in OPS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_edges_and_pads_are_the_reference(shape, dtype, op, dbias, transpose):
    """Inputs over many binades (with the edge values at the end, but for dbias, whose float32 sums
    of 1e30 and inf are order-dependent), then plain data at a scale where the bytes are meaningful;
    pad_to 1 and 16."""
    rng = seeded(shape, dtype, op, dbias, transpose)
    fmt = "e5m2" if op == "dgelu" else "e4m3"
    cases = [(edge_input(rng, shape, dtype, fmt, not dbias), edge_input(rng, shape, dtype, fmt, not dbias), 1.5)]
    if op == "dgelu":
        cases.append((rng.standard_normal(shape) * 1e-3, rng.standard_normal(shape) * 3, 2.0 ** 14))
    else:
        cases.append((rng.standard_normal(shape) * 4, None, 64.0))
    for i, (xn, bn, scale) in enumerate(cases):
        xn = np.asarray(xn, np.float32).astype(np_dtype(dtype))
        bn = None if op != "dgelu" else np.asarray(bn, np.float32).astype(np_dtype(dtype))
        want = reference(op, xn, bn, scale, transpose, dbias)
        x, b = to_torch(xn, "cuda"), None if bn is None else to_torch(bn, "cuda")
        s = torch.tensor([scale], dtype=torch.float32, device="cuda")
        for pad_to in (1, 16):
            got = run(op, x, b, s, transpose, dbias, pad_to)
            assert_matches(got, want, shape, pad_to, transpose, dbias, f"input {i}, pad_to={pad_to}")


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transpose"])
@pytest.mark.parametrize("op, dbias", OPS, ids=[o + ("-dbias" if d else "") for o, d in OPS])
@pytest.mark.parametrize("shape", [(129, 192), (271, 200), (8190, 64), (3, 16)], ids=lambda s: "x".join(map(str, s)))
def test_inputs_not_16_byte_aligned(shape, op, dbias, transpose):
    """x (and dy, x) one element past a 16-byte boundary: the tiled kernel loads every row element
    by element (vec = 0) and the flat kernel takes its element-wise variant (the pad's zeros byte
    by byte); the same bytes as the reference, and as the aligned inputs."""
    rng = seeded("unaligned", shape, op, dbias, transpose)
    n = shape[0] * shape[1]
    xn = edge_input(rng, (n + 1,), "bfloat16", "e4m3", not dbias)
    bn = edge_input(rng, (n + 1,), "bfloat16", "e4m3", not dbias)
    xa, ba = to_torch(xn, "cuda"), to_torch(bn, "cuda")
    x, b = xa[1:].view(shape), ba[1:].view(shape)
    assert x.data_ptr() % 16 != 0 and b.data_ptr() % 16 != 0
    want = reference(op, xn[1:].reshape(shape), bn[1:].reshape(shape), 1.5, transpose, dbias)
    s = torch.tensor([1.5], dtype=torch.float32, device="cuda")
    for pad_to in (1, 16):
        got = run(op, x, b, s, transpose, dbias, pad_to)
        assert_matches(got, want, shape, pad_to, transpose, dbias, f"unaligned, pad_to={pad_to}")
        aligned = run(op, x.contiguous().clone(), b.contiguous().clone(), s, transpose, dbias, pad_to)
        assert bytes_of(got.data) == bytes_of(aligned.data)
        if dbias:  # (full tiles sum y0 + y1 whatever the alignment: the same bits)
            assert bytes_of(got.dbias) == bytes_of(aligned.dbias)


def test_a_row_padded_plain_quantization_writes_zeros_over_a_dirty_pad():
    """The flat kernel's npad zeros overwrite whatever the pad rows held: two calls into buffers
    the allocator hands back dirty (a first call's bytes of 0xff in them) end with zeros there."""
    shape = (8190, 64)
    x = to_torch(np.full(shape, 448.0, np.float32).astype(np_dtype("bfloat16")), "cuda")
    s = torch.tensor([1.0], dtype=torch.float32, device="cuda")
    for _ in range(3):
        dirty = torch.full((8192 * 64,), 0xff, dtype=torch.uint8, device="cuda")
        del dirty
        got = fusedfp8.quantize(x, s, "e4m3", pad_to=16)
        q = to_np(got.data).view(np.uint8)
        assert q.shape == (8192, 64)
        assert (q[:8190] == 0x7e).all() and (q[8190:] == 0).all()  # 448 is E4M3's 0x7e
