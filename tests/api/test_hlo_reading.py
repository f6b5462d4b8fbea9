"""tests/support/hlo.py, which the GPU tests use to count FP8 GEMMs in XLA's optimized HLO, on a
hand-written module: one Triton FP8 GEMM fusion, one cuBLASLt FP8 call, one bf16 dot."""
from support.hlo import fp8_gemm_counts, other_gemms

MODULE = """HloModule m

%gemm_fusion_a_computation (parameter_0: f8e4m3fn[16,32], parameter_1: f8e5m2[64,32]) -> f32[16,64] {
  %parameter_0 = f8e4m3fn[16,32]{1,0} parameter(0)
  %parameter_1 = f8e5m2[64,32]{1,0} parameter(1)
  ROOT %dot.0 = f32[16,64]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%gemm_fusion_b_computation (p0: bf16[16,32], p1: bf16[64,32]) -> f32[16,64] {
  %p0 = bf16[16,32]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main (a: f8e4m3fn[16,32], b: f8e5m2[64,32], c: bf16[16,32], d: bf16[64,32]) -> f32[16,64] {
  %a = f8e4m3fn[16,32]{1,0} parameter(0)
  %b = f8e5m2[64,32]{1,0} parameter(1)
  %c = bf16[16,32]{1,0} parameter(2)
  %d = bf16[64,32]{1,0} parameter(3)
  %gemm_fusion_a = f32[16,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_a_computation
  %gemm_fusion_b = f32[16,64]{1,0} fusion(%c, %d), kind=kCustom, calls=%gemm_fusion_b_computation
  %cublas = (f32[16,64]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  ROOT %add = f32[16,64]{1,0} add(%gemm_fusion_a, %gemm_fusion_b)
}
"""


def test_fp8_gemms_are_counted_by_backend_and_the_bf16_dot_is_not():
    assert fp8_gemm_counts(MODULE) == {"cublaslt": 1, "triton": 1, "fusedfp8": 0}
    assert other_gemms(MODULE) == 1
    assert other_gemms(MODULE.replace("bf16", "f8e4m3fn")) == 0
