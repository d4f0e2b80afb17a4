// Fused CPU kernels of horovod-topk: one call per tensor (or per bucket: compress_group, decompress_group) for
// compress and one for decompress.
//
// Why a kernel: with torch ops every step of Top-K selection (compensate, |.|, threshold, mask, nonzero, gather,
// residual update) is another pass over N elements, and exact torch.topk is ~40x one elementwise pass. Here:
//   compress   = one pass that compensates (r += g, or DGC momentum correction) and moves the entries above a
//                threshold estimated on a strided sample out of the residual into a candidate list; exactly k of
//                those are kept (radix selection on their magnitudes' bits), packed into the payload, and the
//                others go back to the residual. A NaN/Inf gradient entry never enters the residual: it is sent.
//                The gradient is only read: until decompress writes the average, it holds this rank's gradient,
//                as with Horovod's own allreduce (code that reads .grad before synchronize() sees it).
//   decompress = the gradient buffer written once, block by block: each block composed in L1 from zeros and the
//                P payloads' scaled values that fall in it (their indices ascend), then stored (streaming stores
//                above 1 MiB: no read of lines about to be overwritten). No allocation.
// Payload layout (horovod_topk/core/payload.py): [k int32 indices | pad | k values | pad to 8 bytes].
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "zero_bytes.h"

namespace {

// Candidate list: indices and values, written by position into buffers grown ahead of need (no per-element
// capacity checks in the hot loop).
template <typename R>
struct Candidates {
  std::vector<int32_t> index;
  std::vector<R> value;
  int64_t count = 0;
  void reset(int64_t capacity) {
    count = 0;
    if (static_cast<int64_t>(index.size()) < capacity) {
      index.resize(static_cast<size_t>(capacity));
      value.resize(static_cast<size_t>(capacity));
    }
  }
  void reserve_more(int64_t extra) {
    if (count + extra > static_cast<int64_t>(index.size())) {
      const size_t grown = static_cast<size_t>(2 * (count + extra));
      index.resize(grown);
      value.resize(grown);
    }
  }
  void add(int64_t i, R v) {
    index[static_cast<size_t>(count)] = static_cast<int32_t>(i);
    value[static_cast<size_t>(count)] = v;
    ++count;
  }
  // A candidate leaves the residual as it is recorded (the line is in cache now): after the selection only the
  // few candidates that were not sent are written back, instead of a cache-missing write per sent entry.
  void take(R* r, int64_t i) {
    add(i, r[i]);
    r[i] = R(0);
  }
  void give_back(R* r, int64_t j) const { r[index[static_cast<size_t>(j)]] = value[static_cast<size_t>(j)]; }
  void give_back_all(R* r) const {
    for (int64_t j = 0; j < count; ++j) give_back(r, j);
  }
};

// What one element goes through in the pass: compensate it (r += g, or DGC's u = m u + g; r += u), then move it out of the residual into ``out`` if |r| >= thr. A NaN/Inf gradient
// entry is not added to anything: it goes to ``bad`` and leaves r and u as they were (see compress_impl).
template <typename R, typename G>
inline void step_one(R* r, const G* g, R* u, R m, int64_t i, R thr, bool compensate, Candidates<R>& out,
                     Candidates<R>& bad) {
  if (compensate) {
    const R gv = static_cast<R>(g[i]);
    if (std::isfinite(gv)) {
      R add = gv;
      if (u != nullptr) {
        add = m * u[i] + add;
        u[i] = add;
      }
      r[i] += add;
    } else {
      bad.reserve_more(1);
      bad.add(i, gv);
    }
  }
  if (std::fabs(r[i]) >= thr) {
    out.reserve_more(1);
    out.take(r, i);
  }
}

// One pass over r (and g, u): see step_one. The portable version; float32 without momentum has a SIMD one below.
template <typename R, typename G>
void compensate_and_collect(R* __restrict__ r, const G* __restrict__ g, R* __restrict__ u, R m, int64_t n, R thr,
                            bool compensate, Candidates<R>& out, Candidates<R>& bad) {
  for (int64_t i = 0; i < n; ++i) step_one<R, G>(r, g, u, m, i, thr, compensate, out, bad);
}

#if defined(__x86_64__)
// Record the entries of block [b, b + B) whose bits are set in ``mask`` (one bit per element): ``v`` holds the
// block's compensated values (the residual itself already has zeros there), ``old`` its residual before. The
// vector compare counts NaN as a hit (unordered), so a non-finite sum -- a NaN/Inf gradient entry, or an overflow
// -- arrives here too: it goes to ``bad`` and its residual entry gets its old value back. No extra work per
// element for that check: it is one more comparison per candidate.
inline void add_hits(const float* v, const float* old, int64_t b, unsigned mask, Candidates<float>& out,
                     Candidates<float>& bad, float* r) {
  out.reserve_more(32);
  do {
    const int j = __builtin_ctz(mask);
    if (std::isfinite(v[j])) {
      out.add(b + j, v[j]);
    } else {
      r[b + j] = old[j];
      bad.reserve_more(1);
      bad.add(b + j, v[j]);
    }
    mask &= mask - 1;
  } while (mask);
}

// The common case (float32 residual and gradient, no momentum) with SIMD: compare the magnitudes of a block at once
// and walk only the set bits of the hit mask, so the cost of the collection grows with the number of candidates,
// not with the number of elements. AVX2 (8 floats) when the CPU has it, SSE2 (4 floats, every x86-64) otherwise.
__attribute__((target("avx2"))) void collect_avx2(float* __restrict__ r, const float* __restrict__ g, int64_t n,
                                                   float thr, bool compensate, Candidates<float>& out,
                                                   Candidates<float>& bad, int64_t& done) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 t = _mm256_set1_ps(thr);
  constexpr int64_t B = 32;
  int64_t b = 0;
  for (; b + B <= n; b += B) {
    __m256 old[4], v[4];
    unsigned mask = 0;
    for (int q = 0; q < 4; ++q) {
      old[q] = v[q] = _mm256_loadu_ps(r + b + 8 * q);
      if (compensate) {
        v[q] = _mm256_add_ps(v[q], _mm256_loadu_ps(g + b + 8 * q));
      }
      const __m256 hit = _mm256_cmp_ps(_mm256_andnot_ps(sign, v[q]), t, _CMP_NLT_UQ);  // |v| >= thr, or NaN
      _mm256_storeu_ps(r + b + 8 * q, _mm256_andnot_ps(hit, v[q]));  // candidates leave the residual now
      mask |= static_cast<unsigned>(_mm256_movemask_ps(hit)) << (8 * q);
    }
    if (mask) {
      alignas(32) float values[B], before[B];
      for (int q = 0; q < 4; ++q) {
        _mm256_store_ps(values + 8 * q, v[q]);
        _mm256_store_ps(before + 8 * q, old[q]);
      }
      add_hits(values, before, b, mask, out, bad, r);
    }
  }
  done = b;
}

