"""The bad-input matrix (issue 8), on the CPU: every rejected call across fusedfp8.ops,
ScalingState / DelayedScaling and fusedfp8.pytorch raises the documented exception type, with a
message that names the argument and says what was expected and what came, and leaves every
state array of the world byte-identical (snapshotted before, compared after).

The world holds a numpy state, a torch state, an Fp8Linear and an Fp8MLP that have trained one
step and staged this step's amaxes, a linked model, and the inputs themselves (a call that
wrote an aliased output would change an input). A control test checks that accepted calls on
the same world do change the snapshot. GPU-only cases (a CPU scale for a GPU tensor, GEMM
dimensions not a multiple of 16) are at the end (a GPU world). fusedfp8.jax and its flax modules
have their own matrix (tests/jax/test_jax_bad_input.py)."""
from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import fusedfp8.pytorch as fp8
from fusedfp8 import ops
from fusedfp8.pytorch import scaling as fp8_scaling
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState
from support.frameworks import bytes_of

R = DelayedScaling(amax_history_len=8)
R_OTHER = DelayedScaling(amax_history_len=16)


def _bytes(a) -> bytes:
    if isinstance(a, torch.Tensor):
        if a.device.type == "meta":
            return repr((a.shape, a.dtype)).encode()
        t = a.detach().contiguous()
        return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return np.ascontiguousarray(np.asarray(a)).tobytes()


class World:
    """Everything a bad call could touch, with non-trivial values in every state array. Built
    once; each case gets a deep copy (``World.fresh()``)."""

    _template = None

    @classmethod
    def fresh(cls) -> "World":
        if cls._template is None:
            cls._template = cls()
        w = copy.deepcopy(cls._template)
        for m in (w.linear, w.mlp, w.model):  # a copy is unlinked (states of its own): link it again, as
            fp8_scaling._groups(fp8.fp8_modules(m))  # update_model_scales does, without updating anything
        return w

    def __init__(self):
        rng = np.random.default_rng(0)
        torch.manual_seed(0)
        self.x_np = (rng.standard_normal((4, 8)) * 10).astype(np.float32)
        self.x_t = torch.from_numpy(self.x_np.copy())
        self.scale_np = np.array([2.0], np.float32)
        self.scale_t = torch.tensor([2.0])
        self.amax_np = np.zeros(1, np.float32)
        self.amax_t = torch.zeros(1)
        self.np_state = ScalingState.create((False, True), R)
        self.np_state.amax_history[...] = np.abs(rng.standard_normal((8, 2))).astype(np.float32)
        self.np_state.scale[...] = [3.0, 5.0]
        self.np_state.scale_inv[...] = 1 / self.np_state.scale
        self.np_state.updates[...] = [4, 4]
        self.t_state = ScalingState.create((False, True), R, like=torch.zeros(0))
        self.t_state.amax_history.copy_(torch.from_numpy(self.np_state.amax_history))
        self.t_state.scale.copy_(torch.tensor([3.0, 5.0]))
        self.linear = fp8.Fp8Linear(16, 16, recipe=R)
        self.mlp = fp8.Fp8MLP(16, 32, R)
        self.model = nn.Sequential(fp8.Fp8Linear(16, 32, recipe=R), fp8.Fp8Linear(32, 16, recipe=R))
        for m in (self.linear, self.mlp, self.model):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            fp8.update_model_scales(m)  # links the model's states
            with torch.no_grad():
                m(torch.randn(8, 16) * 3)  # stages this step's amaxes (row 0 non-zero)

    def arrays(self) -> list:
        out = [self.x_np, self.x_t, self.scale_np, self.scale_t, self.amax_np, self.amax_t]
        for st in (self.np_state, self.t_state):
            out += [getattr(st, f) for f in STATE_FIELDS]
        for m in (self.linear, self.mlp, self.model):
            out += list(m.state_dict().values())
        return out

    def snapshot(self) -> list[bytes]:
        return [_bytes(a) for a in self.arrays()]


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _sabotage(w: World, state: ScalingState, **arrays) -> ScalingState:
    """A copy of ``state`` with some arrays replaced, bypassing validation (as a caller that
    mutates a state's fields after construction would)."""
    bad = copy.copy(state)
    for name, value in arrays.items():  # (a slots dataclass: no __dict__ to update)
        object.__setattr__(bad, name, value)
    return bad


def _ln_weight(w: World) -> np.ndarray:
    """A (8,) float32 weight kept on the world (so that an amax viewing it is the same memory)."""
    if not hasattr(w, "ln_weight"):
        w.ln_weight = np.ones(8, np.float32)
    return w.ln_weight


def _ste(w: World, x, state=None, index=0, recipe=R):
    return fp8.quantize_ste(x, w.t_state if state is None else state, index, recipe)


