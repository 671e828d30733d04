// specjax CPU kernel: attention of T new tokens over the committed KV cache and over themselves (decode and
// chain/tree verification), for one layer.
//
// Why it exists: XLA's version (specjax.models.llama.prefix_tree_attention) is a dozen small operations per layer
// over every slot of the cache's capacity, masked: about 150 us per layer at a 512-slot cache for one token, and
// several times that at 2048 slots however short the text. This kernel is one call per layer that reads only the
// committed prefix of each sequence.
//
// Inputs (the contract of prefix_tree_attention, which is also the reference):
//   q [B, T, Hq, D] float32; k_cache, v_cache [B, Hkv, S, D] float32 or bfloat16, of which slots s < lengths[b]
//   are visible to every new token; k_new, v_new [B, T, Hkv, D] float32 (not yet in the cache); lengths [B] int32
//   (clipped to [0, S] here); tree_mask [B, T, T] bool (token t sees new token j); attribute scale.
//   Output [B, T, Hq, D] float32. A query that sees nothing gets zeros.
//
// Work: items are (sequence, KV head, block of kSlotBlock slots), the slots counted as they will be once the new
// tokens are written, so each new token lands in the block (and column) it will occupy in the cache. In a tree a
// node will occupy the slot of its depth (its path's tokens are written in order once accepted), so a node sits at
// slot lengths[b] + depth: siblings share a slot, and each query places the one node of each depth it sees there. Each item
// scores all G * T queries of its KV head against its slots with the register tiles of tiles.h (so K is read once
// per item, not once per query), exponentiates, and accumulates its part of the output with running max, sum and
// weighted V. The parts of a pair are merged in block order: the result does not depend
// on how many threads ran or which item ran where. Small calls run on the calling thread alone, because waking
// XLA's pool costs more than the work.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tiles.h"