void collect_sse2(float* __restrict__ r, const float* __restrict__ g, int64_t n, float thr, bool compensate,
                  Candidates<float>& out, Candidates<float>& bad, int64_t& done) {
  const __m128 sign = _mm_set1_ps(-0.0f);
  const __m128 t = _mm_set1_ps(thr);
  constexpr int64_t B = 16;
  int64_t b = 0;
  for (; b + B <= n; b += B) {
    __m128 old[4], v[4];
    unsigned mask = 0;
    for (int q = 0; q < 4; ++q) {
      old[q] = v[q] = _mm_loadu_ps(r + b + 4 * q);
      if (compensate) {
        v[q] = _mm_add_ps(v[q], _mm_loadu_ps(g + b + 4 * q));
      }
      const __m128 hit = _mm_cmpnlt_ps(_mm_andnot_ps(sign, v[q]), t);  // |v| >= thr, or NaN
      _mm_storeu_ps(r + b + 4 * q, _mm_andnot_ps(hit, v[q]));  // candidates leave the residual now
      mask |= static_cast<unsigned>(_mm_movemask_ps(hit)) << (4 * q);
    }
    if (mask) {
      alignas(16) float values[B], before[B];
      for (int q = 0; q < 4; ++q) {
        _mm_store_ps(values + 4 * q, v[q]);
        _mm_store_ps(before + 4 * q, old[q]);
      }
      add_hits(values, before, b, mask, out, bad, r);
    }
  }
  done = b;
}

template <>
void compensate_and_collect<float, float>(float* __restrict__ r, const float* __restrict__ g, float* __restrict__ u,
                                          float m, int64_t n, float thr, bool compensate, Candidates<float>& out,
                                          Candidates<float>& bad) {
  int64_t b = 0;
  if (u == nullptr) {  // momentum correction keeps the portable loop
    static const bool has_avx2 = __builtin_cpu_supports("avx2");
    if (has_avx2)
      collect_avx2(r, g, n, thr, compensate, out, bad, b);
    else
      collect_sse2(r, g, n, thr, compensate, out, bad, b);
  }
  for (; b < n; ++b) step_one<float, float>(r, g, u, m, b, thr, compensate, out, bad);
}
#endif

// Magnitudes compared as integers: the bits of |x| order like |x| for every non-NaN float (and NaNs above +inf),
// which lets the selection below bucket them by their leading bits.
template <typename R>
struct MagnitudeKey;
template <>
struct MagnitudeKey<float> { using type = uint32_t; };
template <>
struct MagnitudeKey<double> { using type = uint64_t; };

template <typename R>
inline typename MagnitudeKey<R>::type magnitude_key(R x) {
  typename MagnitudeKey<R>::type bits;
  const R a = std::fabs(x);
  std::memcpy(&bits, &a, sizeof(bits));
  return bits;
}