# (id, setup(world) -> thunk, exception, message regex). The setup may sabotage the world; the
# snapshot is taken after it, right before the thunk runs.
CASES = [
    # ---- fusedfp8.ops: inputs ----------------------------------------------------------------
    ("quantize-x-float64", lambda w: lambda: ops.quantize(w.x_np.astype(np.float64), w.scale_np, amax=w.amax_np),
     TypeError, r"^x must be float32, float16 or bfloat16; got float64"),
    ("quantize-x-numpy-negative-stride", lambda w: lambda: ops.quantize(w.x_np[::-1], w.scale_np, amax=w.amax_np),
     ValueError, r"^x must be contiguous \(row-major\); got a non-contiguous view of shape \(4, 8\)"),
    ("quantize-x-numpy-negative-stride-1d", lambda w: lambda: ops.quantize(w.x_np.reshape(-1)[::-3], w.scale_np,
                                                                             amax=w.amax_np),
     ValueError, r"^x must be contiguous .*shape \(11,\)"),
    ("gelu-x-torch-transposed-view", lambda w: lambda: ops.gelu_quantize(w.x_t.t(), w.scale_t, amax=w.amax_t),
     ValueError, r"^x must be contiguous .*shape \(8, 4\)"),
    ("gelu-x-meta", lambda w: lambda: ops.gelu_quantize(torch.ones(4, 8, device="meta"), torch.ones(1, device="meta")),
     ValueError, r"^x: fusedfp8 runs on CUDA or CPU tensors; got a tensor on meta"),
    ("quantize-scale-meta", lambda w: lambda: ops.quantize(w.x_t, torch.ones(1, device="meta"), amax=w.amax_t),
     ValueError, r"^scale: fusedfp8 runs on CUDA or CPU tensors; got a tensor on meta"),
    ("quantize-torch-x-numpy-scale", lambda w: lambda: ops.quantize(w.x_t, w.scale_np, amax=w.amax_t),
     TypeError, r"^scale is a numpy array but the input is a torch array"),
    ("quantize-numpy-x-torch-amax", lambda w: lambda: ops.quantize(w.x_np, w.scale_np, amax=w.amax_t),
     TypeError, r"^amax is a torch array but the input is a numpy array"),
    ("quantize-scale-int32", lambda w: lambda: ops.quantize(w.x_t, torch.ones(1, dtype=torch.int32), amax=w.amax_t),
     TypeError, r"^scale must be a float32 array; got int32"),
    ("quantize-amax-aliases-x-numpy", lambda w: lambda: ops.quantize(w.x_np, w.scale_np, amax=w.x_np.reshape(-1)[5:6]),
     ValueError, r"^amax overlaps the input's memory; it is written in place"),
    ("quantize-amax-aliases-x-torch", lambda w: lambda: ops.quantize(w.x_t, w.scale_t, amax=w.x_t.view(-1)[31:]),
     ValueError, r"^amax overlaps the input's memory"),
    ("quantize-amax-aliases-scale", lambda w: lambda: ops.quantize(w.x_t, w.scale_t, amax=w.scale_t),
     ValueError, r"^amax overlaps scale's memory"),
    ("quantize-amax-read-only", lambda w: lambda: ops.quantize(w.x_np, w.scale_np, amax=_ro(np.zeros(1, np.float32))),
     ValueError, r"^amax is a read-only numpy array; it is written in place"),
    ("quantize-unknown-format", lambda w: lambda: ops.quantize(w.x_np, w.scale_np, "e4m3fnuz", amax=w.amax_np),
     ValueError, r"^fmt: unsupported FP8 format 'e4m3fnuz'; expected one of 'e4m3', 'e5m2'"),
    ("quantize-other-fp8-dtype-object", lambda w: lambda: ops.quantize(w.x_t, w.scale_t, torch.float8_e4m3fnuz,
                                                                          amax=w.amax_t),
     ValueError, r"^fmt: unsupported FP8 format torch\.float8_e4m3fnuz; expected one of 'e4m3', 'e5m2', 'e4m3fn'"),
    ("quantize-ieee-e4m3-dtype", lambda w: lambda: ops.quantize(w.x_np, w.scale_np, ml_dtypes.float8_e4m3, amax=w.amax_np),
     ValueError, r"^fmt: unsupported FP8 format <class 'ml_dtypes\.float8_e4m3'>; expected one of"),
    ("quantize-transpose-of-a-scalar", lambda w: lambda: ops.quantize(w.x_t[0, 0].clone(), w.scale_t, amax=w.amax_t,
                                                                         transpose=True),
     ValueError, r"^x: transpose=True needs an input of at least 1 dimension; got a scalar"),
    ("dgelu-shapes-differ", lambda w: lambda: ops.dgelu_quantize(w.x_np, w.x_np.T.copy(), w.scale_np, amax=w.amax_np),
     ValueError, r"^dy and x must have the same shape; got \(4, 8\) and \(8, 4\)"),
    ("dgelu-x-negative-stride", lambda w: lambda: ops.dgelu_quantize(w.x_np, w.x_np[:, ::-1], w.scale_np,
                                                                       amax=w.amax_np),
     ValueError, r"^x must be contiguous"),
    ("dgelu-dbias-of-a-scalar", lambda w: lambda: ops.dgelu_quantize(w.x_np[0, 0].copy(), w.x_np[0, 1].copy(),
                                                                       w.scale_np, amax=w.amax_np, dbias=True),
     ValueError, r"^dy: transpose / dbias need an input of at least 1 dimension; got a scalar"),
    ("dequantize-q-float32", lambda w: lambda: ops.dequantize(w.x_t, w.scale_t),
     TypeError, r"^q must be a float8_e4m3fn / float8_e5m2 array \(or uint8 with a format\); got float32"),
    ("dequantize-q-numpy-negative-stride",
     lambda w: lambda: ops.dequantize(np.zeros(8, ml_dtypes.float8_e4m3fn)[::-1], w.scale_np),
     ValueError, r"^q must be contiguous; got a non-contiguous view of shape \(8,\)"),
    ("dequantize-scale_inv-meta",
     lambda w: lambda: ops.dequantize(torch.zeros(4).to(torch.float8_e5m2), torch.ones(1, device="meta")),
     ValueError, r"^scale_inv: fusedfp8 runs on CUDA or CPU tensors; got a tensor on meta"),
    ("dequantize-dtype-float64", lambda w: lambda: ops.dequantize(torch.zeros(4).to(torch.float8_e4m3fn), w.scale_t,
                                                                   "float64"),
     ValueError, r"^dtype must be one of \('float32', 'float16', 'bfloat16'\); got 'float64'"),
    # ---- fusedfp8.ops: layernorm_quantize ----------------------------------------------------
    ("ln-x-float64", lambda w: lambda: ops.layernorm_quantize(w.x_np.astype(np.float64), None, None, 1e-5, w.scale_np,
                                                              amax=w.amax_np),
     TypeError, r"^x must be float32, float16 or bfloat16; got float64"),
    ("ln-x-scalar", lambda w: lambda: ops.layernorm_quantize(w.x_np[0, 0].copy(), None, None, 1e-5, w.scale_np),
     ValueError, r"^x: layernorm_quantize needs an input of at least 1 dimension; got a scalar"),
    ("ln-x-empty-last-dimension", lambda w: lambda: ops.layernorm_quantize(w.x_np[:, :0].copy(), None, None, 1e-5,
                                                                           w.scale_np, amax=w.amax_np),
     ValueError, r"^x: layernorm_quantize normalises over the last dimension, which must not be empty; got shape "
                 r"\(4, 0\)"),
    ("ln-x-negative-stride", lambda w: lambda: ops.layernorm_quantize(w.x_np[::-1], None, None, 1e-5, w.scale_np),
     ValueError, r"^x must be contiguous \(row-major\)"),
    ("ln-weight-wrong-length", lambda w: lambda: ops.layernorm_quantize(w.x_np, np.ones(4, np.float32), None, 1e-5,
                                                                        w.scale_np, amax=w.amax_np),
     ValueError, r"^weight must have shape \(8,\) \(the last dimension of x\); got \(4,\)"),
    ("ln-bias-2d", lambda w: lambda: ops.layernorm_quantize(w.x_t, None, torch.zeros(1, 8), 1e-5, w.scale_t,
                                                            amax=w.amax_t),
     ValueError, r"^bias must have shape \(8,\) \(the last dimension of x\); got \(1, 8\)"),
    ("ln-weight-int32", lambda w: lambda: ops.layernorm_quantize(w.x_t, torch.ones(8, dtype=torch.int32), None, 1e-5,
                                                                 w.scale_t, amax=w.amax_t),
     TypeError, r"^weight must be float32, float16 or bfloat16; got int32"),
    ("ln-bias-torch-x-numpy", lambda w: lambda: ops.layernorm_quantize(w.x_np, None, torch.zeros(8), 1e-5, w.scale_np,
                                                                       amax=w.amax_np),
     TypeError, r"^bias is a torch array but the input is a numpy array"),
    ("ln-weight-meta", lambda w: lambda: ops.layernorm_quantize(w.x_t, torch.ones(8, device="meta"), None, 1e-5,
                                                                w.scale_t, amax=w.amax_t),
     ValueError, r"^weight: fusedfp8 runs on CUDA or CPU tensors; got a tensor on meta"),
    ("ln-weight-and-bias-dtypes-differ",
     lambda w: lambda: ops.layernorm_quantize(w.x_t, torch.ones(8), torch.zeros(8, dtype=torch.float16), 1e-5,
                                              w.scale_t, amax=w.amax_t),
     TypeError, r"^weight and bias must have the same dtype; got float32 and float16"),
    ("ln-bias-strided", lambda w: lambda: ops.layernorm_quantize(w.x_t, None, torch.zeros(16)[::2], 1e-5, w.scale_t,
                                                                 amax=w.amax_t),
     ValueError, r"^bias must be contiguous; got a non-contiguous view of shape \(8,\)"),
    ("ln-eps-negative", lambda w: lambda: ops.layernorm_quantize(w.x_np, None, None, -1e-5, w.scale_np, amax=w.amax_np),
     ValueError, r"^eps must be a finite number >= 0 \(and finite as float32\); got -1e-05"),
    ("ln-eps-nan", lambda w: lambda: ops.layernorm_quantize(w.x_t, None, None, float("nan"), w.scale_t, amax=w.amax_t),
     ValueError, r"^eps must be a finite number >= 0 .*; got nan"),
    ("ln-eps-beyond-float32", lambda w: lambda: ops.layernorm_quantize(w.x_t, None, None, 1e39, w.scale_t,
                                                                       amax=w.amax_t),
     ValueError, r"^eps must be a finite number >= 0 \(and finite as float32\); got 1e\+39"),
    ("ln-eps-a-tensor", lambda w: lambda: ops.layernorm_quantize(w.x_t, None, None, torch.tensor(1e-5), w.scale_t,
                                                                 amax=w.amax_t),
     TypeError, r"^eps must be a real number \(a Python or NumPy float\); got torch\.Tensor"),
    ("ln-eps-bool", lambda w: lambda: ops.layernorm_quantize(w.x_np, None, None, True, w.scale_np, amax=w.amax_np),
     TypeError, r"^eps must be a real number .*; got builtins\.bool"),
    ("ln-amax-aliases-weight", lambda w: lambda: ops.layernorm_quantize(w.x_np, _ln_weight(w), None, 1e-5, w.scale_np,
                                                                        amax=_ln_weight(w)[3:4]),
     ValueError, r"^amax overlaps weight's memory; it is written in place, so it must not alias weight"),
    ("ln-state-aliases-bias", lambda w: lambda: ops.layernorm_quantize(
        w.x_np, None, w.np_state.amax_history.reshape(-1)[:8], 1e-5, w.np_state.slot(0, R)),
     ValueError, r"^state\.amax_history overlaps bias's memory; it is written in place"),
    ("ln-amax-aliases-x", lambda w: lambda: ops.layernorm_quantize(w.x_t, None, None, 1e-5, w.scale_t,
                                                                   amax=w.x_t.view(-1)[3:4]),
     ValueError, r"^amax overlaps the input's memory"),
    ("ln-slot-format-disagrees", lambda w: lambda: ops.layernorm_quantize(w.x_np, None, None, 1e-5,
                                                                          w.np_state.slot(0, R), "e5m2"),
     ValueError, r"^fmt: 'e5m2' disagrees with the slot's recipe format 'e4m3'; leave fmt=None with a slot"),
    ("ln-transpose-of-a-scalar", lambda w: lambda: ops.layernorm_quantize(w.x_t[0, 0].clone(), None, None, 1e-5,
                                                                          w.scale_t, transpose=True),
     ValueError, r"^x: transpose=True needs an input of at least 1 dimension; got a scalar"),
    # ---- fusedfp8.ops: slots and update_scales -----------------------------------------------
    ("slot-of-a-read-only-numpy-state",
     lambda w: lambda: ops.quantize(w.x_np, _sabotage(w, w.np_state,
                                                      amax_history=_ro(w.np_state.amax_history.copy())).slot(0, R)),
     ValueError, r"^state\.amax_history is a read-only numpy array; it is written in place"),
    ("slot-history-of-the-wrong-length", lambda w: lambda: ops.quantize(w.x_np, w.np_state.slot(0, R_OTHER)),
     ValueError, r"^ScalingState\.amax_history has 8 rows but the recipe's amax_history_len is 16"),
    ("slot-index-out-of-range", lambda w: lambda: ops.quantize(w.x_t, w.t_state.slot(2, R)),
     IndexError, r"^index must be in \[0, 2\); got 2"),
    ("slot-recipe-not-a-recipe", lambda w: lambda: ops.quantize(w.x_t, w.t_state.slot(0, "hybrid")),
     TypeError, r"^recipe must be a fusedfp8\.DelayedScaling or a fusedfp8\.CurrentScaling; got str"),
    ("slot-numpy-state-torch-x", lambda w: lambda: ops.quantize(w.x_t, w.np_state.slot(0, R)),
     TypeError, r"^state\.scale is a numpy array but the input is a torch array"),
    ("update-history-of-the-wrong-length", lambda w: lambda: ops.update_scales(w.t_state, R_OTHER),
     ValueError, r"^ScalingState\.amax_history has 8 rows but the recipe's amax_history_len is 16"),
    ("update-recipe-not-a-recipe", lambda w: lambda: ops.update_scales(w.np_state, {"margin": 0}),
     TypeError, r"^recipe must be a fusedfp8\.DelayedScaling or a fusedfp8\.CurrentScaling; got dict"),
    ("update-read-only-numpy-state",  # (used to roll the history, then fail on the scale: half written)
     lambda w: (lambda bad: lambda: ops.update_scales(bad, R))(
         _sabotage(w, w.np_state, scale=_ro(w.np_state.scale))),
     ValueError, r"^ScalingState\.scale is a read-only numpy array; the update writes the state in place"),
    ("update-negative-stride-history",
     lambda w: (lambda bad: lambda: ops.update_scales(bad, R))(
         _sabotage(w, w.np_state, amax_history=w.np_state.amax_history[::-1])),
     ValueError, r"^state\.amax_history must be contiguous; got a non-contiguous view of shape \(8, 2\)"),
    ("update-linked-module-view-of-the-model-state",
     lambda w: lambda: ops.update_scales(w.model[1].fp8_state, R),
     ValueError, r"^state\.amax_history must be contiguous; got a non-contiguous view of shape \(8, 3\)"),
    ("update-mismatched-state-shapes",
     lambda w: (lambda bad: lambda: ops.update_scales(bad, R))(
         _sabotage(w, w.np_state, scale=np.ones(3, np.float32))),
     ValueError, r"^ScalingState\.scale has 3 tensors \(last dim\) but grad has 2"),
    ("update-state-array-wrong-dtype",
     lambda w: (lambda bad: lambda: ops.update_scales(bad, R))(
         _sabotage(w, w.t_state, overflows=torch.zeros(2, dtype=torch.int64))),
     TypeError, r"^ScalingState\.overflows must be int32; got int64"),
    ("update-state-array-on-meta",
     lambda w: (lambda bad: lambda: ops.update_scales(bad, R))(
         _sabotage(w, w.t_state, scale=torch.ones(2, device="meta"))),
     ValueError, r"^state\.scale: fusedfp8 runs on CUDA or CPU tensors; got a tensor on meta"),
    ("update-torch-and-numpy-state-arrays",
     lambda w: (lambda bad: lambda: ops.update_scales(bad, R))(
         _sabotage(w, w.t_state, scale_inv=np.ones(2, np.float32))),
     TypeError, r"^ScalingState\.scale_inv is a numpy array but amax_history is a torch array"),
    # ---- ScalingState / DelayedScaling -------------------------------------------------------
    ("state-history-columns-disagree", lambda w: lambda: ScalingState(
        np.zeros((8, 3), np.float32), np.ones(2, np.float32), np.ones(2, np.float32), np.zeros(2, np.int32),
        np.zeros(2, np.int32), grad=(False, True)),
     ValueError, r"^ScalingState\.amax_history has 3 tensors \(last dim\) but grad has 2"),
    ("state-history-1d", lambda w: lambda: ScalingState(
        np.zeros(8, np.float32), np.ones(2, np.float32), np.ones(2, np.float32), np.zeros(2, np.int32),
        np.zeros(2, np.int32), grad=(False, True)),
     ValueError, r"^ScalingState\.amax_history must be 2-D; got shape \(8,\)"),
    ("state-create-zero-tensors", lambda w: lambda: ScalingState.create(0, R),
     ValueError, r"^grad: the number of tensors must be >= 1; got 0"),
    ("recipe-negative-margin", lambda w: lambda: DelayedScaling(margin=-1),
     ValueError, r"^DelayedScaling\.margin must be a finite number >= 0; got -1"),
    ("recipe-nan-margin", lambda w: lambda: DelayedScaling(margin=float("nan")),
     ValueError, r"^DelayedScaling\.margin must be a finite number >= 0; got nan"),
    ("recipe-history-length-0", lambda w: lambda: DelayedScaling(amax_history_len=0),
     ValueError, r"^DelayedScaling\.amax_history_len must be >= 1; got 0"),
    ("recipe-unknown-format", lambda w: lambda: DelayedScaling(fp8_format="e5m2"),
     ValueError, r"^DelayedScaling\.fp8_format must be one of \('hybrid', 'e4m3'\); got 'e5m2'"),
    ("recipe-e5m2-dtype-object", lambda w: lambda: DelayedScaling(fp8_format=torch.float8_e5m2),
     ValueError, r"^DelayedScaling\.fp8_format must be one of \('hybrid', 'e4m3'\); got torch\.float8_e5m2; E5M2 "),
    ("recipe-unknown-algo", lambda w: lambda: DelayedScaling(amax_compute_algo="mean"),
     ValueError, r"^DelayedScaling\.amax_compute_algo must be one of \('max', 'most_recent'\); got 'mean'"),
    # ---- fusedfp8.pytorch --------------------------------------------------------------------
    ("linear-input-float64", lambda w: lambda: w.linear(torch.ones(4, 16, dtype=torch.float64)),
     TypeError, r"^Fp8Linear: input must be float32, float16 or bfloat16; got torch\.float64"),
    ("linear-input-numpy", lambda w: lambda: w.linear(np.ones((4, 16), np.float32)),
     TypeError, r"^Fp8Linear: input must be a torch\.Tensor; got ndarray"),
    ("linear-input-on-meta", lambda w: lambda: w.linear(torch.ones(4, 16, device="meta")),
     ValueError, r"^Fp8Linear: input is on meta but the weight is on cpu"),
    ("linear-wrong-features", lambda w: lambda: w.model(torch.ones(4, 15)),
     ValueError, r"^Fp8Linear: input must have 16 features in its last dimension; got shape \(4, 15\)"),
    ("linear-weight-float64", lambda w: (w.linear.double(), lambda: w.linear(torch.ones(4, 16)))[1],
     TypeError, r"^Fp8Linear: weight must be float32, float16 or bfloat16; got torch\.float64"),
    ("linear-state-from-another-recipe", lambda w: lambda: w.linear.load_state_dict(
        fp8.Fp8Linear(16, 16, recipe=R_OTHER).state_dict()),
     ValueError, r"'amax_history' has shape \(16, 3\) but this module's recipe has amax_history_len=8, so the state "
                 r"must be \(8, 3\); build the module with DelayedScaling\(amax_history_len=16\)"),
    ("mlp-state-from-another-recipe", lambda w: lambda: w.mlp.load_state_dict(fp8.Fp8MLP(16, 32, R_OTHER).state_dict()),
     ValueError, r"'fc1\.amax_history' has shape \(16, 3\) but this module's recipe has amax_history_len=8"),
    ("linear-state-of-a-plain-linear", lambda w: lambda: w.linear.load_state_dict(nn.Linear(16, 16).state_dict()),
     ValueError, r"^Fp8Linear\.load_state_dict: the state dict has no FP8 state \['amax_history', 'scale', "
                 r"'scale_inv', 'overflows', 'updates'\] \(one of a plain nn\.Linear\?\); nothing was loaded"),
    ("mlp-state-of-a-plain-mlp", lambda w: lambda: w.mlp.load_state_dict(
        {k: v for k, v in w.mlp.state_dict().items() if k.split(".")[-1] in ("weight", "bias")}),
     ValueError, r"^Fp8Linear\.load_state_dict: the state dict has no FP8 state \['fc1\.amax_history',"),
    ("mlp-input-int32", lambda w: lambda: w.mlp(torch.ones(4, 16, dtype=torch.int32)),
     TypeError, r"^Fp8MLP: input must be float32, float16 or bfloat16; got torch\.int32"),
    ("mlp-fc1-fc2-recipes-differ",
     lambda w: (setattr(w.mlp, "fc2", fp8.Fp8Linear(32, 16, recipe=R_OTHER)), lambda: w.mlp(torch.ones(4, 16)))[1],
     ValueError, r"^Fp8MLP: fc1 and fc2 must share one recipe; got DelayedScaling\(.*amax_history_len=8.*\) and "
                 r"DelayedScaling\(.*amax_history_len=16"),
    ("mlp-approximate-unknown", lambda w: lambda: fp8.Fp8MLP(16, 32, R, approximate="fast"),
     ValueError, r"^approximate must be 'tanh' or 'none'; got 'fast'"),
    ("linear-recipe-not-a-recipe", lambda w: lambda: fp8.Fp8Linear(16, 16, recipe="hybrid"),
     TypeError, r"^recipe must be a fusedfp8\.DelayedScaling, a fusedfp8\.CurrentScaling or a fusedfp8\.BlockScaling; "
     r"got str"),
    ("convert-recipe-not-a-recipe", lambda w: lambda: fp8.convert_to_fp8(nn.Sequential(nn.Linear(4, 4)), "e4m3"),
     TypeError, r"^recipe must be a fusedfp8\.DelayedScaling, a fusedfp8\.CurrentScaling or a fusedfp8\.BlockScaling; "
     r"got str"),
    ("convert-missed-update-unknown", lambda w: lambda: fp8.convert_to_fp8(nn.Linear(4, 4), missed_update="loud"),
     ValueError, r"^missed_update must be one of \('raise', 'warn', 'ignore'\); got 'loud'"),
    ("update-scales-model-without-fp8", lambda w: lambda: fp8.update_model_scales(nn.Sequential(nn.Linear(4, 4))),
     ValueError, r"^model: Sequential holds no Fp8Linear / Fp8MLP module"),
    ("update-scales-module-buffer-wrong-dtype",
     lambda w: (w.linear.register_buffer("scale", w.linear.scale.double()),
                lambda: fp8.update_model_scales(w.linear))[1],
     TypeError, r"^ScalingState\.scale must be float32; got float64"),
    ("quantize-ste-history-of-the-wrong-length", lambda w: lambda: _ste(w, w.x_t, recipe=R_OTHER),
     ValueError, r"^ScalingState\.amax_history has 8 rows but the recipe's amax_history_len is 16"),
    ("quantize-ste-recipe-not-a-recipe", lambda w: lambda: _ste(w, w.x_t, recipe="hybrid"),
     TypeError, r"^recipe must be a fusedfp8\.DelayedScaling or a fusedfp8\.CurrentScaling; got str"),
    ("quantize-ste-x-int32", lambda w: lambda: _ste(w, w.x_t.int()),
     TypeError, r"^x must be float32, float16 or bfloat16; got int32"),
    ("quantize-ste-index-out-of-range", lambda w: lambda: _ste(w, w.x_t, index=-1),
     IndexError, r"^index must be in \[0, 2\); got -1"),
    ("quantize-ste-numpy-state", lambda w: lambda: _ste(w, w.x_t, state=w.np_state),
     TypeError, r"^state\.scale is a numpy array but the input is a torch array"),
    ("quantize-ste-x-on-meta", lambda w: lambda: _ste(w, torch.ones(4, 8, device="meta")),
     ValueError, r"^x: fusedfp8 runs on CUDA or CPU tensors; got a tensor on meta"),
    ("quantize-ste-x-numpy", lambda w: lambda: _ste(w, w.x_np), TypeError, r"^x: expected a .*torch"),
]