namespace {

using namespace specjax_cpu;

constexpr int64_t kSlotBlock = 128;         // prefix slots per item
constexpr int64_t kThreadedWork = 1024;  // query x slot scores below which the pool is not used
constexpr int kOutQueries = 6;              // queries per pass over V: 6 x 16-lane accumulators + 1 V vector

typedef int32_t i32x16 __attribute__((vector_size(64)));

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n through the exponent
// bits. Relative error about 2e-7. Inputs below -87 (including -inf, the masked scores) give exactly 0.
inline f32x16 exp16(f32x16 x) {
  const f32x16 lo = f32x16{} - 87.0f;
  const f32x16 xc = x < lo ? lo : (x > 88.0f ? f32x16{} + 88.0f : x);
  // Adding 1.5 * 2^23 rounds to the nearest integer in the low mantissa bits (round-to-nearest mode).
  const f32x16 magic = f32x16{} + 12582912.0f;
  const f32x16 t = xc * 1.44269504088896341f + magic;
  const f32x16 n = t - magic;
  f32x16 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i32x16 ti;
  std::memcpy(&ti, &t, sizeof(ti));
  const i32x16 bits = (ti - 0x4B400000 + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const f32x16 e = p * scale;
  return x < lo ? f32x16{} : e;
}

struct Dims {
  int64_t B, T, Hq, Hkv, S, D, G, N;  // N = G * T queries per KV head
};

// One item's part of the output: out rows n = t * G + g (the order of q's heads within one token), [N, D], with
// each row's running max and sum of exponentials.
struct Part {
  float* o;
  float* m;
  float* l;
};

// Scores of `rows` keys (row-major [rows, D]) against the N queries, into sc[n * stride + i]. qf: the queries,
// qs: the same deinterleaved for bfloat16 keys (see tiles.h).
inline void score_block(const Dims& d, const float* qf, const float*, const float* keys, int64_t rows, float* sc,
                        int64_t stride) {
  row_range<F32Weights>(qf, keys, sc, d.N, d.D, stride, 0, rows);
}

inline void score_block(const Dims& d, const float*, const float* qs, const uint16_t* keys, int64_t rows, float* sc,
                        int64_t stride) {
  row_range<BF16Weights>(qs, keys, sc, d.N, d.D, stride, 0, rows);
}

// The block's new keys against the N queries, scored by the tile the cache's keys go through: a float32 cache's
// or, for a bfloat16 cache, the bfloat16 tile over the keys as the cache will hold them (the caller rounds them
// to bfloat16 first). A key then scores the same whether it is still a new token of a verify block or already in
// the cache, so a plain step and a verify block of a bfloat16 model see the same scores.
inline void score_new(const Dims& d, const float* qf, const float* qs, const float* knew, int64_t count, float* sc,
                      int64_t stride, const float*) {
  score_block(d, qf, qs, knew, count, sc, stride);
}

inline void score_new(const Dims& d, const float* qf, const float* qs, const float* knew, int64_t count, float* sc,
                      int64_t stride, const uint16_t*) {
  thread_local std::vector<uint16_t> k16;
  k16.resize(size_t(count * d.D));
  for (int64_t i = 0; i < count * d.D; ++i) {
    uint32_t u;
    std::memcpy(&u, knew + i, sizeof(u));
    k16[size_t(i)] = uint16_t(u >> 16);  // exact: the values are bfloat16 widened
  }
  score_block(d, qf, qs, k16.data(), count, sc, stride);
}

inline float value_at(const float* p) { return *p; }
inline float value_at(const uint16_t* p) { return bf16_to_f32(*p); }

inline f32x16 load_values(const float* p) { return load_f32(p); }
inline f32x16 load_values(const uint16_t* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// o[n, :] += sum_c p[n * stride + c] * v[c, :] for c in [0, cols) and NQ queries from n0. NQ is a template
// argument so the accumulators stay in registers.
template <int NQ, typename V>
void accumulate_queries(const Dims& d, const float* p, int64_t stride, const V* v, int64_t cols, float* o,
                        int64_t n0) {
  const int64_t dv = d.D - d.D % kLanes;
  for (int64_t e = 0; e < dv; e += kLanes) {
    f32x16 acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = load_f32(o + (n0 + i) * d.D + e);
    for (int64_t c = 0; c < cols; ++c) {
      const f32x16 vv = load_values(v + c * d.D + e);
      for (int i = 0; i < NQ; ++i) acc[i] += p[(n0 + i) * stride + c] * vv;
    }
    for (int i = 0; i < NQ; ++i) std::memcpy(o + (n0 + i) * d.D + e, &acc[i], sizeof(f32x16));
  }
  for (int64_t e = dv; e < d.D; ++e)
    for (int i = 0; i < NQ; ++i) {
      float s = o[(n0 + i) * d.D + e];
      for (int64_t c = 0; c < cols; ++c) s += p[(n0 + i) * stride + c] * value_at(v + c * d.D + e);
      o[(n0 + i) * d.D + e] = s;
    }
}

// All N queries, kOutQueries at a time (split evenly, like the score tiles).
template <typename V>
void accumulate(const Dims& d, const float* p, int64_t stride, const V* v, int64_t cols, float* o) {
  const int64_t groups = (d.N + kOutQueries - 1) / kOutQueries;
  int64_t n0 = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int nq = int((d.N - n0) / (groups - g));
    switch (nq) {
      case 1: accumulate_queries<1>(d, p, stride, v, cols, o, n0); break;
      case 2: accumulate_queries<2>(d, p, stride, v, cols, o, n0); break;
      case 3: accumulate_queries<3>(d, p, stride, v, cols, o, n0); break;
      case 4: accumulate_queries<4>(d, p, stride, v, cols, o, n0); break;
      case 5: accumulate_queries<5>(d, p, stride, v, cols, o, n0); break;
      default: accumulate_queries<6>(d, p, stride, v, cols, o, n0); break;
    }
    n0 += nq;
  }
}

// In place over sc[n * stride + c], c < cols: scale, exponentiate against the row max; fills the part's m and l.
// stride is a whole number of vectors; entries in [cols, stride) become 0.
void softmax_rows(const Dims& d, float* sc, int64_t stride, int64_t cols, float scale, Part part) {
  for (int64_t n = 0; n < d.N; ++n) {
    float* row = sc + n * stride;
    // cols is padded to whole vectors in the buffer (stride); the padding is set to -inf first.
    for (int64_t c = cols; c < stride; ++c) row[c] = -std::numeric_limits<float>::infinity();
    f32x16 mv = f32x16{} - std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < stride; c += kLanes) {
      const f32x16 x = load_f32(row + c) * scale;
      std::memcpy(row + c, &x, sizeof(x));
      mv = mv > x ? mv : x;
    }
    float m = mv[0];
    for (int l = 1; l < kLanes; ++l) m = std::max(m, mv[l]);
    part.m[n] = m;
    if (!std::isfinite(m)) {
      // Nothing visible in this part: zero weights, and a sum of 0 that the merge skips.
      std::fill(row, row + cols, 0.f);
      part.l[n] = 0.f;
      continue;
    }
    f32x16 sum{};
    for (int64_t c = 0; c < stride; c += kLanes) {
      const f32x16 e = exp16(load_f32(row + c) - m);
      std::memcpy(row + c, &e, sizeof(e));
      sum += e;
    }
    const float l = hsum(sum);
    part.l[n] = l;
  }
}

// The slot offset of each new token of one sequence: its depth (the number of new tokens it sees, less itself)
// when every query sees at most one new token per depth, which holds for any tree mask (a node sees its
// ancestors and itself); else, for masks that are not trees, its index (every token its own slot).
inline void slot_offsets(const bool* tree, int64_t T, std::vector<int64_t>& off) {
  off.assign(size_t(T), 0);
  for (int64_t t = 0; t < T; ++t) {
    int64_t seen = 0;
    for (int64_t j = 0; j < T; ++j) seen += tree[t * T + j];
    off[size_t(t)] = std::max<int64_t>(seen - 1, 0);
  }
  std::vector<char> used(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(used.begin(), used.end(), 0);
    for (int64_t j = 0; j < T; ++j) {
      if (!tree[t * T + j]) continue;
      if (used[size_t(off[size_t(j)])]) {
        for (int64_t i = 0; i < T; ++i) off[size_t(i)] = i;
        return;
      }
      used[size_t(off[size_t(j)])] = 1;
    }
  }
}

// o[n, :] += sum_c p[n * stride + c] * v[node[n * width + c], :] for c in [0, width) with node >= 0: the new
// tokens' part, whose value row differs per query in a tree. Column by column, as accumulate_queries adds, so a
// query gets the sums it would get with those values in the cache; a column a query does not see adds p = 0.
void accumulate_fresh(const Dims& d, const float* p, int64_t stride, const float* v, const int64_t* node,
                      int64_t width, float* o) {
  const int64_t dv = d.D - d.D % kLanes;
  for (int64_t n = 0; n < d.N; ++n) {
    const float* pn = p + n * stride;
    const int64_t* nn = node + n * width;
    float* on = o + n * d.D;
    for (int64_t e = 0; e < dv; e += kLanes) {
      f32x16 acc = load_f32(on + e);
      for (int64_t c = 0; c < width; ++c)
        if (nn[c] >= 0) acc += pn[c] * load_f32(v + nn[c] * d.D + e);
      std::memcpy(on + e, &acc, sizeof(f32x16));
    }
    for (int64_t e = dv; e < d.D; ++e) {
      float s = on[e];
      for (int64_t c = 0; c < width; ++c)
        if (nn[c] >= 0) s += pn[c] * v[nn[c] * d.D + e];
      on[e] = s;
    }
  }
}

template <typename KV>
void attend_item(const Dims& d, int64_t b, int64_t h, int64_t blk, int64_t L, const float* q, const KV* kc,
                 const KV* vc, const float* kn, const float* vn, const bool* tree, const int64_t* off, float scale,
                 Part part, std::vector<float>& buf) {
  // Block blk covers slots [s0, s1) of the sequence as it will be once the new tokens are written (new token j at
  // slot L + off[j]): its committed slots, then the new tokens' slots that fall in it, at the columns they will
  // have there. A token is then scored, exponentiated and summed in the same block, column and order whether it
  // is a new token of this call or already in the cache, so a chain or a tree verified in one call gives each
  // token the sums of the one-token steps along its path.
  const int64_t s0 = blk * kSlotBlock, s1 = s0 + kSlotBlock;
  const int64_t rows = std::max<int64_t>(0, std::min(L, s1) - s0);
  const int64_t c0 = std::clamp<int64_t>(s0 - L, 0, d.T), c1 = std::clamp<int64_t>(s1 - L, 0, d.T);
  thread_local std::vector<int64_t> in_block, node;
  in_block.clear();
  for (int64_t j = 0; j < d.T; ++j)
    if (off[j] >= c0 && off[j] < c1) in_block.push_back(j);
  const int64_t fresh = int64_t(in_block.size());
  const int64_t width = fresh > 0 ? c1 - c0 : 0;  // the new tokens' columns: one per slot offset
  const int64_t cols = rows + width;
  const int64_t stride = cols + (-cols & (kLanes - 1));
  buf.resize(size_t(2 * d.N * d.D + d.N * stride + 2 * d.T * d.D + d.N * d.T));
  float* qf = buf.data();
  float* qs = qf + d.N * d.D;
  float* sc = qs + d.N * d.D;
  float* knew = sc + d.N * stride;
  float* vnew = knew + d.T * d.D;
  float* snew = vnew + d.T * d.D;  // [N, fresh] scores of the block's new tokens, in node order
  // Queries of this KV head, row n = t * G + g: G consecutive heads of token t are contiguous in q.
  for (int64_t t = 0; t < d.T; ++t)
    std::memcpy(qf + t * d.G * d.D, q + ((b * d.T + t) * d.Hq + h * d.G) * d.D, sizeof(float) * d.G * d.D);
  if (sizeof(KV) == 2) deinterleave(qf, qs, d.N, d.D);
  std::fill(part.o, part.o + d.N * d.D, 0.f);
  const KV* kh = kc + ((b * d.Hkv + h) * d.S + std::min(s0, d.S)) * d.D;
  const KV* vh = vc + ((b * d.Hkv + h) * d.S + std::min(s0, d.S)) * d.D;
  if (rows > 0) score_block(d, qf, qs, kh, rows, sc, stride);
  if (fresh > 0) {
    for (int64_t i = 0; i < fresh; ++i) {
      const int64_t j = in_block[size_t(i)];
      std::memcpy(knew + i * d.D, kn + ((b * d.T + j) * d.Hkv + h) * d.D, sizeof(float) * d.D);
      std::memcpy(vnew + i * d.D, vn + ((b * d.T + j) * d.Hkv + h) * d.D, sizeof(float) * d.D);
    }
    score_new(d, qf, qs, knew, fresh, snew, fresh, static_cast<const KV*>(nullptr));
    // Each query's row: the score of the new token it sees at each slot offset, -inf where it sees none.
    node.assign(size_t(d.N * width), -1);
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t n = 0; n < d.N; ++n) {
      const bool* sees = tree + (b * d.T + n / d.G) * d.T;
      float* row = sc + n * stride + rows;
      std::fill(row, row + width, ninf);
      for (int64_t i = 0; i < fresh; ++i) {
        const int64_t j = in_block[size_t(i)];
        if (!sees[j]) continue;
        row[off[j] - c0] = snew[n * fresh + i];
        node[size_t(n * width + off[j] - c0)] = i;
      }
    }
  }
  softmax_rows(d, sc, stride, cols, scale, part);
  if (rows > 0) accumulate(d, sc, stride, vh, rows, part.o);
  if (fresh > 0) accumulate_fresh(d, sc + rows, stride, vnew, node.data(), width, part.o);
}