// The k-th largest of ``keys`` (1 <= k <= size; the vector is used as scratch). Radix selection: a histogram of the
// keys' range in 2048 buckets finds the bucket that holds the k-th; only that bucket's keys are kept and the
// search goes on inside it. About two passes over the candidates, where nth_element makes several with
// unpredictable branches (it was a quarter of compress's time on 25M parameters).
template <typename Key>
Key kth_largest(std::vector<Key>& keys, int64_t k) {
  constexpr int BUCKETS = 2048;
  thread_local std::vector<int64_t> hist(BUCKETS);
  while (true) {
    const int64_t n = static_cast<int64_t>(keys.size());
    if (n <= 64) {
      std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<Key>());
      return keys[static_cast<size_t>(k - 1)];
    }
    Key lo = keys[0], hi = keys[0];
    for (const Key key : keys) {
      lo = key < lo ? key : lo;
      hi = key > hi ? key : hi;
    }
    if (lo == hi) return lo;
    unsigned shift = 0;
    while (((hi - lo) >> shift) >= static_cast<Key>(BUCKETS)) ++shift;
    std::fill(hist.begin(), hist.end(), 0);
    for (const Key key : keys) ++hist[static_cast<size_t>((key - lo) >> shift)];
    int64_t above = 0;
    Key bucket = static_cast<Key>((hi - lo) >> shift);
    while (above + hist[static_cast<size_t>(bucket)] < k) above += hist[static_cast<size_t>(bucket--)];
    size_t kept = 0;
    for (const Key key : keys)
      if (((key - lo) >> shift) == bucket) keys[kept++] = key;
    keys.resize(kept);
    k -= above;
  }
}

// The threshold that ~1.3 k + 8 of n values exceed (CANDIDATE_MARGIN in core/policy.py), estimated from a
// sample of their magnitudes: enough margin that the candidates fall short of k only rarely (then the caller
// lowers it and rescans). The q-th largest of the sample comes from the same radix selection as the final k
// (measured faster on ResNet-50's 54 tensors than a min-heap of the q largest, and than nth_element).
template <typename R>
R quantile_threshold(const std::vector<R>& sample, int64_t n, int64_t k) {
  using Key = typename MagnitudeKey<R>::type;
  const int64_t s = static_cast<int64_t>(sample.size());
  const double expected = std::min<double>(static_cast<double>(n), 1.3 * static_cast<double>(k) + 8.0);
  int64_t q = static_cast<int64_t>(std::ceil(expected * static_cast<double>(s) / static_cast<double>(n)));
  q = std::max<int64_t>(1, std::min<int64_t>(q, s));
  thread_local std::vector<Key> keys;
  keys.resize(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) keys[static_cast<size_t>(i)] = magnitude_key(sample[static_cast<size_t>(i)]);
  const Key kth = kth_largest(keys, q);
  R threshold;
  std::memcpy(&threshold, &kth, sizeof(threshold));
  return threshold;
}

// The k-th largest magnitude among the candidates (as its key; 1 <= k < count) and, in ``above``, how many lie
// strictly above it. Every candidate is at least ``thr`` (the scan's threshold), so one histogram pass over their
// keys in 2048 buckets per binade above thr (the last bucket takes everything from 2 thr up) finds the bucket that
// holds the k-th, and only that bucket's keys -- a few dozen on a normal tail -- are searched (kth_largest). Three
// passes over the candidates where building every key for the general search and counting afterwards took six: the
// selection was a sixth of a ResNet-50 compress at ratio 0.01 (docs/performance.md).
template <typename R>
typename MagnitudeKey<R>::type kth_candidate(const Candidates<R>& cand, int64_t k, R thr, int64_t& above) {
  using Key = typename MagnitudeKey<R>::type;
  constexpr int BUCKETS = 2048;
  constexpr unsigned SHIFT = std::is_same<R, float>::value ? 23 - 11 : 52 - 11;  // mantissa bits - log2(BUCKETS)
  const Key lo = magnitude_key(thr > R(0) ? thr : R(0));
  const int64_t count = cand.count;
  const R* v = cand.value.data();
  auto bucket = [lo](Key key) -> size_t {
    const Key d = key > lo ? key - lo : Key(0);
    return static_cast<size_t>(std::min<Key>(d >> SHIFT, Key(BUCKETS - 1)));
  };
  thread_local std::vector<int64_t> hist(BUCKETS);
  std::fill(hist.begin(), hist.end(), 0);
  for (int64_t i = 0; i < count; ++i) ++hist[bucket(magnitude_key(v[i]))];
  above = 0;
  size_t b = BUCKETS - 1;
  while (above + hist[b] < k) above += hist[b--];
  thread_local std::vector<Key> keys;
  keys.clear();
  for (int64_t i = 0; i < count; ++i) {
    const Key key = magnitude_key(v[i]);
    if (bucket(key) == b) keys.push_back(key);
  }
  thread_local std::vector<Key> scratch;  // kth_largest reorders and shrinks what it searches
  scratch.assign(keys.begin(), keys.end());
  const Key kth = kth_largest(scratch, k - above);
  for (const Key key : keys) above += (key > kth);
  return kth;
}

