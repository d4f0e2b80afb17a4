// Fused CPU kernels of the sparse allreduce's arithmetic (horovod_topk/torch/sparse_rounds.py), for float32 values,
// residuals and outputs: the same results as that module's torch operations, one walk over the entries per phase.
//
// Why: the torch version runs each phase as ~20 vectorized operations over every entry of a bucket (sorts, a unique,
// gathers through index tables, where()s), each a pass with an allocation of its own; on a CPU the three phases cost
// ~8x one elementwise pass over a ResNet-50 per step. Here:
//   fill_send       puts this rank's entries into the alltoall's rows by owner, in selection order (a counter per
//                   owner); entries over an owner's capacity go straight back into the residual;
//   fill_owned      sums what the P senders sent for each index of this rank's region in an open-addressing table,
//                   in the senders' order (so the float sums are the torch version's, bit for bit), and writes the
//                   `kept` largest (non-finite first, ties to the lower index) in that order;
//   return_dropped  marks every index some owner kept, returns this rank's sent entries that are unmarked to its
//                   residual (finite values only), and clears the marks;
//   apply_member    zeroes a member's output and adds every owner's kept sums into it, scaled.
// Every index read from another rank is checked before anything is written: a payload from a rank with another
// configuration raises instead of writing out of bounds.
//
// Wire format (core/exchange.py SparseAllreduceLayouts): in a row of the alltoall, member j's block is `capacity`
// int32 indices at byte `send_at`, then `capacity` values at `send_at + send_values`; in a row of the allgather its
// kept sums are `kept` indices at `kept_at` and values at `kept_at + kept_values`. Unused slots hold index -1.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "zero_bytes.h"

namespace {

// The columns of the member table (int64, one row per member), written by sparse_rounds.py's _FusedGroup.
enum Field { K, NUMEL, CAPACITY, KEPT, SEND_AT, SEND_VALUES, KEPT_AT, KEPT_VALUES, PAYLOAD_VALUES, BASE, FIELDS };

struct Member {
  int64_t f[FIELDS];
  int64_t operator[](Field x) const { return f[x]; }
};

std::vector<Member> members_of(const torch::Tensor& table) {
  TORCH_CHECK(table.dim() == 2 && table.size(1) == FIELDS && table.scalar_type() == at::kLong &&
                  table.is_contiguous() && table.device().is_cpu(),
              "horovod-topk: the member table must be a contiguous CPU int64 tensor of ", int(FIELDS), " columns");
  std::vector<Member> members(static_cast<size_t>(table.size(0)));
  if (!members.empty())
    std::memcpy(members.data(), table.data_ptr<int64_t>(), sizeof(Member) * members.size());
  return members;
}

void check_bytes(const torch::Tensor& t, int64_t bytes, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kByte && t.numel() >= bytes,
              "horovod-topk: ", what, " must be a contiguous CPU uint8 tensor of at least ", bytes, " bytes, got ",
              t.numel());
}

void check_floats(const torch::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat && t.numel() == numel,
              "horovod-topk: ", what, " must be a contiguous CPU float32 tensor of ", numel, " elements");
}

// core.exchange.region_of: the owner of ``index`` among ``world`` ranks (the product stays below 2^63).
inline int64_t owner_of(int32_t index, int64_t world, uint64_t multiplier) {
  const uint64_t low = (static_cast<uint64_t>(index) * multiplier) & 0xFFFFFFFFull;
  return static_cast<int64_t>((low * static_cast<uint64_t>(world)) >> 32);
}

// Every index of ``count`` slots at ``at`` in each of ``rows`` rows of ``width`` bytes is -1 (unused) or in
// [0, numel): checked before a kernel writes anything.
void check_slots(const uint8_t* base, int64_t rows, int64_t width, int64_t at, int64_t count, int64_t numel,
                 const char* what) {
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* idx = reinterpret_cast<const int32_t*>(base + r * width + at);
    for (int64_t s = 0; s < count; ++s)
      TORCH_CHECK(idx[s] >= -1 && idx[s] < numel, "horovod-topk: the sparse allreduce's ", what, " holds index ",
                  idx[s], " for a tensor of ", numel, " elements (ranks with different configurations?)");
  }
}

