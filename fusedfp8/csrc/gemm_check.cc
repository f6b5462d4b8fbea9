// Compile-time check of gemm.h's own cuBLASLt declarations against the real cublasLt.h (compiled,
// never linked, by tests/kernels/test_gemm_shim.py wherever a cublasLt.h is found: the nvidia
// cuBLAS wheel's include folder, $CUDA_HOME/include, or FUSEDFP8_CUBLASLT_INCLUDE). gemm.h declares
// its names inside ff8::lt, so both sets coexist here.
#include <cublasLt.h>

#include <cstddef>

#include "gemm.h"


#define FF8_SAME(ours, theirs) static_assert(static_cast<long>(ff8::lt::ours) == static_cast<long>(theirs), #ours " != " #theirs)

FF8_SAME(kR32F, CUDA_R_32F);
FF8_SAME(kR16F, CUDA_R_16F);
FF8_SAME(kR16BF, CUDA_R_16BF);
FF8_SAME(kR8F_E4M3, CUDA_R_8F_E4M3);
FF8_SAME(kR8F_E5M2, CUDA_R_8F_E5M2);
FF8_SAME(kCompute32F, CUBLAS_COMPUTE_32F);
FF8_SAME(kOpN, CUBLAS_OP_N);
FF8_SAME(kOpT, CUBLAS_OP_T);
FF8_SAME(kDescTransA, CUBLASLT_MATMUL_DESC_TRANSA);
FF8_SAME(kDescTransB, CUBLASLT_MATMUL_DESC_TRANSB);
FF8_SAME(kDescAScalePointer, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER);
FF8_SAME(kDescBScalePointer, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER);
FF8_SAME(kDescFastAccum, CUBLASLT_MATMUL_DESC_FAST_ACCUM);
FF8_SAME(kDescEpilogue, CUBLASLT_MATMUL_DESC_EPILOGUE);
FF8_SAME(kDescBiasPointer, CUBLASLT_MATMUL_DESC_BIAS_POINTER);
FF8_SAME(kDescBiasDataType, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE);
FF8_SAME(kDescAScaleMode, CUBLASLT_MATMUL_DESC_A_SCALE_MODE);
FF8_SAME(kDescBScaleMode, CUBLASLT_MATMUL_DESC_B_SCALE_MODE);
FF8_SAME(kScaleScalar, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F);
FF8_SAME(kScaleVec128, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
FF8_SAME(kScaleBlk128x128, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
FF8_SAME(kEpilogueDefault, CUBLASLT_EPILOGUE_DEFAULT);
FF8_SAME(kEpilogueBias, CUBLASLT_EPILOGUE_BIAS);
FF8_SAME(kPrefMaxWorkspaceBytes, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
FF8_SAME(kPrefMinAlignA, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES);
FF8_SAME(kPrefMinAlignB, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES);
FF8_SAME(kPrefMinAlignC, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES);
FF8_SAME(kPrefMinAlignD, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
static_assert(CUBLAS_STATUS_SUCCESS == 0, "cublasStatus_t success");

namespace lt = ff8::lt;
static_assert(sizeof(lt::Status) == sizeof(cublasStatus_t), "cublasStatus_t size");
static_assert(sizeof(lt::Algo) == sizeof(cublasLtMatmulAlgo_t), "cublasLtMatmulAlgo_t");
static_assert(sizeof(lt::HeuristicResult) == sizeof(cublasLtMatmulHeuristicResult_t) &&
                  offsetof(lt::HeuristicResult, workspaceSize) == offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize) &&
                  offsetof(lt::HeuristicResult, state) == offsetof(cublasLtMatmulHeuristicResult_t, state),
              "cublasLtMatmulHeuristicResult_t layout");
// the enums and handles gemm.h passes as int32_t and void*
static_assert(sizeof(cublasLtEpilogue_t) == sizeof(uint32_t), "the epilogue attribute is a uint32_t");
static_assert(sizeof(cublasLtMatmulDescAttributes_t) == sizeof(int32_t) &&
                  sizeof(cublasLtMatmulPreferenceAttributes_t) == sizeof(int32_t) &&
                  sizeof(cudaDataType_t) == sizeof(int32_t) && sizeof(cublasComputeType_t) == sizeof(int32_t),
              "enum sizes");
static_assert(sizeof(cublasLtMatmulDesc_t) == sizeof(lt::MatmulDesc) && sizeof(cublasLtMatrixLayout_t) == sizeof(lt::Layout) &&
                  sizeof(cublasLtMatmulPreference_t) == sizeof(lt::Preference) && sizeof(cublasLtHandle_t) == sizeof(lt::Handle),
              "opaque handles are pointers");