template <typename KV>
void run(ffi::ThreadPool& pool, const Dims& d, const float* q, const KV* kc, const KV* vc, const float* kn,
         const float* vn, const int32_t* lengths, const bool* tree, float scale, float* out) {
  // Items in (sequence, head, block) order; first[b] indexes sequence b's first item.
  std::vector<int64_t> len(d.B), blocks(d.B), first(d.B + 1, 0), offsets(size_t(d.B * d.T)), off;
  int64_t work = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    slot_offsets(tree + b * d.T * d.T, d.T, off);
    std::copy(off.begin(), off.end(), offsets.begin() + b * d.T);
    len[b] = std::min<int64_t>(std::max<int64_t>(lengths[b], 0), d.S);
    // Blocks over the slots the sequence will have with the new tokens written (see attend_item).
    blocks[b] = std::max<int64_t>(1, (len[b] + d.T + kSlotBlock - 1) / kSlotBlock);
    first[b + 1] = first[b] + d.Hkv * blocks[b];
    work += d.Hkv * (len[b] + d.T) * d.N;
  }
  const int64_t items = first[d.B];
  const int64_t part_size = d.N * (d.D + 2);
  std::vector<float> parts(size_t(items * part_size));
  auto part_of = [&](int64_t i) {
    float* p = parts.data() + i * part_size;
    return Part{p, p + d.N * d.D, p + d.N * d.D + d.N};
  };
  parallel_items(pool, items, work >= kThreadedWork, [&](int64_t i) {
    const int64_t b = int64_t(std::upper_bound(first.begin(), first.end(), i) - first.begin()) - 1;
    const int64_t r = i - first[b], h = r / blocks[b], blk = r % blocks[b];
    thread_local std::vector<float> buf;
    attend_item(d, b, h, blk, len[b], q, kc, vc, kn, vn, tree, offsets.data() + b * d.T, scale, part_of(i), buf);
  });
  // Merge the blocks of each (sequence, head) in block order: out = sum_k e^(m_k - M) o_k / sum_k e^(m_k - M) l_k.
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hkv; ++h) {
      const int64_t i0 = first[b] + h * blocks[b];
      for (int64_t n = 0; n < d.N; ++n) {
        const int64_t t = n / d.G, g = n % d.G;
        float* o = out + ((b * d.T + t) * d.Hq + h * d.G + g) * d.D;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < blocks[b]; ++k) {
          const Part p = part_of(i0 + k);
          if (p.l[n] > 0.f) mx = std::max(mx, p.m[n]);
        }
        std::fill(o, o + d.D, 0.f);
        if (!std::isfinite(mx)) continue;
        float l = 0.f;
        for (int64_t k = 0; k < blocks[b]; ++k) {
          const Part p = part_of(i0 + k);
          if (!(p.l[n] > 0.f)) continue;
          const float w = blocks[b] == 1 ? 1.f : std::exp(p.m[n] - mx);
          l += w * p.l[n];
          for (int64_t e = 0; e < d.D; ++e) o[e] += w * p.o[n * d.D + e];
        }
        const float inv = 1.f / l;
        for (int64_t e = 0; e < d.D; ++e) o[e] *= inv;
      }
    }
}

