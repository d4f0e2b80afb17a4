// ratio="auto"'s fp16 route on the CPU (horovod_topk/torch/half_route.py): one pass that compensates a gradient
// with its residual, scales it, clamps it to float16's range over P ranks, rounds it to float16 and leaves what
// float16 did not carry in the residual. The same arithmetic as half_route.py's torch operations (a multiplication
// by the scale, then by its reciprocal, no fused multiply-add), so both give the same bits; as one pass it reads
// the gradient and the residual once and writes the residual and the float16 values once, where the torch
// operations made eight passes and as many fresh allocations (page faults on every step for large tensors).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

template <typename R, typename G>
inline bool half_one(const G* g, R* r, at::Half* out, int64_t i, R scale, R inverse, R limit) {
  const R acc = static_cast<R>(g[i]) + r[i];
  R sent = acc * scale;
  const bool finite = std::isfinite(acc);
  if (finite) sent = sent > limit ? limit : (sent < -limit ? -limit : sent);  // an Inf or NaN is sent as such
  const at::Half h = static_cast<at::Half>(static_cast<float>(sent));
  out[i] = h;
  if (finite) r[i] = acc - static_cast<R>(static_cast<float>(h)) * inverse;
  return !finite;
}

#if defined(__x86_64__)
// float32 gradient and residual: 8 lanes at a time, float16 conversion in hardware (F16C, round to nearest even as
// the scalar conversion). No FMA in the target list: the compiler may not contract acc - h * inverse.
__attribute__((target("avx2,f16c"))) int64_t half_avx2(const float* g, float* r, at::Half* out, int64_t n, float scale,
                                                        float inverse, float limit, bool& bad) {
  const __m256 vs = _mm256_set1_ps(scale), vi = _mm256_set1_ps(inverse), hi = _mm256_set1_ps(limit),
               lo = _mm256_set1_ps(-limit), sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  int64_t i = 0;
  unsigned nonfinite = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 old = _mm256_loadu_ps(r + i);
    const __m256 acc = _mm256_add_ps(_mm256_loadu_ps(g + i), old);
    const __m256 scaled = _mm256_mul_ps(acc, vs);
    const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, acc), inf, _CMP_LT_OQ);  // false for Inf and NaN
    const __m256 sent = _mm256_blendv_ps(scaled, _mm256_min_ps(_mm256_max_ps(scaled, lo), hi), finite);
    const __m128i h = _mm256_cvtps_ph(sent, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    const __m256 left = _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_cvtph_ps(h), vi));
    _mm256_storeu_ps(r + i, _mm256_blendv_ps(old, left, finite));
    nonfinite |= static_cast<unsigned>(_mm256_movemask_ps(finite)) ^ 0xFFu;
  }
  bad = bad || nonfinite != 0;
  return i;
}
#endif

template <typename R, typename G>
bool half_impl(const G* g, R* r, at::Half* out, int64_t n, double scale, double limit) {
  const R s = static_cast<R>(scale), inverse = static_cast<R>(1.0 / scale), l = static_cast<R>(limit);
  bool bad = false;
  int64_t i = 0;
#if defined(__x86_64__)
  if constexpr (std::is_same<R, float>::value && std::is_same<G, float>::value) {
    static const bool fast = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (fast) i = half_avx2(g, r, out, n, s, inverse, l, bad);
  }
#endif
  for (; i < n; ++i) bad = half_one<R, G>(g, r, out, i, s, inverse, l) || bad;
  return bad;
}

// Returns 1 when the gradient had a non-finite entry (sent as such; the residual keeps its old value there).
int64_t to_half(torch::Tensor grad, torch::Tensor residual, double scale, double limit, torch::Tensor out) {
  TORCH_CHECK(grad.is_contiguous() && residual.is_contiguous() && out.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(grad.device().is_cpu() && residual.device().is_cpu() && out.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(grad.numel() == residual.numel() && grad.numel() == out.numel(), "horovod-topk: to_half sizes differ");
  TORCH_CHECK(out.scalar_type() == at::kHalf, "horovod-topk: to_half writes float16");
  const int64_t n = grad.numel();
  at::Half* o = out.data_ptr<at::Half>();
  bool bad = false;
  if (residual.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat) {
    bad = half_impl<float, float>(grad.data_ptr<float>(), residual.data_ptr<float>(), o, n, scale, limit);
  } else if (residual.scalar_type() == at::kDouble && grad.scalar_type() == at::kDouble) {
    bad = half_impl<double, double>(grad.data_ptr<double>(), residual.data_ptr<double>(), o, n, scale, limit);
  } else if (residual.scalar_type() == at::kDouble && grad.scalar_type() == at::kFloat) {
    bad = half_impl<double, float>(grad.data_ptr<float>(), residual.data_ptr<double>(), o, n, scale, limit);
  } else {
    TORCH_CHECK(false, "horovod-topk: to_half takes float32/float64 gradients and residuals, got ",
                grad.scalar_type(), " and ", residual.scalar_type());
  }
  return bad ? 1 : 0;
}

}  // namespace

void define_half_route(pybind11::module_& m) {
  m.def("to_half", &to_half, "fp16 route: compensate, scale, clamp, round to float16, keep the rest (one pass)");
}
