// The operands every reducing matmul handler (GEMM+ReduceScatter, GEMM+AllReduce) reads the same
// way: x [..., M, K] (leading axes batch), the weight w [K, N] or, with transpose_w, [N, K], and
// an output, all of one 16-bit dtype; or FP8 x (e4m3/e5m2) and w (e4m3, given [N, K]) with a bf16
// output and two float32 scale operands (Fp8Scales). The op-specific checks (tp, M, the output's
// shape) stay in the handlers. OperandTypes is shared with the AllGather+GEMM handler.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi/errors.h"
#include "xla_ffi/kernels/gemm_sm90.h"

namespace jaxflux {

struct MatmulOperands {
  size_t batch = 0, rows = 0, k = 0, n = 0;  // rows = M of one batch entry
  size_t elem = 0;      // bytes of an element of x (and w)
  size_t out_elem = 0;  // bytes of an element of the output (and of the partials pushed)
  GemmDtype dtype = GemmDtype::kBF16;
  bool w_kmajor = false;  // w holds the weight transposed, [N, K] (transpose_w)
};

// The kernel kind of (x, w, out), or an error message: x, w and out of one 16-bit dtype; or x
// e4m3/e5m2, w e4m3 given transposed (transpose_w: wgmma reads 8-bit operands K-major only) and
// out bf16. Sets the element sizes.
inline std::string OperandTypes(xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer w,
                                xla::ffi::AnyBuffer out, bool w_kmajor, GemmDtype* dtype,
                                size_t* elem, size_t* out_elem) {
  namespace ffi = xla::ffi;
  const auto dt = x.element_type();
  *elem = ffi::ByteWidth(dt);
  *out_elem = ffi::ByteWidth(out.element_type());
  if (dt == ffi::DataType::F8E4M3FN || dt == ffi::DataType::F8E5M2) {
    *dtype = dt == ffi::DataType::F8E4M3FN ? GemmDtype::kE4M3 : GemmDtype::kE5M2;
    if (w.element_type() != ffi::DataType::F8E4M3FN) return "FP8 x needs an e4m3 w";
    if (out.element_type() != ffi::DataType::BF16) return "FP8 operands write a bfloat16 output";
    if (!w_kmajor) return "FP8 w must be given transposed, [N, K] (transpose_w=1)";
    return "";
  }
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return "x must be bfloat16, float16, float8_e4m3fn or float8_e5m2";
  }
  if (w.element_type() != dt || out.element_type() != dt) {
    return "x, w and the output need one dtype";
  }
  *dtype = dt == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  return "";
}

// FP8 calls' scale operands, the ones after rank_info: x's per row, float32 with `rows`
// elements (all rows of x, batch entries included), and w's per output column, float32 [N].
// Sets both pointers (nullptr for 16-bit calls, which pass none).
inline xla::ffi::Error Fp8Scales(const char* op, GemmDtype dtype,
                                 const xla::ffi::RemainingArgs& scales, size_t rows, size_t n,
                                 const float** row_scale, const float** col_scale) {
  namespace ffi = xla::ffi;
  auto invalid = [op](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string("jaxflux ") + op + ": " + what);
  };
  *row_scale = *col_scale = nullptr;
  if (!IsFp8(dtype)) {
    if (!scales.empty()) return invalid("scale operands are for FP8 operands only");
    return ffi::Error::Success();
  }
  if (scales.size() != 2) return invalid("FP8 operands need x's and w's scale operands");
  auto x_scale = scales.get<ffi::AnyBuffer>(0);
  auto w_scale = scales.get<ffi::AnyBuffer>(1);
  if (x_scale.has_error()) return x_scale.error();
  if (w_scale.has_error()) return w_scale.error();
  if (x_scale->element_type() != ffi::DataType::F32 || x_scale->element_count() != rows) {
    return invalid("x's scales must be float32, one per row of x");
  }
  if (w_scale->element_type() != ffi::DataType::F32 || w_scale->element_count() != n) {
    return invalid("w's scales must be float32, one per output column");
  }
  *row_scale = static_cast<const float*>(x_scale->untyped_data());
  *col_scale = static_cast<const float*>(w_scale->untyped_data());
  return ffi::Error::Success();
}

// Fills *s from x, w and out, or returns InvalidArgument "jaxflux <op>: ..." saying what is wrong.
inline xla::ffi::Error ReadMatmulOperands(const char* op, xla::ffi::AnyBuffer x,
                                          xla::ffi::AnyBuffer w, xla::ffi::AnyBuffer out,
                                          int64_t transpose_w, MatmulOperands* s) {
  namespace ffi = xla::ffi;
  auto invalid = [op](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string("jaxflux ") + op + ": " + what);
  };
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(op, "transpose_w", transpose_w, {0, 1}));
  s->w_kmajor = transpose_w != 0;
  const std::string types =
      OperandTypes(x, w, out, s->w_kmajor, &s->dtype, &s->elem, &s->out_elem);
  if (!types.empty()) return invalid(types);
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int k_dim = s->w_kmajor ? 1 : 0;
  if (xd.size() < 2 || wd.size() != 2 || xd.back() != wd[k_dim]) {
    return invalid("expected x [..., M, K] and w [K, N] (or [N, K] with transpose_w)");
  }
  s->rows = static_cast<size_t>(xd[xd.size() - 2]);
  s->k = static_cast<size_t>(wd[k_dim]);
  s->n = static_cast<size_t>(wd[1 - k_dim]);
  if (s->rows == 0 || s->k == 0 || s->n == 0) return invalid("empty operands are not supported");
  const size_t align = 16 / s->elem;  // 16-byte rows for TMA
  if (s->k % align || s->n % align) {
    return invalid("K and N must be multiples of " + std::to_string(align) + " (16-byte rows)");
  }
  s->batch = x.element_count() / (s->rows * s->k);
  constexpr size_t kIntMax = static_cast<size_t>(std::numeric_limits<int>::max());
  if (s->batch * s->rows > kIntMax || s->n > kIntMax || s->k > kIntMax) {
    return invalid("a dimension exceeds 2^31-1");
  }
  return ffi::Error::Success();
}

}  // namespace jaxflux