ffi::Error PrefixAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                               ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> tree_mask, float scale,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), nd = k_new.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || nd.size() != 4)
    return ffi::Error::InvalidArgument("prefix_attention: q, k_cache and k_new must be 4-D");
  Dims d{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], 0, 0};
  if (d.Hkv == 0 || d.Hq % d.Hkv != 0 || kd[0] != d.B || kd[3] != d.D || nd[0] != d.B || nd[1] != d.T ||
      nd[2] != d.Hkv || nd[3] != d.D)
    return ffi::Error::InvalidArgument("prefix_attention: q, the cache and the new K/V disagree on shapes");
  if (k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("prefix_attention: k_cache and v_cache must have one dtype");
  d.G = d.Hq / d.Hkv;
  d.N = d.G * d.T;
  if (d.B == 0 || d.T == 0 || d.Hq == 0 || d.D == 0) return ffi::Error::Success();
  if (k_cache.element_type() == ffi::F32) {
    run(pool, d, q.typed_data(), static_cast<const float*>(k_cache.untyped_data()),
        static_cast<const float*>(v_cache.untyped_data()), k_new.typed_data(), v_new.typed_data(),
        lengths.typed_data(), tree_mask.typed_data(), scale, out->typed_data());
  } else if (k_cache.element_type() == ffi::BF16) {
    run(pool, d, q.typed_data(), static_cast<const uint16_t*>(k_cache.untyped_data()),
        static_cast<const uint16_t*>(v_cache.untyped_data()), k_new.typed_data(), v_new.typed_data(),
        lengths.typed_data(), tree_mask.typed_data(), scale, out->typed_data());
  } else {
    return ffi::Error::InvalidArgument("prefix_attention: the cache must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPrefixAttention, PrefixAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
