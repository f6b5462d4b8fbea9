"""The differentiable FP8 building blocks in one namespace: :func:`fp8_dot` (an FP8 linear
layer, ``custom_vjp``), :func:`fp8_mlp` (the fused ``[LayerNorm ->] Linear -> gelu -> Linear``
block), their ``*_use`` forms, :func:`quantize_weight` (the weight cache for gradient
accumulation), :func:`quantize_ste` (straight-through fake quantization), :func:`gemm` (the
FP8 GEMM), :func:`block_dot` and :func:`block_mlp` (the linear and the MLP under block scaling,
which :func:`fp8_dot` and :func:`fp8_mlp` run for a BlockScaling recipe).

They live in :mod:`fusedfp8.jax.dot` (the meta convention and the GEMM layouts are described
there), :mod:`fusedfp8.jax.block_dot` and :mod:`fusedfp8.jax.mlp`.
"""
from .block_dot import block_dot, block_mlp
from .dot import fp8_dot, fp8_dot_use, gemm, quantize_ste, quantize_weight
from .mlp import fp8_mlp, fp8_mlp_use

__all__ = ["quantize_ste", "quantize_weight", "fp8_dot", "fp8_dot_use", "block_dot", "block_mlp", "fp8_mlp", "fp8_mlp_use", "gemm"]