def _param(case):
    if hasattr(case, "marks"):  # already a pytest.param
        return pytest.param(*case.values, id=case.values[0], marks=case.marks)
    return pytest.param(*case, id=case[0])


@pytest.mark.parametrize("name, setup, exc, match", [_param(c) for c in CASES])
def test_bad_input_is_refused_by_name_and_changes_no_state(name, setup, exc, match):
    w = World.fresh()
    call = setup(w)
    before = w.snapshot()
    with pytest.raises(exc, match=match):
        call()
    after = w.snapshot()
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(before) == len(after) and not changed, f"{name}: arrays {changed} changed"


def test_the_matrix_has_at_least_25_cases():
    assert len(CASES) >= 25


def test_accepted_calls_on_the_same_world_do_change_the_snapshot():
    """The control: the snapshot sees writes to the inputs, the amax outputs, both states and the
    modules' buffers."""
    checks = [
        lambda w: ops.quantize(w.x_np, w.scale_np, amax=w.amax_np),
        lambda w: ops.quantize(w.x_t, w.scale_t, amax=w.amax_t),
        lambda w: ops.quantize(w.x_np, w.np_state.slot(1, R)),
        lambda w: ops.layernorm_quantize(w.x_t * 100, None, None, 1e-5, w.t_state.slot(0, R)),  # stages amax(y)
        lambda w: ops.update_scales(w.np_state, R),
        lambda w: ops.update_scales(w.t_state, R),
        lambda w: w.linear(torch.ones(4, 16) * 1e3),
        lambda w: w.mlp(torch.randn(4, 16)).sum().backward(),  # stages the gradients' amaxes
        lambda w: fp8.update_model_scales(w.model),
        lambda w: w.x_t.view(-1)[31:].fill_(1e3),  # an aliased write would show in the input
    ]
    for k, fn in enumerate(checks):
        w = World.fresh()
        before = w.snapshot()
        fn(w)
        assert w.snapshot() != before, k