// A selected value as it travels: clamped to the wire type's largest finite magnitude where the wire is
// narrower than the residual (float16: 65504). Cast as it is, a larger value -- a residual that grew, a gradient
// under an AMP loss scale -- would travel as an Inf and leave value - Inf = -Inf in the residual, where it stays:
// every later step sends it and AMP skips every step. Clamped, the excess stays in the residual as rounding does.
template <typename W>
struct WireMax {  // float, double
  static constexpr double value = static_cast<double>(std::numeric_limits<W>::max());
};
template <>
struct WireMax<c10::Half> {
  static constexpr double value = 65504.0;
};
template <>
struct WireMax<c10::BFloat16> {
  static constexpr double value = 3.3895313892515355e38;  // (2 - 2^-7) * 2^127
};

template <typename W, typename R>
inline W to_wire(R v) {
  if constexpr (std::is_same<W, R>::value) {
    return v;
  } else {
    if constexpr (WireMax<W>::value < static_cast<double>(std::numeric_limits<R>::max())) {
      const R limit = static_cast<R>(WireMax<W>::value);
      if (std::isfinite(v)) v = v > limit ? limit : (v < -limit ? -limit : v);  // NaN/Inf travel as they are
    }
    return static_cast<W>(v);
  }
}

template <typename R, typename G, typename W>
std::vector<int64_t> compress_impl(const torch::Tensor& residual, const torch::Tensor& grad, const torch::Tensor* momentum_buf,
                   double momentum, int64_t k, int64_t values_offset, uint8_t* base, int64_t nbytes, int64_t sample_size,
                   int64_t seed) {
  const int64_t n = residual.numel();
  R* r = residual.data_ptr<R>();
  const G* g = grad.data_ptr<G>();
  R* u = momentum_buf != nullptr ? momentum_buf->data_ptr<R>() : nullptr;
  const R m = static_cast<R>(momentum);

  // 1. threshold from a strided sample of the compensated magnitudes (nothing written yet), taken as runs of 16
  //    neighbours that start on a multiple of 16 (one cache line of float32 for torch's 64-byte aligned buffers),
  //    so that each line fetched yields 16 samples; the runs are far apart, so lines are prefetched well ahead.
  constexpr int64_t RUN = 16;
  constexpr int64_t AHEAD = 16;
  const int64_t s = std::max<int64_t>(1, std::min<int64_t>(sample_size, n));
  const int64_t runs = std::max<int64_t>(1, s / RUN);
  const int64_t stride = std::max<int64_t>(RUN, (n / runs) / RUN * RUN);
  const int64_t start = (stride > RUN) ? (seed % (stride / RUN)) * RUN : 0;
  thread_local std::vector<R> sample;
  sample.resize(static_cast<size_t>((n - start + stride - 1) / stride * RUN));
  R* __restrict__ out = sample.data();
  int64_t taken = 0;
  for (int64_t b = start; b < n; b += stride) {
    const int64_t ahead = b + AHEAD * stride;
    if (ahead < n) {
      for (int64_t line = 0; line < RUN * static_cast<int64_t>(sizeof(R)); line += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(r + ahead) + line);
        __builtin_prefetch(reinterpret_cast<const char*>(g + ahead) + line * static_cast<int64_t>(sizeof(G)) / static_cast<int64_t>(sizeof(R)));
        if (u != nullptr) __builtin_prefetch(reinterpret_cast<const char*>(u + ahead) + line);
      }
    }
    const int64_t end = std::min<int64_t>(b + RUN, n);
    if (u == nullptr && end - b == RUN) {  // a whole run without momentum: a fixed loop the compiler vectorises
      const R* __restrict__ rr = r + b;
      const G* __restrict__ gg = g + b;
      for (int64_t j = 0; j < RUN; ++j) out[taken + j] = std::fabs(rr[j] + static_cast<R>(gg[j]));
      taken += RUN;
      continue;
    }
    for (int64_t i = b; i < end; ++i) {
      R add = static_cast<R>(g[i]);
      if (u != nullptr) add = m * u[i] + add;
      out[taken++] = std::fabs(r[i] + add);
    }
  }
  sample.resize(static_cast<size_t>(taken));
  R thr = (k >= n) ? R(0) : quantile_threshold<R>(sample, n, k);  // every entry goes when k == n

  // 2. one fused pass; 3. if too few candidates, put them back, lower the threshold and rescan (no second
  //    compensation). Per-thread buffers reused across calls: large fresh vectors every call would cost page
  //    faults each time.
  thread_local Candidates<R> cand;
  thread_local Candidates<R> bad;
  cand.reset(2 * k + 64);
  bad.reset(64);
  compensate_and_collect<R, G>(r, g, u, m, n, thr > R(0) ? thr : R(0), true, cand, bad);
  if (bad.count > 0) {
    // A gradient with NaN/Inf entries: those never enter the residual (a NaN there would never be sent, nor
    // leave), so the pass left r and u as they were at those entries. They are what this rank sends (up to k of
    // them; the other slots repeat the first, and a non-finite value added to itself stays non-finite): every
    // rank's average turns non-finite where this one's gradient was, as with a dense allreduce, and an AMP loss
    // scaler skips the step on every rank alike. The finite entries stay in the residual for later steps.
    cand.give_back_all(r);
    std::memset(base, 0, static_cast<size_t>(nbytes));
    int32_t* indices = reinterpret_cast<int32_t*>(base);
    W* values = reinterpret_cast<W*>(base + values_offset);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t from = j < bad.count ? j : 0;
      indices[j] = bad.index[static_cast<size_t>(from)];
      values[j] = static_cast<W>(bad.value[static_cast<size_t>(from)]);
    }
    return {-1, bad.count, 1};
  }
  int64_t scans = 1;
  const int64_t first_count = cand.count;
  for (int attempt = 0; cand.count < k && attempt < 8 && thr > R(0); ++attempt, ++scans) {
    thr = (attempt < 7) ? thr * R(0.7) : R(0);
    cand.give_back_all(r);
    cand.count = 0;
    compensate_and_collect<R, G>(r, g, u, m, n, thr, false, cand, bad);
  }
  if (cand.count < k) {  // still short at threshold 0: only NaNs in the residual (a loaded state) can do that
    cand.give_back_all(r);
    cand.reset(n);
    for (int64_t i = 0; i < n; ++i) cand.take(r, i);
  }
  const int64_t count = cand.count;
  // 4. exactly k, keeping the ascending order the scan produced (a cache-friendly scatter later): every candidate
  //    above the k-th largest magnitude and as many equal to it as needed; the others go back to the residual.
  if (count > k) {
    using Key = typename MagnitudeKey<R>::type;
    int64_t above = 0;
    const Key kth = kth_candidate(cand, k, thr, above);
    // Without branches: which candidates stay is data (~a quarter go back, in no pattern a predictor learns), so
    // each is written to both lists and the count of the one it belongs to advances; the unsent go back to the
    // residual afterwards from their own list (ascending, read in sequence).
    int64_t ties_wanted = k - above, kept = 0, unsent = 0;
    thread_local Candidates<R> back;
    back.reset(count - k + 1);
    int32_t* __restrict__ index = cand.index.data();
    R* __restrict__ value = cand.value.data();
    int32_t* __restrict__ back_index = back.index.data();
    R* __restrict__ back_value = back.value.data();
    for (int64_t i = 0; i < count; ++i) {
      const int32_t at = index[i];
      const R v = value[i];
      const Key a = magnitude_key(v);
      const bool tie = (a == kth) & (ties_wanted > 0);
      const bool keep = (a > kth) | tie;
      ties_wanted -= tie;
      index[kept] = at;
      value[kept] = v;
      back_index[unsent] = at;
      back_value[unsent] = v;
      kept += keep;
      unsent += !keep;
    }
    cand.count = kept;
    back.count = unsent;
    back.give_back_all(r);
  }

  // 5. payload; the residual of a sent entry is 0 already, unless the wire dtype rounds (float16/bfloat16 keep
  //    the rounding error); momentum-factor masking.
  std::memset(base, 0, static_cast<size_t>(nbytes));
  std::memcpy(base, cand.index.data(), static_cast<size_t>(k) * sizeof(int32_t));
  W* values = reinterpret_cast<W*>(base + values_offset);
  constexpr bool rounds = !std::is_same<W, R>::value;
  for (int64_t i = 0; i < k; ++i) {
    const R v = cand.value[i];
    const W w = to_wire<W, R>(v);
    values[i] = w;
    if (rounds || u != nullptr) {
      if (i + 32 < k) {
        if (rounds) __builtin_prefetch(r + cand.index[i + 32], 1);
        if (u != nullptr) __builtin_prefetch(u + cand.index[i + 32], 1);
      }
      const int32_t idx = cand.index[i];
      if (rounds) r[idx] = v - static_cast<R>(w);
      if (u != nullptr) u[idx] = R(0);
    }
  }
  return {first_count, count, scans};
}

