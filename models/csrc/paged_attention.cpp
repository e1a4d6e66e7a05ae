// Paged attention over the token-slot KV pool on CPU: one operator for decode and verify passes.
//
// The PyTorch path (models/attention.py `_attend`) gathers each request's keys and values out of
// the pool, then runs SDPA or two batched products: ~15 tensor ops a layer, each with its dispatch
// and its own pass over memory, and SDPA's CPU kernels cost 40-2000 us a call for the few queries
// over a few hundred keys of a decode step (AMD Zen 4, 2 threads, bf16; docs/benchmarks.md
// "Session 48"). Here loops per (request, KV head) read its keys and values straight from the pool
// through the slot index, once for all the query rows they serve, in fp32 (bf16 operands widened as
// they load, fp32 sums and softmax, one rounding of the output: the arithmetic of the widened path).
// One query a request (decode rows, the draft's tree levels): `attend_rows`. Up to kMaxQueries
// (verify trees, the draft's extends, short prompt chunks): `attend_queries`. More: the PyTorch path.
//
//   q (T, Hq, D); k_cache, v_cache (Hkv, S, D); kv_index (B, K) slots; mask (B, 1, Q, K) bool;
//   q_index (B, Q) row of q of each request's query (T: a padded query) -> out (T, Hq, D);
//   out_rows as AttentionMetadata's, for the PyTorch path that long queries take

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <vector>

namespace {

constexpr float kMasked = -1e30f;  // a masked key's score: exp(kMasked - top) is 0

// A row of `dim` values as fp32 (bf16 widened: its bits are the top half of an fp32's).
inline void widen(const float* src, float* dst, int64_t dim) { std::copy(src, src + dim, dst); }

inline void widen(const at::BFloat16* src, float* dst, int64_t dim) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
}

// Softmax's numerator in place over a row of `n` scores, shifted by their top: returns the row's sum.
// Masked keys score kMasked (finite: the file builds with -ffast-math), so this is one plain loop a key,
// which the compiler vectorizes, exp included, and a masked key's term is exactly 0.
inline float exp_sum(float* scores, int64_t n, float shift) {
  float sum = 0.f;
  for (int64_t k = 0; k < n; ++k) {
    scores[k] = std::exp(scores[k] - shift);
    sum += scores[k];
  }
  return sum;
}

// attend_queries' tile of keys and block of query rows (see there).
constexpr int64_t kTile = 16, kRowBlock = 4;
// More queries a request than this (long prompt chunks after a prefix) go to the PyTorch path, whose SDPA
// is built for long queries; these loops were measured up to 16 (bench.attention). models/attention.py's
// LONG_QUERIES, the same bound, keeps such chunks in passes of their own.
constexpr int64_t kMaxQueries = 16;
// kTile floats, one vector (two on AVX2): GCC's and Clang's vector extension, whatever -march=native gives.
typedef float f32x16 __attribute__((vector_size(kTile * sizeof(float))));

// One call's operands, as raw pointers and sizes, and the loops over them.
template <typename scalar_t>
struct PagedPass {
  const scalar_t *qp, *kp, *vp;  // q (T, Hq, D); k_cache, v_cache (Hkv, S, D)
  const int64_t *index, *q_rows;  // kv_index (B, K); q_index (B, Q)
  const bool* allowed;  // mask (B, 1, Q, K)
  scalar_t* op;  // out (T, Hq, D)
  int64_t tokens, heads, dim, kv_heads, slots, batch, queries, keys, group;
  float fscale;

  PagedPass(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& kv_index,
            const at::Tensor& mask, const at::Tensor& q_index, at::Tensor& out, double scale)
      : qp(q.data_ptr<scalar_t>()), kp(k_cache.data_ptr<scalar_t>()), vp(v_cache.data_ptr<scalar_t>()),
        index(kv_index.data_ptr<int64_t>()), q_rows(q_index.data_ptr<int64_t>()), allowed(mask.data_ptr<bool>()),
        op(out.data_ptr<scalar_t>()), tokens(q.size(0)), heads(q.size(1)), dim(q.size(2)), kv_heads(k_cache.size(0)),
        slots(k_cache.size(1)), batch(q_index.size(0)), queries(q_index.size(1)), keys(kv_index.size(1)),
        group(heads / kv_heads), fscale(static_cast<float>(scale)) {}

