// Writing large output buffers, shared by the fused kernels (topk_kernels.cpp, sparse_rounds.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// Zero ``bytes`` bytes at ``p``. Above L2's size the buffer is bound for memory anyway: streaming stores write it
// without first reading every line into the cache (a plain memset below glibc's own non-temporal threshold, which is
// above the size of most layers, reads each line before writing it).
inline void zero_bytes(void* p, size_t bytes) {
#if defined(__x86_64__)
  constexpr size_t STREAM_FROM = size_t(1) << 20;
  if (bytes >= STREAM_FROM) {
    char* c = static_cast<char*>(p);
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(c) & 15)) & 15;
    std::memset(c, 0, head);
    const __m128i zero = _mm_setzero_si128();
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(c + i), zero);
      _mm_stream_si128(reinterpret_cast<__m128i*>(c + i + 16), zero);
      _mm_stream_si128(reinterpret_cast<__m128i*>(c + i + 32), zero);
      _mm_stream_si128(reinterpret_cast<__m128i*>(c + i + 48), zero);
    }
    std::memset(c + i, 0, bytes - i);
    _mm_sfence();  // the scatter below reads these lines: the streamed zeros must be visible first
    return;
  }
#endif
  std::memset(p, 0, bytes);
}

// Writes an output buffer of ``total`` bytes piece by piece (each piece composed in cache by the caller). Above
// 1 MiB the pieces are streamed to memory (past an unaligned head, as for a member's view into a bucket): a line
// about to be overwritten is not read first, and the output does not evict what the caller still reads.
class OutputWriter {
 public:
  explicit OutputWriter(size_t total) : stream_(total >= (size_t(1) << 20)) {}
  void write(void* dst, const void* src, size_t bytes) const {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
#if defined(__x86_64__)
    if (stream_) {
      const size_t head = std::min<size_t>((16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15, bytes);
      std::memcpy(d, s, head);
      size_t i = head;
      for (; i + 64 <= bytes; i += 64)
        for (size_t q = 0; q < 64; q += 16)
          _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + q),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + q)));
      std::memcpy(d + i, s + i, bytes - i);
      return;
    }
#endif
    std::memcpy(d, s, bytes);
  }
  // Streamed stores must be visible before anyone reads the output.
  void finish() const {
#if defined(__x86_64__)
    if (stream_) _mm_sfence();
#endif
  }

 private:
  bool stream_;
};
