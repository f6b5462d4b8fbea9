"""tests/support/hlo.py, which the GPU tests use to count FP8 GEMMs in XLA's optimized HLO, on a
hand-written module: one Triton FP8 GEMM fusion, one cuBLASLt FP8 call, one bf16 dot; and on
another, the pads of FP8 bytes (fp8_pads); on a third, the xors that XLA can see through
(xors_with_zero)."""
from support.hlo import fp8_gemm_counts, fp8_pads, other_gemms, xors_with_zero

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


PADS = """HloModule p

%fused_pad (param_0.1: f8e4m3fn[30,20]) -> f8e4m3fn[32,32] {
  %param_0.1 = f8e4m3fn[30,20]{1,0} parameter(0)
  %convert.1 = f16[30,20]{1,0} convert(%param_0.1)
  %constant.1 = f16[] constant(0)
  %pad.1 = f16[32,32]{1,0} pad(%convert.1, %constant.1), padding=0_2x0_12
  ROOT %convert.2 = f8e4m3fn[32,32]{1,0} convert(%pad.1)
}

%fused_bf16_pad (param_0.2: bf16[30,20]) -> bf16[32,32] {
  %param_0.2 = bf16[30,20]{1,0} parameter(0)
  %constant.2 = bf16[] constant(0)
  ROOT %pad.2 = bf16[32,32]{1,0} pad(%param_0.2, %constant.2), padding=0_2x0_12
}

ENTRY %main (a: f8e4m3fn[30,20], b: bf16[30,20], c: u8[30,20]) -> f8e4m3fn[32,32] {
  %a = f8e4m3fn[30,20]{1,0} parameter(0)
  %b = bf16[30,20]{1,0} parameter(1)
  %c = u8[30,20]{1,0} parameter(2)
  %zero = u8[] constant(0)
  %loop_pad_fusion = f8e4m3fn[32,32]{1,0} fusion(%a), kind=kLoop, calls=%fused_pad
  %bf16_pad_fusion = bf16[32,32]{1,0} fusion(%b), kind=kLoop, calls=%fused_bf16_pad
  %pad.3 = u8[32,32]{1,0} pad(%c, %zero), padding=0_2x0_12
  ROOT %copy = f8e4m3fn[32,32]{1,0} copy(%loop_pad_fusion)
}
"""


def test_fp8_pads_finds_the_fused_pad_of_fp8_and_the_uint8_pad_but_not_the_bf16_one():
    found = fp8_pads(PADS)
    assert [ln.split(" = ")[0] for ln in found] == ["fused_pad: %pad.1", "main: %pad.3"]
    assert fp8_pads(PADS.replace("f8e4m3fn", "f32").replace("u8", "s32")) == []


XORS = """HloModule m

%fused_seen (p0: f32[8], p1: f32[8], p2: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %p2 = f32[8]{0} parameter(2)
  %mul.0 = f32[8]{0} multiply(%p0, %p1)
  %bc.0 = s32[8]{0} bitcast-convert(%mul.0)
  %zero.0 = s32[] constant(0)
  %zeros.0 = s32[8]{0} broadcast(%zero.0), dimensions={}
  %xor.0 = s32[8]{0} xor(%bc.0, %zeros.0)
  %back.0 = f32[8]{0} bitcast-convert(%xor.0)
  ROOT %add.0 = f32[8]{0} add(%back.0, %p2)
}

%fused_hidden (q0: f32[8], q1: f32[8], q2: s32[]) -> f32[8] {
  %q0 = f32[8]{0} parameter(0)
  %q1 = f32[8]{0} parameter(1)
  %q2 = s32[] parameter(2)
  %mul.1 = f32[8]{0} multiply(%q0, %q1)
  %bc.1 = s32[8]{0} bitcast-convert(%mul.1)
  %zeros.1 = s32[8]{0} broadcast(%q2), dimensions={}
  %xor.1 = s32[8]{0} xor(%bc.1, %zeros.1)
  %c.1 = s32[] constant(0)
  %xor.2 = s32[] xor(%c.1, %q2)
  %c.2 = s32[] constant(1065353216)
  %xor.3 = s32[] xor(%c.2, %q2)
  ROOT %back.1 = f32[8]{0} bitcast-convert(%xor.1)
}
"""


def test_xors_with_zero_finds_the_zero_xla_can_see_and_not_the_hidden_ones():
    """A product xor a broadcast constant 0 is found; a product xor a zero that comes in as a
    parameter, the hidden constant 0.0 (0 xor that parameter) and another hidden constant are not."""
    found = xors_with_zero(XORS)
    assert len(found) == 1 and found[0].startswith("fused_seen: %xor.0 = "), found