  void attend_rows() const {
    // One query a request (the caller sends other passes elsewhere), so no query is padded.
    // One work item per (request, KV head): the query heads of its group read each key and value once,
    // together. A chunk of items should hold a few thousand key reads, so that starting the threads
    // does not outweigh the work.
    const int64_t items = batch * kv_heads;
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(keys * group, 1));
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(group * keys), qf(group * dim), acc(group * dim), row(dim), top(group), total(group);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kvh = item % kv_heads, b = item / kv_heads;
        const int64_t t = q_rows[b];
        const scalar_t* qrow = qp + (t * heads + kvh * group) * dim;  // (G, D): the group's query heads
        widen(qrow, qf.data(), group * dim);
        for (int64_t i = 0; i < group * dim; ++i) qf[i] *= fscale;
        const bool* m = allowed + b * keys;
        const int64_t* idx = index + b * keys;
        const scalar_t* kbase = kp + kvh * slots * dim;
        const scalar_t* vbase = vp + kvh * slots * dim;
        // Masked keys score kMasked, for `exp_sum`.
        std::fill(scores.begin(), scores.end(), kMasked);
        std::fill(top.begin(), top.end(), kMasked);
        for (int64_t k = 0; k < keys; ++k) {
          if (!m[k]) continue;
          widen(kbase + idx[k] * dim, row.data(), dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            float s = 0.f;
            for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
            scores[g * keys + k] = s;
            top[g] = std::max(top[g], s);
          }
        }
        for (int64_t g = 0; g < group; ++g) total[g] = exp_sum(scores.data() + g * keys, keys, top[g]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < keys; ++k) {
          if (!m[k]) continue;
          widen(vbase + idx[k] * dim, row.data(), dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * keys + k];
            float* ag = acc.data() + g * dim;
            for (int64_t d = 0; d < dim; ++d) ag[d] += p * row[d];
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
          scalar_t* orow = op + (t * heads + kvh * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<scalar_t>(acc[g * dim + d] * inv);
        }
      }
    });
  }

  // Several queries a request (verify trees, the draft's extends over accepted tokens, short prompt
  // chunks). A work item is (request, KV head, a run of its queries): its rows are the group's query heads
  // for each of those queries, R = Q' * G (row qi * G + g). It reads the keys kTile at a time, widened
  // into a transposed tile (D, kTile): a tile's scores are then R x kTile products summed over D with the
  // keys in the vector lanes (no horizontal sums), kRowBlock rows at once (independent sums that hide an
  // FMA's latency, over one load of the tile). The values are widened once an item, then summed into kRowBlock
  // rows' outputs at a time, held in registers. A padded query (q_index T) attends to its one key; its
  // output is not written. A request's queries are split over items only where there are fewer
  // (request, KV head) pairs than twice the threads (one request's tree: 3 KV heads on 2 threads).
  void attend_queries() const {
    const int64_t chunks = dim / kTile;
    const int64_t pairs = batch * kv_heads;
    const int64_t splits = std::min(queries, std::max<int64_t>(1, (2 * at::get_num_threads() + pairs - 1) / pairs));
    const int64_t per_split = (queries + splits - 1) / splits;
    const int64_t most_rows = (per_split * group + kRowBlock - 1) / kRowBlock * kRowBlock;  // zero rows past R
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(keys * per_split * group, 1));
    at::parallel_for(0, pairs * splits, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(most_rows * dim), scores(most_rows * keys), total(most_rows), row(dim);
      std::vector<f32x16> tile(dim), values(keys * chunks);  // (D, kTile) keys transposed; (K, D) values
      for (int64_t item = begin; item < end; ++item) {
        const int64_t split = item % splits, kvh = (item / splits) % kv_heads, b = item / (splits * kv_heads);
        const int64_t first = split * per_split, count = std::min(per_split, queries - first);
        if (count <= 0) continue;
        const int64_t rows = count * group;
        const int64_t* t_of = q_rows + b * queries + first;
        std::fill(qf.begin(), qf.end(), 0.f);
        for (int64_t qi = 0; qi < count; ++qi) {
          if (t_of[qi] >= tokens) continue;
          float* dst = qf.data() + qi * group * dim;
          widen(qp + (t_of[qi] * heads + kvh * group) * dim, dst, group * dim);
          for (int64_t i = 0; i < group * dim; ++i) dst[i] *= fscale;
        }
        const bool* m = allowed + (b * queries + first) * keys;  // (Q', K)
        const int64_t* idx = index + b * keys;
        const scalar_t* kbase = kp + kvh * slots * dim;
        const scalar_t* vbase = vp + kvh * slots * dim;
        for (int64_t k0 = 0; k0 < keys; k0 += kTile) {
          const int64_t n = std::min(kTile, keys - k0);
          for (int64_t j = 0; j < kTile; ++j) {
            if (j < n) {
              widen(kbase + idx[k0 + j] * dim, row.data(), dim);
            } else {
              std::fill(row.begin(), row.end(), 0.f);
            }
            for (int64_t d = 0; d < dim; ++d) tile[d][j] = row[d];
          }
          for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
            const float* q0 = qf.data() + r0 * dim;
            f32x16 s[kRowBlock] = {};
            for (int64_t d = 0; d < dim; ++d) {
              const f32x16 t = tile[d];
              for (int64_t i = 0; i < kRowBlock; ++i) s[i] += q0[i * dim + d] * t;
            }
            for (int64_t i = 0; i < kRowBlock && r0 + i < rows; ++i) {
              const bool* mr = m + ((r0 + i) / group) * keys + k0;
              float* sr = scores.data() + (r0 + i) * keys + k0;
              for (int64_t j = 0; j < n; ++j) sr[j] = mr[j] ? s[i][j] : kMasked;
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = scores.data() + r * keys;
          total[r] = exp_sum(sr, keys, *std::max_element(sr, sr + keys));
        }
        for (int64_t k = 0; k < keys; ++k) widen(vbase + idx[k] * dim, reinterpret_cast<float*>(&values[k * chunks]), dim);
        for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
          for (int64_t c = 0; c < chunks; ++c) {
            f32x16 acc[kRowBlock] = {};
            for (int64_t k = 0; k < keys; ++k) {
              const f32x16 v = values[k * chunks + c];
              for (int64_t i = 0; i < kRowBlock; ++i) acc[i] += scores[(r0 + i) * keys + k] * v;
            }
            for (int64_t i = 0; i < kRowBlock && r0 + i < rows; ++i) {
              const int64_t r = r0 + i, qi = r / group, g = r % group;
              if (t_of[qi] >= tokens) continue;
              const float inv = total[r] > 0.f ? 1.f / total[r] : 0.f;
              scalar_t* orow = op + (t_of[qi] * heads + kvh * group + g) * dim + c * kTile;
              for (int64_t j = 0; j < kTile; ++j) orow[j] = static_cast<scalar_t>(acc[i][j] * inv);
            }
          }
        }
      }
    });
  }
};