template <typename O, typename W>
inline void add_scaled(O& x, W v, double scale) {
  if constexpr (std::is_same<O, double>::value) {  // a float64 gradient's average keeps float64's precision
    x += scale * static_cast<double>(v);
  } else {
    x = static_cast<O>(static_cast<float>(x) + static_cast<float>(scale * static_cast<double>(v)));
  }
}

// Whether the P payloads' indices (rank p's at ``base + p * stride``) lie in [0, n) -- throws if not: a bad payload
// must not leave a half-written gradient, so every payload is checked before anything is written -- and ascend.
bool check_indices(const uint8_t* base, int64_t world, int64_t stride, int64_t k, int64_t n) {
  bool ascending = true;
  for (int64_t p = 0; p < world; ++p) {
    const int32_t* idx = reinterpret_cast<const int32_t*>(base + p * stride);
    for (int64_t i = 0; i < k; ++i) {
      TORCH_CHECK(idx[i] >= 0 && idx[i] < n, "horovod-topk: payload index ", idx[i], " out of range for a tensor of ",
                  n, " elements");
      ascending = ascending && (i == 0 || idx[i] >= idx[i - 1]);
    }
  }
  return ascending;
}

// The P payloads of one tensor are rank p's at ``base + p * stride`` (one allgather per tensor: stride = a payload's
// bytes; a bucket's: the row of every member's payloads); ``ascending`` as check_indices found it.
template <typename O, typename W>
void decompress_impl(const uint8_t* base, int64_t world, int64_t stride, int64_t k, int64_t values_offset,
                     bool ascending, double scale, torch::Tensor out) {
  O* o = out.data_ptr<O>();
  const int64_t n = out.numel();
  if (!ascending) {
    // Only a payload of non-finite entries (compress repeats the first of them in its free slots) or one made
    // elsewhere: zero the output, then add each payload in turn.
    zero_bytes(static_cast<void*>(o), static_cast<size_t>(n) * sizeof(O));
    for (int64_t p = 0; p < world; ++p) {
      const int32_t* idx = reinterpret_cast<const int32_t*>(base + p * stride);
      const W* val = reinterpret_cast<const W*>(base + p * stride + values_offset);
      for (int64_t i = 0; i < k; ++i) add_scaled(o[idx[i]], val[i], scale);
    }
    return;
  }
  // Indices ascend (compress writes them so): the output is composed one block at a time in a buffer that stays in
  // L1 -- its zeros, then each payload's entries that fall in it, one cursor per payload -- and written out once.
  // Zeroing the whole output first and scattering into it afterwards fetched every line back from memory: 2.2x
  // slower on 25.6M parameters (benchmarks/bench_compress.py). Per element the payloads add in the same order,
  // so the result is the same bit for bit.
  constexpr int64_t BLOCK = 8192 / static_cast<int64_t>(sizeof(O));
  alignas(64) O block[BLOCK];
  thread_local std::vector<int64_t> cursor;
  cursor.assign(static_cast<size_t>(world), 0);
  const OutputWriter writer(static_cast<size_t>(n) * sizeof(O));
  for (int64_t begin = 0; begin < n; begin += BLOCK) {
    const int64_t len = std::min<int64_t>(BLOCK, n - begin);
    const int64_t end = begin + len;
    std::memset(static_cast<void*>(block), 0, static_cast<size_t>(len) * sizeof(O));
    for (int64_t p = 0; p < world; ++p) {
      const int32_t* idx = reinterpret_cast<const int32_t*>(base + p * stride);
      const W* val = reinterpret_cast<const W*>(base + p * stride + values_offset);
      int64_t c = cursor[static_cast<size_t>(p)];
      for (; c < k && idx[c] < end; ++c) add_scaled(block[idx[c] - begin], val[c], scale);
      cursor[static_cast<size_t>(p)] = c;
    }
    writer.write(o + begin, block, static_cast<size_t>(len) * sizeof(O));
  }
  writer.finish();
}

