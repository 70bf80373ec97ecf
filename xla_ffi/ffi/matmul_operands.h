// The operands every reducing matmul handler (GEMM+ReduceScatter, GEMM+AllReduce) reads the same
// way: x [..., M, K] (leading axes batch), the weight w [K, N] or, with transpose_w, [N, K], and
// an output, all of one 16-bit dtype. The op-specific checks (tp, M, the output's shape) stay in
// the handlers.
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
  size_t batch = 0, rows = 0, k = 0, n = 0, elem = 0;  // rows = M of one batch entry
  GemmDtype dtype = GemmDtype::kBF16;
  bool w_kmajor = false;  // w holds the weight transposed, [N, K] (transpose_w)
};

// Fills *s from x, w and out, or returns InvalidArgument "jaxflux <op>: ..." saying what is wrong.
inline xla::ffi::Error ReadMatmulOperands(const char* op, xla::ffi::AnyBuffer x,
                                          xla::ffi::AnyBuffer w, xla::ffi::AnyBuffer out,
                                          int64_t transpose_w, MatmulOperands* s) {
  namespace ffi = xla::ffi;
  auto invalid = [op](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string("jaxflux ") + op + ": " + what);
  };
  JAXFLUX_RETURN_IF_ERROR(CheckAttrIn(op, "transpose_w", transpose_w, {0, 1}));
  const auto dt = x.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) {
    return invalid("x must be bfloat16 or float16");
  }
  if (w.element_type() != dt || out.element_type() != dt) {
    return invalid("x, w and the output need one dtype");
  }
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  s->w_kmajor = transpose_w != 0;
  const int k_dim = s->w_kmajor ? 1 : 0;
  if (xd.size() < 2 || wd.size() != 2 || xd.back() != wd[k_dim]) {
    return invalid("expected x [..., M, K] and w [K, N] (or [N, K] with transpose_w)");
  }
  s->rows = static_cast<size_t>(xd[xd.size() - 2]);
  s->k = static_cast<size_t>(wd[k_dim]);
  s->n = static_cast<size_t>(wd[1 - k_dim]);
  s->elem = ffi::ByteWidth(dt);
  s->dtype = dt == ffi::DataType::BF16 ? GemmDtype::kBF16 : GemmDtype::kF16;
  if (s->rows == 0 || s->k == 0 || s->n == 0) return invalid("empty operands are not supported");
  if (s->k % 8 || s->n % 8) return invalid("K and N must be multiples of 8 (16-byte rows)");
  s->batch = x.element_count() / (s->rows * s->k);
  constexpr size_t kIntMax = static_cast<size_t>(std::numeric_limits<int>::max());
  if (s->batch * s->rows > kIntMax || s->n > kIntMax || s->k > kIntMax) {
    return invalid("a dimension exceeds 2^31-1");
  }
  return ffi::Error::Success();
}

}  // namespace jaxflux