// Writes the new tokens' K/V into their slots, then attends: the whole of `paged_attention` for a
// pass attending in one piece (models/attention.py). Passes of more than kMaxQueries queries a request
// (prompt chunks after a prefix), and of several over heads whose width is not a multiple of kTile, go to
// the PyTorch path's operator instead, `specgraph::paged_attention`.
// The choice is made here, at run time, so that one compiled graph serves every kind of pass.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& kv_index,
                           const at::Tensor& mask, const at::Tensor& q_index, const at::Tensor& out_rows,
                           double scale) {
  const int64_t queries = q_index.size(1);
  if (queries > kMaxQueries || (queries > 1 && q.size(2) % kTile != 0)) {
    static const c10::OperatorHandle pytorch_path =
        c10::Dispatcher::singleton().findSchemaOrThrow("specgraph::paged_attention", "");
    torch::jit::Stack stack{q, k, v, k_cache, v_cache, out_slots, kv_index, mask, q_index, out_rows, scale};
    pytorch_path.callBoxed(stack);
    return stack[0].toTensor();
  }
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q (T, Hq, D) and contiguous caches (Hkv, S, D) expected");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_attention: q and the caches differ in dtype");
  k_cache.index_copy_(1, out_slots, k.transpose(0, 1));
  v_cache.index_copy_(1, out_slots, v.transpose(0, 1));
  const at::Tensor qc = q.contiguous(), index = kv_index.contiguous(), rows = q_index.contiguous();
  const at::Tensor allowed = mask.contiguous();
  at::Tensor out = at::empty_like(qc);
  const bool one_query = queries == 1;
  if (q.scalar_type() == at::kFloat) {
    const PagedPass<float> pass(qc, k_cache, v_cache, index, allowed, rows, out, scale);
    one_query ? pass.attend_rows() : pass.attend_queries();
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16 expected, got ", q.scalar_type());
    const PagedPass<at::BFloat16> pass(qc, k_cache, v_cache, index, allowed, rows, out, scale);
    one_query ? pass.attend_rows() : pass.attend_queries();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(specgraph_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_slots, "
        "Tensor kv_index, Tensor mask, Tensor q_index, Tensor out_rows, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