#define TOPK_DISPATCH_WIRE(WIRE, NAME, ...)                                                   \
  switch (WIRE) {                                                                               \
    case at::kFloat: { using NAME = float; __VA_ARGS__(); break; }                              \
    case at::kDouble: { using NAME = double; __VA_ARGS__(); break; }                            \
    case at::kHalf: { using NAME = at::Half; __VA_ARGS__(); break; }                            \
    case at::kBFloat16: { using NAME = at::BFloat16; __VA_ARGS__(); break; }                    \
    default: TORCH_CHECK(false, "horovod-topk: unsupported wire dtype ", WIRE);                 \
  }

#define TOPK_DISPATCH_GRAD(DT, NAME, ...)                                                     \
  switch (DT) {                                                                                 \
    case at::kFloat: { using NAME = float; __VA_ARGS__(); break; }                              \
    case at::kDouble: { using NAME = double; __VA_ARGS__(); break; }                            \
    case at::kHalf: { using NAME = at::Half; __VA_ARGS__(); break; }                            \
    case at::kBFloat16: { using NAME = at::BFloat16; __VA_ARGS__(); break; }                    \
    default: TORCH_CHECK(false, "horovod-topk: unsupported gradient dtype ", DT);               \
  }

bool supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Whether ``k`` indices and values of ``wire`` fit a payload of ``nbytes`` whose values start at ``values_offset``
// (core.payload's layout) -- throws if not: a layout made for another value size must not write past its member.
void check_layout(int64_t k, int64_t values_offset, int64_t nbytes, at::ScalarType wire) {
  TORCH_CHECK(supported_float(wire), "horovod-topk: unsupported wire dtype ", wire);
  TORCH_CHECK(k >= 1 && 4 * k <= values_offset && values_offset + k * static_cast<int64_t>(c10::elementSize(wire)) <= nbytes,
              "horovod-topk: a payload of ", nbytes, " bytes with values at ", values_offset, " cannot hold ", k,
              " entries of ", wire);
}