// A member's fields lie inside a row of the alltoall (``send_width`` bytes) and of the allgather (``kept_width``;
// a negative width: that row is not used by the caller), 4-byte aligned: the kernels are callable from Python, so a
// wrong table must raise, not write past a row.
void check_fields(const Member& m, int64_t send_width, int64_t kept_width) {
  const bool sizes = m[K] >= 0 && m[NUMEL] >= 0 && m[NUMEL] < (int64_t(1) << 31) && m[CAPACITY] >= 0 &&
                     m[KEPT] >= 0 && m[BASE] >= 0 && m[PAYLOAD_VALUES] >= 4 * m[K];
  const bool send = send_width < 0 || (m[SEND_AT] >= 0 && m[SEND_VALUES] >= 4 * m[CAPACITY] &&
                                       m[SEND_AT] + m[SEND_VALUES] + 4 * m[CAPACITY] <= send_width);
  const bool kept = kept_width < 0 || (m[KEPT_AT] >= 0 && m[KEPT_VALUES] >= 4 * m[KEPT] &&
                                       m[KEPT_AT] + m[KEPT_VALUES] + 4 * m[KEPT] <= kept_width);
  const bool aligned = (m[SEND_AT] | m[SEND_VALUES] | m[KEPT_AT] | m[KEPT_VALUES] | m[PAYLOAD_VALUES]) % 4 == 0;
  TORCH_CHECK(sizes && send && kept && aligned, "horovod-topk: a member's fields do not fit the sparse allreduce's "
              "rows (send width ", send_width, ", kept width ", kept_width, ")");
}

inline bool finite(float v) { return std::isfinite(v); }

// The table slot of an index (a power-of-two table, ``mask`` = size - 1): MurmurHash3's finaliser. Not a
// multiplicative hash: an owner's indices are exactly those whose product with the golden ratio falls in its 1/P of
// the range (owner_of), so a Fibonacci hash would crowd them into 1/P of the table.
inline uint64_t slot_of(int32_t index, uint64_t mask) {
  uint64_t h = static_cast<uint64_t>(static_cast<uint32_t>(index));
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h & mask;
}

// Owners keep their largest sums first; a non-finite sum counts as the largest (so it reaches the update, as with a
// dense allreduce).
inline float priority(float sum) { return finite(sum) ? std::fabs(sum) : std::numeric_limits<float>::infinity(); }

void fill_send(const std::vector<torch::Tensor>& payloads, const std::vector<torch::Tensor>& residuals,
               const torch::Tensor& table, torch::Tensor rows, int64_t world, int64_t width, int64_t multiplier) {
  const std::vector<Member> members = members_of(table);
  TORCH_CHECK(payloads.size() == members.size() && residuals.size() == members.size(),
              "horovod-topk: one payload and one residual per member");
  check_bytes(rows, world * width, "the alltoall's rows");
  for (size_t j = 0; j < members.size(); ++j) {
    const Member& m = members[j];
    check_fields(m, width, -1);
    check_bytes(payloads[j], m[PAYLOAD_VALUES] + 4 * m[K], "a payload");
    check_floats(residuals[j], m[NUMEL], "a residual");
    check_slots(payloads[j].data_ptr<uint8_t>(), 1, 0, 0, m[K], m[NUMEL], "payload");
  }
  uint8_t* out = rows.data_ptr<uint8_t>();
  std::vector<int64_t> used(static_cast<size_t>(world));
  for (size_t j = 0; j < members.size(); ++j) {
    const Member& m = members[j];
    const uint8_t* payload = payloads[j].data_ptr<uint8_t>();
    const int32_t* idx = reinterpret_cast<const int32_t*>(payload);
    const float* val = reinterpret_cast<const float*>(payload + m[PAYLOAD_VALUES]);
    float* residual = residuals[j].data_ptr<float>();
    std::fill(used.begin(), used.end(), 0);
    for (int64_t e = 0; e < m[K]; ++e) {
      if (idx[e] < 0) continue;
      const int64_t o = owner_of(idx[e], world, static_cast<uint64_t>(multiplier));
      const int64_t slot = used[o]++;
      if (slot < m[CAPACITY]) {
        uint8_t* block = out + o * width + m[SEND_AT];
        reinterpret_cast<int32_t*>(block)[slot] = idx[e];
        reinterpret_cast<float*>(block + m[SEND_VALUES])[slot] = val[e];
      } else if (finite(val[e])) {  // over the owner's capacity: a later step sends it
        residual[idx[e]] += val[e];
      }
    }
  }
}

