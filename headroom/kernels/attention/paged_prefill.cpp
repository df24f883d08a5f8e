// Attention for a step's query rows, any number per sequence (prefill chunks, and decode
// rows beside them), over the paged KV cache read in place. A chunk's work items are its
// (tile of up to kTileTokens tokens, kv head) pairs, run by paged_tile's kernel; a decode
// row's (a sequence with one query token) are the spans of its keys, as the decode kernel
// runs them (decode_spans.h): an item per kv head would read only that head's share of
// each cached token row. All items are dealt to the threads by their work (a step's long
// rows and a causal chunk's later tiles are the heavy ones) in one parallel region. The
// caller has written this step's K/V to their slots.
#include "tensor.h"

#include <algorithm>
#include <vector>

#include "decode_spans.h"
#include "paged_tile.h"
#include "pool.h"

namespace {

// Tokens a work item: AVX-512 builds widen and transpose each pass's keys per item, which
// more rows share; 8 keeps a short chunk's items many enough for the threads on AVX2.
#ifdef __AVX512F__
constexpr int64_t kTileTokens = 64;
#else
constexpr int64_t kTileTokens = 8;
#endif
constexpr int64_t kMinTile = 8;

struct Item {
  int64_t seq, first_token, tokens, kv_head;
};

}  // namespace

bool paged_prefill_available(int64_t head_dim) { return headroom::tile_available(head_dim); }
int64_t bf16_attention_form() { return headroom::bf16_dots_available(); }

// q: (N, Hq, D) float32, sequence b's rows at query_start_loc[b]:query_start_loc[b+1], the
// last positions of its seq_lens[b]-long context; caches: (num_blocks, block_size, Hkv, D),
// float32, float16 or bfloat16, or int8 rows of kScaleBytes + D (paged_tile.h); block_tables: (B, W) int32 -> (N, Hq, D) float32.
// dots: how the chunks' tiles take their dot products (paged_tile.h: kFloat32Dots,
// kBf16Pairs, kAmxTiles); decode rows keep float32 (bound by the cache's bytes, not by
// arithmetic).
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                      double scale, int64_t dots) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_prefill_attention takes float32 queries");
  TORCH_CHECK((kv == torch::kFloat32 || kv == torch::kBFloat16 || kv == torch::kHalf || kv == torch::kInt8) &&
                  v_cache.scalar_type() == kv,
              "the caches must be both float32, both float16, both bfloat16 or both int8");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query_start_loc = query_start_loc.contiguous();
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), B = seq_lens.size(0);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  const int64_t R = kv == torch::kInt8 ? D + headroom::kScaleBytes : D;  // an int8 row: its scale, then D values
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == R && v_cache.sizes() == k_cache.sizes(),
              "head counts or head_dim do not match");
  TORCH_CHECK(headroom::tile_available(D), "this build has no tiled attention for head_dim ", D);
  // The forms are ordered: a build with AMX has the pairs too.
  TORCH_CHECK(dots >= headroom::kFloat32Dots && dots <= headroom::bf16_dots_available(),
              "this build or process has no such dot products: ", dots);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.size(0) == B, "one block table and start per sequence");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(starts[B] == N, "query_start_loc must end at the number of query rows");
  // A chunk's tiles are cut smaller where it has too few for the threads (a short chunk
  // deep in a long context: a few heavy items), never below kMinTile tokens.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = threads > 1 ? (2 * threads + Hkv - 1) / Hkv : 1;
  std::vector<Item> items;
  std::vector<int64_t> work;  // each item's query rows times the keys they see, plus the keys it reads, per kv head
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && (lens[b] + block_size - 1) / block_size <= W,
                "seq_len does not fit the block table, or is shorter than the sequence's queries");
    if (q_len == 1) continue;
    const int64_t tile = std::clamp((q_len + splits - 1) / splits, std::min(kMinTile, q_len), kTileTokens);
    for (int64_t j = 0; j < q_len; j += tile)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t tokens = std::min(tile, q_len - j), keys = lens[b] - q_len + j + tokens;
        items.push_back({b, j, tokens, h});
        work.push_back(keys * (tokens + 1));
      }
  }
  headroom::Spans spans;
  for (int64_t b = 0; b < B; ++b)
    if (starts[b + 1] - starts[b] == 1) headroom::cut_row(spans, b, starts[b], lens[b], headroom::span_keys(lens[b]), Hkv);
  for (const auto& span : spans.items) work.push_back((span.last - span.first) * 2 * Hkv);
  const auto bins = headroom::deal(work, threads);
  auto out = torch::empty_like(q);
  const int64_t group = Hq / Hkv, tiles = static_cast<int64_t>(items.size());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  std::vector<float> partial(spans.slots * headroom::slot_floats(Hq, D));
  auto run = [&](auto* kc, auto* vc) {
    headroom::parallel_rows(N, static_cast<int64_t>(bins.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> own(headroom::slot_floats(Hq, D));
      for (int64_t bin = begin; bin < end; ++bin)
        for (const int64_t i : bins[bin]) {
          if (i >= tiles) {
            const headroom::Span& span = spans.items[i - tiles];
            const headroom::TileArgs a{qp + span.row * Hq * D, op + span.row * Hq * D, Hq * D, 1, lens[span.seq] - 1,
                                       group, D, tp + span.seq * W, block_size, Hkv * R, block_size * Hkv * R, R,
                                       0, static_cast<float>(scale)};
            headroom::attend_span(span, a, Hkv, kc, vc, partial.data(), own.data());
            continue;
          }
          const Item& it = items[i];
          const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
          const int64_t row = (starts[it.seq] + it.first_token) * Hq + it.kv_head * group;
          const headroom::TileArgs a{qp + row * D, op + row * D, Hq * D, it.tokens,
                                     lens[it.seq] - q_len + it.first_token, group, D, tp + it.seq * W, block_size,
                                     Hkv * R, block_size * Hkv * R, R, it.kv_head, static_cast<float>(scale),
                                     static_cast<int>(dots)};
          headroom::attend_tile(a, kc, vc);
        }
    });
  };
  if (kv == torch::kFloat32)
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (kv == torch::kHalf)
    run(reinterpret_cast<c10::Half*>(k_cache.data_ptr<at::Half>()), reinterpret_cast<c10::Half*>(v_cache.data_ptr<at::Half>()));
  else if (kv == torch::kInt8)  // at the first row's values, past its scale
    run(k_cache.data_ptr<int8_t>() + headroom::kScaleBytes, v_cache.data_ptr<int8_t>() + headroom::kScaleBytes);
  else
    run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  headroom::merge_spans(spans, partial.data(), Hq, D, op);
  return out;
}