def test_read_only_update_used_to_half_write_the_state():
    """The fixed bug behind 'update-read-only-numpy-state': the history of a writable column is
    untouched, and after making the state writable the same update runs normally."""
    w = World.fresh()
    st = w.np_state
    hist = st.amax_history.copy()
    st.scale.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ops.update_scales(st, R)
    assert st.amax_history.tobytes() == hist.tobytes()
    st.scale.flags.writeable = True
    ops.update_scales(st, R)
    assert st.amax_history[1:].tobytes() != hist[1:].tobytes() and st.updates.tolist() == [5, 5]


DEV = "cuda"


# ---- bad input that needs a GPU (skipped with the probe's reason elsewhere) ------------------
class GpuWorld:
    """The GPU twin of World: a CUDA state, a CPU state, modules on the GPU (one with in_features
    40, one MLP with ffn 40: not multiples of 16)."""

    def __init__(self):
        g = torch.Generator(device=DEV).manual_seed(0)
        self.x = torch.randn(64, 64, device=DEV, generator=g)
        self.scale = torch.full((1,), 2.0, device=DEV)
        self.state = ScalingState.create((False, True), R, like=torch.zeros(1, device=DEV))
        self.state.amax_history.uniform_(0.5, 2.0, generator=g)
        self.cpu_state = ScalingState.create((False, True), R, like=torch.zeros(0))
        self.q = ops.quantize(self.x, self.scale).data
        self.linear = fp8.Fp8Linear(40, 64, recipe=R, device=DEV)
        self.linear64 = fp8.Fp8Linear(64, 64, recipe=R, device=DEV)
        self.mlp = fp8.Fp8MLP(64, 40, R, device=DEV)
        for m in (self.linear, self.linear64, self.mlp):
            for name, buf in m.named_buffers():
                if buf.dtype == torch.float32:
                    buf.uniform_(0.5, 2.0, generator=g)

    def snapshot(self):
        arrays = [self.x, self.scale, self.q] + [getattr(s, f) for s in (self.state, self.cpu_state)
                                                  for f in STATE_FIELDS]
        for m in (self.linear, self.linear64, self.mlp):
            arrays += list(m.state_dict().values())
        torch.cuda.synchronize()
        return [bytes_of(a) for a in arrays]