void fill_owned(const torch::Tensor& received, int64_t send_width, const torch::Tensor& table, torch::Tensor kept_row,
                int64_t world) {
  const std::vector<Member> members = members_of(table);
  check_bytes(received, world * send_width, "the alltoall's received rows");
  for (const Member& m : members) {
    check_fields(m, send_width, kept_row.numel());
    check_bytes(kept_row, m[KEPT_AT] + m[KEPT_VALUES] + 4 * m[KEPT], "the kept row");
    check_slots(received.data_ptr<uint8_t>(), world, send_width, m[SEND_AT], m[CAPACITY], m[NUMEL], "alltoall");
  }
  const uint8_t* in = received.data_ptr<uint8_t>();
  uint8_t* out = kept_row.data_ptr<uint8_t>();
  std::vector<int32_t> table_slots, keys;
  std::vector<uint64_t> order;
  std::vector<float> sums;
  for (const Member& m : members) {
    // open addressing, at most half full: the key's position in ``keys``, or -1
    uint64_t size = 16;
    while (size < static_cast<uint64_t>(2 * world * m[CAPACITY])) size <<= 1;
    table_slots.assign(size, -1);
    keys.clear();
    sums.clear();
    for (int64_t r = 0; r < world; ++r) {  // senders in order, slots in order: the torch version's summation order
      const uint8_t* block = in + r * send_width + m[SEND_AT];
      const int32_t* idx = reinterpret_cast<const int32_t*>(block);
      const float* val = reinterpret_cast<const float*>(block + m[SEND_VALUES]);
      for (int64_t s = 0; s < m[CAPACITY]; ++s) {
        const int32_t i = idx[s];
        if (i < 0) continue;
        uint64_t h = slot_of(i, size - 1);
        while (table_slots[h] >= 0 && keys[table_slots[h]] != i) h = (h + 1) & (size - 1);
        if (table_slots[h] < 0) {
          table_slots[h] = static_cast<int32_t>(keys.size());
          keys.push_back(i);
          sums.push_back(0.0f);
        }
        sums[table_slots[h]] += val[s];
      }
    }
    // One integer per sum that orders as the torch version ranks them: priority descending (the bits of a
    // non-negative float order like the float), then index ascending; a selection and a sort of plain integers.
    const int64_t n = static_cast<int64_t>(keys.size());
    const int64_t q = std::min<int64_t>(m[KEPT], n);
    order.resize(n);
    for (int64_t t = 0; t < n; ++t) {
      uint32_t bits;
      const float p = priority(sums[t]);
      std::memcpy(&bits, &p, sizeof bits);
      order[t] = (static_cast<uint64_t>(0xFFFFFFFFu - bits) << 32) | static_cast<uint32_t>(keys[t]);
    }
    if (q < n) std::nth_element(order.begin(), order.begin() + q, order.end());
    std::sort(order.begin(), order.begin() + q);
    int32_t* kept_idx = reinterpret_cast<int32_t*>(out + m[KEPT_AT]);
    float* kept_val = reinterpret_cast<float*>(out + m[KEPT_AT] + m[KEPT_VALUES]);
    for (int64_t t = 0; t < q; ++t) {
      const int32_t i = static_cast<int32_t>(order[t] & 0xFFFFFFFFu);
      uint64_t h = slot_of(i, size - 1);
      while (keys[table_slots[h]] != i) h = (h + 1) & (size - 1);
      kept_idx[t] = i;
      kept_val[t] = sums[table_slots[h]];
    }
  }
}