// Everything compress_into requires of one member, checked before any member of a group is touched: an error in
// the last member must not leave the first ones' entries taken out of their residuals with their payload dropped.
void check_member(const torch::Tensor& residual, const torch::Tensor& grad, const torch::Tensor* momentum_buf, int64_t k,
                  int64_t values_offset, int64_t nbytes, at::ScalarType wire) {
  TORCH_CHECK(residual.is_contiguous() && grad.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(residual.device().is_cpu() && grad.device().is_cpu(), "horovod-topk kernels run on CPU tensors");
  TORCH_CHECK(residual.numel() == grad.numel() && k >= 1 && k <= residual.numel(), "bad sizes");
  TORCH_CHECK(residual.scalar_type() == at::kFloat || residual.scalar_type() == at::kDouble,
              "residual must be float32 or float64");
  TORCH_CHECK(supported_float(grad.scalar_type()), "horovod-topk: unsupported gradient dtype ", grad.scalar_type());
  TORCH_CHECK(momentum_buf == nullptr || (momentum_buf->is_contiguous() && momentum_buf->numel() == residual.numel() &&
                                          momentum_buf->scalar_type() == residual.scalar_type()), "momentum buffer");
  check_layout(k, values_offset, nbytes, wire);
}

// Returns (candidates of the first scan, candidates kept for selection, scans): how good the estimate was; or
// (-1, non-finite entries, 1) when the gradient had NaN/Inf and those went out instead (see compress_impl).
std::vector<int64_t> compress_into(const torch::Tensor& residual, const torch::Tensor& grad, const torch::Tensor* momentum_buf,
                                   double momentum, int64_t k, int64_t values_offset, uint8_t* base, int64_t nbytes,
                                   at::ScalarType wire, int64_t sample_size, int64_t seed) {
  check_member(residual, grad, momentum_buf, k, values_offset, nbytes, wire);
  std::vector<int64_t> info;
  if (residual.scalar_type() == at::kDouble) {
    TOPK_DISPATCH_GRAD(grad.scalar_type(), G, [&] {
      TOPK_DISPATCH_WIRE(wire, W, [&] {
        info = compress_impl<double, G, W>(residual, grad, momentum_buf, momentum, k, values_offset, base, nbytes, sample_size, seed);
      });
    });
  } else {
    TORCH_CHECK(residual.scalar_type() == at::kFloat, "residual must be float32 or float64");
    TOPK_DISPATCH_GRAD(grad.scalar_type(), G, [&] {
      TOPK_DISPATCH_WIRE(wire, W, [&] {
        info = compress_impl<float, G, W>(residual, grad, momentum_buf, momentum, k, values_offset, base, nbytes, sample_size, seed);
      });
    });
  }
  return info;
}

std::vector<int64_t> compress(torch::Tensor residual, torch::Tensor grad, c10::optional<torch::Tensor> momentum_buf, double momentum,
              int64_t k, int64_t values_offset, torch::Tensor payload, torch::Tensor wire_like, int64_t sample_size,
              int64_t seed) {
  TORCH_CHECK(payload.is_contiguous() && payload.scalar_type() == at::kByte, "payload: contiguous uint8");
  return compress_into(residual, grad, momentum_buf.has_value() ? &*momentum_buf : nullptr, momentum, k, values_offset,
                       payload.data_ptr<uint8_t>(), payload.numel(), wire_like.scalar_type(), sample_size, seed);
}

// A bucket's members in one call, their payloads back to back in ``payload`` (member i's ``nbytes[i]`` bytes after
// those before it): what compress does for each, without a return to Python and a payload allocation per member.
// ``momenta`` is empty without DGC momentum, else one buffer per member. Returns each member's first element of
// compress's answer (the first scan's candidates, or -1 where the gradient had NaN/Inf).
std::vector<int64_t> compress_group(std::vector<torch::Tensor> residuals, std::vector<torch::Tensor> grads,
                                    std::vector<torch::Tensor> momenta, double momentum, std::vector<int64_t> ks,
                                    std::vector<int64_t> values_offsets, std::vector<int64_t> nbytes,
                                    torch::Tensor payload, torch::Tensor wire_like, std::vector<int64_t> sample_sizes,
                                    std::vector<int64_t> seeds) {
  const size_t m = residuals.size();
  TORCH_CHECK(grads.size() == m && ks.size() == m && values_offsets.size() == m && nbytes.size() == m &&
                  sample_sizes.size() == m && seeds.size() == m && (momenta.empty() || momenta.size() == m),
              "compress_group: one entry per member");
  TORCH_CHECK(payload.is_contiguous() && payload.scalar_type() == at::kByte, "payload: contiguous uint8");
  int64_t total = 0;
  for (const int64_t b : nbytes) total += b;
  TORCH_CHECK(payload.numel() == total, "compress_group: payload of ", payload.numel(), " bytes for members of ", total);
  std::vector<int64_t> first(m);
  uint8_t* at = payload.data_ptr<uint8_t>();
  const auto wire = wire_like.scalar_type();
  for (size_t i = 0; i < m; ++i) {  // every member first: nothing is touched if one cannot be done
    check_member(residuals[i], grads[i], momenta.empty() ? nullptr : &momenta[i], ks[i], values_offsets[i], nbytes[i],
                 wire);
  }
  for (size_t i = 0; i < m; ++i) {
    first[i] = compress_into(residuals[i], grads[i], momenta.empty() ? nullptr : &momenta[i], momentum, ks[i],
                             values_offsets[i], at, nbytes[i], wire, sample_sizes[i], seeds[i])[0];
    at += nbytes[i];
  }
  return first;
}

void check_out(const torch::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && out.device().is_cpu(), "out: a contiguous CPU tensor");
  TORCH_CHECK(supported_float(out.scalar_type()), "horovod-topk: unsupported gradient dtype ", out.scalar_type());
}