def _split(w: "GpuWorld") -> ScalingState:
    bad = ScalingState.create((False, True), R, like=torch.zeros(1, device=DEV))
    object.__setattr__(bad, "scale", torch.ones(2))  # one array on the CPU (bypassing validation)
    return bad


GPU_CASES = [
    ("scale-on-cpu", lambda w: ops.quantize(w.x, torch.ones(1)), ValueError,
     r"^scale is on cpu but the input is on cuda:0; they must be on the same device"),
    ("amax-on-cpu", lambda w: ops.quantize(w.x, w.scale, amax=torch.zeros(1)), ValueError,
     r"^amax is on cpu but the input is on cuda:0"),
    ("numpy-scale", lambda w: ops.quantize(w.x, np.ones(1, np.float32)), TypeError,
     r"^scale is a numpy array but the input is a torch array"),
    ("cpu-state-slot-for-a-gpu-x", lambda w: ops.quantize(w.x, w.cpu_state.slot(0, R)), ValueError,
     r"^state\.scale is on cpu but the input is on cuda:0"),
    ("amax-aliases-x", lambda w: ops.quantize(w.x, w.scale, amax=w.x.view(-1)[100:101]), ValueError,
     r"^amax overlaps the input's memory"),
    ("dgelu-x-on-cpu", lambda w: ops.dgelu_quantize(w.x, w.x.cpu(), w.scale), ValueError,
     r"^dy is on cuda:0 \(torch\) but x is on cpu \(torch\)"),
    ("ln-weight-on-cpu", lambda w: ops.layernorm_quantize(w.x, torch.ones(64), None, 1e-5, w.scale), ValueError,
     r"^weight is on cpu but the input is on cuda:0; they must be on the same device"),
    ("ln-bias-numpy", lambda w: ops.layernorm_quantize(w.x, None, np.zeros(64, np.float32), 1e-5, w.scale), TypeError,
     r"^bias is a numpy array but the input is a torch array"),
    ("ln-cpu-state-slot", lambda w: ops.layernorm_quantize(w.x, None, None, 1e-5, w.cpu_state.slot(0, R)), ValueError,
     r"^state\.scale is on cpu but the input is on cuda:0"),
    ("dequantize-scale_inv-on-cpu", lambda w: ops.dequantize(w.q, torch.ones(1)), ValueError,
     r"^scale_inv is on cpu but the input is on cuda:0"),
    ("update-state-on-two-devices", lambda w: ops.update_scales(_split(w), R), ValueError,
     r"^state arrays are on several devices \(\[-1, 0\]\)"),
    ("update-history-of-the-wrong-length", lambda w: ops.update_scales(w.state, DelayedScaling(amax_history_len=4)),
     ValueError, r"^ScalingState\.amax_history has 8 rows but the recipe's amax_history_len is 4"),
    ("quantize-ste-cpu-state", lambda w: fp8.quantize_ste(w.x, w.cpu_state, 0, R), ValueError,
     r"^state\.scale is on cpu but the input is on cuda:0"),
    ("linear-input-on-cpu", lambda w: w.linear64(torch.randn(16, 64)), ValueError,
     r"^Fp8Linear: input is on cpu but the weight is on cuda:0"),
]


@pytest.mark.parametrize("name, call, exc, match", [pytest.param(*c, id=c[0]) for c in GPU_CASES])
@pytest.mark.gpu
@pytest.mark.fp8_gemm
def test_gpu_bad_input_is_refused_by_name_and_changes_no_state(name, call, exc, match):
    w = GpuWorld()
    before = w.snapshot()
    with pytest.raises(exc, match=match):
        call(w)
    assert w.snapshot() == before, name


@pytest.mark.gpu
def test_the_gpu_bad_input_snapshot_sees_a_write():
    """Control for the GPU bad-input cases: an accepted call on the same world changes it."""
    w = GpuWorld()
    before = w.snapshot()
    ops.quantize(w.x, w.state.slot(0, R))
    assert w.snapshot() != before
