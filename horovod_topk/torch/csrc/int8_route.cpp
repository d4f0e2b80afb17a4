// ratio="auto"'s int8 route on the CPU (horovod_topk/torch/int8_route.py): one pass that compensates a gradient
// with its residual, rounds it to the shared grid, clamps it to +-L, writes each value plus L as one byte and
// leaves what the grid did not carry in the residual; and one pass that reads the summed words back. The same
// arithmetic as int8_route.py's torch operations (a multiplication by scale / delta, round half to even, then
// acc - q * (delta / scale)), so both give the same bits; as single passes they replace about a dozen torch
// operations and their allocations per tensor (11 ms a step for the small transformer's 0.87M values on one
// thread, against 0.4 ms for the fp16 route's one pass).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

namespace {

// Round half to even by the float's own rounding: adding and taking away 1.5 x 2^(mantissa bits) leaves the
// nearest integer, ties to even, as std::nearbyint and torch.round in the default rounding mode do, for |x| below
// 2^(mantissa bits - 1); the caller clamps x to +-L first. Unlike std::nearbyint the compiler vectorises it
// (built without -ffast-math, which would fold the two operations away).
template <typename R>
inline R round_even(R x) {
  const R magic = sizeof(R) == 4 ? static_cast<R>(12582912.0) : static_cast<R>(6755399441055744.0);
  return (x + magic) - magic;
}

// Branch-free, so that the compiler vectorises it: a non-finite entry writes the padding byte (value 0), keeps its
// residual and raises the flag.
template <typename R, typename G>
bool int8_impl(const G* g, R* r, uint8_t* out, int64_t n, R to_grid, R from_grid, R limit) {
  int bad = 0;
  const int ilimit = static_cast<int>(limit);
  for (int64_t i = 0; i < n; ++i) {
    const R acc = static_cast<R>(g[i]) + r[i];
    const bool finite = (acc - acc) == static_cast<R>(0);  // false for NaN and +-Inf
    R x = acc * to_grid;
    x = x > limit ? limit : (x < -limit ? -limit : x);  // the same as clamping after rounding: L is an integer
    R q = round_even(x);
    q = finite ? q : static_cast<R>(0);  // never converted from a NaN
    r[i] = finite ? acc - q * from_grid : r[i];
    out[i] = static_cast<uint8_t>(static_cast<int>(q) + ilimit);
    bad |= !finite;
  }
  return bad != 0;
}

// This rank's finished words for the sum-allreduce, written over ``words`` (int32, (n + 3) / 4 + 1 of them): the
// values' biased bytes (q + L), the padding bytes of the last word (value 0, i.e. L), each word less the bias
// L (1 + 2^8 + 2^16 + 2^24) (core.exchange.int8_word_bias) in 32-bit arithmetic, and the control word (1 when the
// gradient had a non-finite entry); returns that flag. One call instead of the five torch operations around the
// pass (~30 us a tensor, which a model of a few hundred tensors pays every step).
int64_t to_int8(torch::Tensor grad, torch::Tensor residual, double to_grid, double from_grid, int64_t limit,
                torch::Tensor words) {
  TORCH_CHECK(grad.is_contiguous() && residual.is_contiguous() && words.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(grad.device().is_cpu() && residual.device().is_cpu() && words.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(words.scalar_type() == at::kInt, "horovod-topk: to_int8 writes int32 words");
  TORCH_CHECK(grad.numel() == residual.numel() && words.numel() == (grad.numel() + 3) / 4 + 1,
              "horovod-topk: to_int8 sizes differ");
  TORCH_CHECK(limit >= 1 && limit <= 127, "horovod-topk: to_int8's limit must be in [1, 127]");
  const int64_t n = grad.numel(), values = words.numel() - 1;
  uint8_t* o = reinterpret_cast<uint8_t*>(words.data_ptr<int32_t>());
  bool bad = false;
  if (residual.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat) {
    bad = int8_impl<float, float>(grad.data_ptr<float>(), residual.data_ptr<float>(), o, n,
                                  static_cast<float>(to_grid), static_cast<float>(from_grid),
                                  static_cast<float>(limit));
  } else if (residual.scalar_type() == at::kDouble && grad.scalar_type() == at::kDouble) {
    bad = int8_impl<double, double>(grad.data_ptr<double>(), residual.data_ptr<double>(), o, n, to_grid, from_grid,
                                    static_cast<double>(limit));
  } else if (residual.scalar_type() == at::kDouble && grad.scalar_type() == at::kFloat) {
    bad = int8_impl<double, float>(grad.data_ptr<float>(), residual.data_ptr<double>(), o, n, to_grid, from_grid,
                                   static_cast<double>(limit));
  } else {
    TORCH_CHECK(false, "horovod-topk: to_int8 takes float32/float64 gradients and residuals, got ",
                grad.scalar_type(), " and ", residual.scalar_type());
  }
  for (int64_t i = n; i < 4 * values; ++i) o[i] = static_cast<uint8_t>(limit);  // padding: value 0
  uint32_t* w = reinterpret_cast<uint32_t*>(o);
  const uint32_t bias = static_cast<uint32_t>(limit) * 0x01010101u;
  for (int64_t k = 0; k < values; ++k) w[k] -= bias;
  w[values] = bad ? 1u : 0u;
  return bad ? 1 : 0;
}

// The reduced values from the summed int32 words (each word's bytes hold four sums plus P L once P x the bias is
// added back in 64 bits), times delta, into ``out`` (float32 or float64, numel values); returns the largest
// |sum| (the next grid's reference is it times delta).
int64_t from_int8(torch::Tensor summed, int64_t numel, int64_t world_size, int64_t limit, double delta,
                  torch::Tensor out) {
  TORCH_CHECK(summed.is_contiguous() && out.is_contiguous() && summed.scalar_type() == at::kInt, "int32 words");
  TORCH_CHECK(summed.device().is_cpu() && out.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(summed.numel() * 4 >= numel && out.numel() == numel, "horovod-topk: from_int8 sizes differ");
  const int32_t* w = summed.data_ptr<int32_t>();
  const int64_t bias = world_size * limit * 0x01010101LL, offset = world_size * limit;
  int64_t largest = 0;
  // A word's bytes, once P x the bias is added (mod 2^32: every lane then holds its sum plus P L, in [0, 254],
  // so no lane borrows from the next), are the four sums plus P L; word by word, so that the compiler vectorises.
  const uint32_t word_bias = static_cast<uint32_t>(bias & 0xFFFFFFFFLL);
  const int32_t off = static_cast<int32_t>(offset);
  auto read = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    const T d = static_cast<T>(delta);
    int32_t most = 0;
    const int64_t whole = numel / 4;
    for (int64_t k = 0; k < whole; ++k) {
      const uint32_t word = static_cast<uint32_t>(w[k]) + word_bias;
      const int32_t s0 = static_cast<int32_t>(word & 0xFFu) - off, s1 = static_cast<int32_t>((word >> 8) & 0xFFu) - off;
      const int32_t s2 = static_cast<int32_t>((word >> 16) & 0xFFu) - off, s3 = static_cast<int32_t>(word >> 24) - off;
      const int32_t a01 = std::max(s0 < 0 ? -s0 : s0, s1 < 0 ? -s1 : s1);
      const int32_t a23 = std::max(s2 < 0 ? -s2 : s2, s3 < 0 ? -s3 : s3);
      most = std::max(most, std::max(a01, a23));
      o[4 * k] = static_cast<T>(s0) * d;
      o[4 * k + 1] = static_cast<T>(s1) * d;
      o[4 * k + 2] = static_cast<T>(s2) * d;
      o[4 * k + 3] = static_cast<T>(s3) * d;
    }
    for (int64_t i = 4 * whole; i < numel; ++i) {
      const uint32_t word = static_cast<uint32_t>(w[i >> 2]) + word_bias;
      const int32_t sum = static_cast<int32_t>((word >> (8 * (i & 3))) & 0xFFu) - off;
      most = std::max(most, sum < 0 ? -sum : sum);
      o[i] = static_cast<T>(sum) * d;
    }
    largest = most;
  };
  if (out.scalar_type() == at::kFloat) {
    read(out.data_ptr<float>());
  } else if (out.scalar_type() == at::kDouble) {
    read(out.data_ptr<double>());
  } else {
    TORCH_CHECK(false, "horovod-topk: from_int8 writes float32/float64, got ", out.scalar_type());
  }
  return largest;
}

}  // namespace

void define_int8_route(pybind11::module_& m) {
  m.def("to_int8", &to_int8, "int8 route: compensate, round to the shared grid, clamp, pack the words (one pass)");
  m.def("from_int8", &from_int8, "int8 route: the summed words' values times delta (one pass); the largest |sum|");
}
