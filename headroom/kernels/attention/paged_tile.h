// Attention over a sequence's paged context read in place (AVX2+FMA+F16C; the tile with
// 512-bit vectors where the build has AVX-512): a tile of query rows for one kv head, which
// the prefill kernel runs per (sequence, kv head, tile), and a decode token over a span of
// keys for all kv heads, which the decode kernel runs per span.
// See paged_tile.cpp.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace headroom {

struct TileArgs {
  const float* q;        // the tile's first token, at its kv head's first query head
  float* out;            // laid out as q
  int64_t token_stride;  // floats between two tokens' rows in q and out (Hq * D)
  int64_t tokens;        // query tokens in the tile
  int64_t first_pos;     // the first token's position: it sees keys [0, first_pos]
  int64_t group;         // query heads per kv head
  int64_t head_dim;
  const int32_t* table;  // the sequence's block table
  // Cache elements between two tokens' rows, two blocks, and two kv heads' rows of a token
  // (head_dim, or an int8 cache's head_dim + kScaleBytes).
  int64_t block_size, cache_token_stride, cache_block_stride, cache_head_stride, kv_head;
  float scale;
  int dots = 0;  // how the tile takes its dot products: one of the forms below
};

// An int8 cache row: its float32 scale (max |x| / 127), then head_dim values, as
// llama.cpp's q8_0 blocks; kernels take the cache pointer at the first row's values, so
// a row's values start where its offset points and its scale sits just before them.
constexpr int64_t kScaleBytes = 4;
// The scale of the int8 row whose values start at `row`.
inline float scale_of(const int8_t* row) {
  float s;
  std::memcpy(&s, row - kScaleBytes, sizeof s);
  return s;
}

// A tile's dot products: float32 FMAs; bfloat16 pairs into float32 (vdpbf16ps, AVX-512
// BF16); or AMX's bfloat16 tiles. The two bfloat16 forms round queries, keys, weights and
// values to bfloat16 once and sum in float32.
constexpr int kFloat32Dots = 0, kBf16Pairs = 1, kAmxTiles = 2;

// Whether this build has the tiled kernel for this head_dim (AVX2+FMA+F16C, head_dim a
// multiple of 64); where it does not, callers keep their portable paths.
bool tile_available(int64_t head_dim);
// The best bfloat16 form this build and process have (AMX where Linux lends its tiles, else
// pairs), or kFloat32Dots where neither.
int bf16_dots_available();

void attend_tile(const TileArgs& a, const float* k_cache, const float* v_cache);
void attend_tile(const TileArgs& a, const c10::Half* k_cache, const c10::Half* v_cache);
void attend_tile(const TileArgs& a, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache);
void attend_tile(const TileArgs& a, const int8_t* k_cache, const int8_t* v_cache);

// One decode token (a.tokens == 1) over keys [begin, end) only, for the query heads of kv
// heads [a.kv_head, a.kv_head + kv_heads) (a.q at the first one's first query head): the
// span's running max and softmax denominator per query head (m, l: kv_heads x group
// floats, set by the caller to -inf and 0) and its unnormalised output (o: kv_heads x group
// x head_dim, zeroed by the caller), so that spans of one context computed on different
// threads merge into the whole.
void decode_span(const TileArgs& a, int64_t kv_heads, const float* k_cache, const float* v_cache, int64_t begin,
                 int64_t end, float* m, float* l, float* o);
void decode_span(const TileArgs& a, int64_t kv_heads, const c10::Half* k_cache, const c10::Half* v_cache,
                 int64_t begin, int64_t end, float* m, float* l, float* o);
void decode_span(const TileArgs& a, int64_t kv_heads, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                 int64_t begin, int64_t end, float* m, float* l, float* o);
void decode_span(const TileArgs& a, int64_t kv_heads, const int8_t* k_cache, const int8_t* v_cache, int64_t begin,
                 int64_t end, float* m, float* l, float* o);

}  // namespace headroom