void decompress_rows(const uint8_t* base, int64_t world, int64_t stride, int64_t k, int64_t values_offset,
                     bool ascending, at::ScalarType wire, double scale, torch::Tensor& out) {
  TOPK_DISPATCH_GRAD(out.scalar_type(), O, [&] {
    TOPK_DISPATCH_WIRE(wire, W, [&] { decompress_impl<O, W>(base, world, stride, k, values_offset, ascending, scale, out); });
  });
}

void decompress(torch::Tensor gathered, int64_t world, int64_t k, int64_t values_offset, int64_t nbytes,
                torch::Tensor wire_like, double scale, torch::Tensor out) {
  TORCH_CHECK(gathered.is_contiguous() && gathered.device().is_cpu() && gathered.scalar_type() == at::kByte,
              "gathered: contiguous uint8 on the CPU");
  TORCH_CHECK(gathered.numel() == world * nbytes, "gathered payload size");
  check_layout(k, values_offset, nbytes, wire_like.scalar_type());
  check_out(out);
  const uint8_t* base = gathered.data_ptr<uint8_t>();
  const bool ascending = check_indices(base, world, nbytes, k, out.numel());
  decompress_rows(base, world, nbytes, k, values_offset, ascending, wire_like.scalar_type(), scale, out);
}

// The gathered payloads of a bucket's members (compress_group's layout; ``rows``: P rows, each rank's members back to
// back, possibly a view into a longer row) added back into their gradients ``outs``, one call for the bucket. Every
// member's indices are checked before any gradient is written.
void decompress_group(torch::Tensor rows, std::vector<int64_t> ks, std::vector<int64_t> values_offsets,
                      std::vector<int64_t> nbytes, torch::Tensor wire_like, double scale, std::vector<torch::Tensor> outs) {
  const size_t m = outs.size();
  TORCH_CHECK(ks.size() == m && values_offsets.size() == m && nbytes.size() == m, "decompress_group: one entry per member");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.stride(1) == 1 && rows.device().is_cpu(),
              "rows: P x bytes, uint8 on the CPU");
  int64_t total = 0;
  for (const int64_t b : nbytes) total += b;
  TORCH_CHECK(rows.size(1) == total, "decompress_group: rows of ", rows.size(1), " bytes for members of ", total);
  const int64_t world = rows.size(0), stride = rows.stride(0);
  const uint8_t* base = rows.data_ptr<uint8_t>();
  std::vector<uint8_t> ascending(m);
  int64_t at = 0;
  for (size_t i = 0; i < m; ++i) {
    check_layout(ks[i], values_offsets[i], nbytes[i], wire_like.scalar_type());
    check_out(outs[i]);
    ascending[i] = check_indices(base + at, world, stride, ks[i], outs[i].numel());
    at += nbytes[i];
  }
  at = 0;
  for (size_t i = 0; i < m; ++i) {
    decompress_rows(base + at, world, stride, ks[i], values_offsets[i], ascending[i], wire_like.scalar_type(), scale, outs[i]);
    at += nbytes[i];
  }
}

}  // namespace

// The sparse allreduce's kernels (sparse_rounds.cpp) and the fp16 route's (half_route.cpp).
void define_sparse_rounds(pybind11::module_& m);
void define_half_route(pybind11::module_& m);
void define_int8_route(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compress", &compress, "fused compensate + sampled-threshold Top-K + pack");
  m.def("decompress", &decompress, "the gradient buffer written once: zeros plus the P payloads, scaled");
  m.def("compress_group", &compress_group, "compress for a bucket's members, their payloads back to back");
  m.def("decompress_group", &decompress_group, "decompress for a bucket's members from the gathered rows");
  define_sparse_rounds(m);
  define_half_route(m);
  define_int8_route(m);
}