void return_dropped(const torch::Tensor& gathered, int64_t kept_width, const torch::Tensor& sent, int64_t send_width,
                    const std::vector<torch::Tensor>& residuals, const torch::Tensor& table, torch::Tensor marks,
                    int64_t world) {
  const std::vector<Member> members = members_of(table);
  TORCH_CHECK(residuals.size() == members.size(), "horovod-topk: one residual per member");
  check_bytes(gathered, world * kept_width, "the allgather's rows");
  check_bytes(sent, world * send_width, "this rank's alltoall rows");
  int64_t total = 0;
  for (size_t j = 0; j < members.size(); ++j) {
    const Member& m = members[j];
    check_fields(m, send_width, kept_width);
    check_floats(residuals[j], m[NUMEL], "a residual");
    check_slots(gathered.data_ptr<uint8_t>(), world, kept_width, m[KEPT_AT], m[KEPT], m[NUMEL], "allgather");
    check_slots(sent.data_ptr<uint8_t>(), world, send_width, m[SEND_AT], m[CAPACITY], m[NUMEL], "sent row");
    total = std::max(total, m[BASE] + m[NUMEL]);
  }
  TORCH_CHECK(marks.device().is_cpu() && marks.is_contiguous() && marks.scalar_type() == at::kBool &&
                  marks.numel() >= total,
              "horovod-topk: the marks must be a contiguous CPU bool tensor over the bucket's index space");
  const uint8_t* kept_rows = gathered.data_ptr<uint8_t>();
  const uint8_t* sent_rows = sent.data_ptr<uint8_t>();
  bool* mark = marks.data_ptr<bool>();
  for (size_t j = 0; j < members.size(); ++j) {
    const Member& m = members[j];
    bool* member_marks = mark + m[BASE];
    for (int pass = 0; pass < 2; ++pass) {  // set the marks, then (after the returns) clear them
      for (int64_t o = 0; o < world; ++o) {
        const int32_t* idx = reinterpret_cast<const int32_t*>(kept_rows + o * kept_width + m[KEPT_AT]);
        for (int64_t t = 0; t < m[KEPT]; ++t)
          if (idx[t] >= 0) member_marks[idx[t]] = (pass == 0);
      }
      if (pass == 1) break;
      float* residual = residuals[j].data_ptr<float>();
      for (int64_t o = 0; o < world; ++o) {
        const uint8_t* block = sent_rows + o * send_width + m[SEND_AT];
        const int32_t* idx = reinterpret_cast<const int32_t*>(block);
        const float* val = reinterpret_cast<const float*>(block + m[SEND_VALUES]);
        for (int64_t s = 0; s < m[CAPACITY]; ++s)
          if (idx[s] >= 0 && !member_marks[idx[s]] && finite(val[s])) residual[idx[s]] += val[s];
      }
    }
  }
}

void apply_member(const torch::Tensor& gathered, int64_t kept_width, const torch::Tensor& table, int64_t member,
                  torch::Tensor out, double scale, int64_t world) {
  const std::vector<Member> members = members_of(table);
  TORCH_CHECK(member >= 0 && member < static_cast<int64_t>(members.size()), "horovod-topk: no member ", member);
  const Member& m = members[member];
  check_fields(m, -1, kept_width);
  check_bytes(gathered, world * kept_width, "the allgather's rows");
  check_floats(out, m[NUMEL], "an output");
  const uint8_t* rows = gathered.data_ptr<uint8_t>();
  check_slots(rows, world, kept_width, m[KEPT_AT], m[KEPT], m[NUMEL], "allgather");
  float* o = out.data_ptr<float>();
  zero_bytes(static_cast<void*>(o), static_cast<size_t>(m[NUMEL]) * sizeof(float));
  const float s = static_cast<float>(scale);  // as torch multiplies a float32 tensor by a Python float
  for (int64_t r = 0; r < world; ++r) {
    const int32_t* idx = reinterpret_cast<const int32_t*>(rows + r * kept_width + m[KEPT_AT]);
    const float* val = reinterpret_cast<const float*>(rows + r * kept_width + m[KEPT_AT] + m[KEPT_VALUES]);
    for (int64_t t = 0; t < m[KEPT]; ++t)
      if (idx[t] >= 0) o[idx[t]] += val[t] * s;
  }
}

}  // namespace

void define_sparse_rounds(pybind11::module_& m) {
  m.def("sparse_fill_send", &fill_send, "the sparse allreduce's phase 1: this rank's entries into the alltoall rows");
  m.def("sparse_fill_owned", &fill_owned, "phase 2: this rank's kept sums of its region into its allgather row");
  m.def("sparse_return_dropped", &return_dropped, "phase 3: this rank's sent entries no owner kept, to its residual");
  m.def("sparse_apply_member", &apply_member, "phase 3: one member's averaged gradient from the kept sums");
}
