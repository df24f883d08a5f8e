// Decode rows (one query token a sequence) cut into spans of their keys, the work items of
// both attention kernels: the decode kernel's whole step, and the prefill kernel's decode
// rows beside chunks. A span reads whole token rows of the cache for all kv heads (a block
// is one run of memory, which the hardware prefetcher follows; an item per kv head read
// only that head's share of every row), or for a run of them where a decode step has too
// few spans for its threads (split_heads). Contexts differ in length by 100x in one step (a
// reasoning row beside chat rows), so each is cut into spans of about an equal share of
// the step's keys, and the spans of one context, computed on different threads, are
// merged after from their partial softmaxes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_tile.h"

namespace headroom {

// Keys [first, last) of the decode row at query row `row` of sequence `seq`, for kv heads
// [head, head + heads); slot: where its partial softmax goes, or -1 for a row's only span,
// which writes its output directly.
struct Span {
  int64_t seq, row, first, last, slot, head, heads;
};

struct Spans {
  std::vector<Span> items;
  // Rows of more than one span, for the merge, and how many each has; a cut row's slots
  // follow one another, in the order of cut_rows.
  std::vector<int64_t> cut_rows, counts;
  int64_t slots = 0;
};

// The keys a span of a row of `len` keys covers: a sixteenth of the row, never below
// kMinSpan (smaller spans cost more in merging and in passes begun than they gain). From
// the row's own length alone, never the step's other rows or the thread count, so that a
// row's sums are the same in any batch on any number of threads: a sequence's tokens do
// not depend on its neighbours, and a guessed token is verified with the arithmetic that
// decoding it would have used.
int64_t span_keys(int64_t len);

// Appends the row's spans, each for all `kv_heads`: its context [0, len) cut into pieces of
// about `target` keys (never fewer than half).
void cut_row(Spans& spans, int64_t seq, int64_t row, int64_t len, int64_t target, int64_t kv_heads);

// Where a step's spans do not deal evenly to the threads (one short row at batch 1 is one
// span, which leaves every thread but one idle; three rows on two threads leave one idle a
// third of the time), cuts each span into runs of its kv heads, the fewest that make a
// multiple of the thread count. Each head's sums are its own, so unlike a cut of the keys
// this changes no arithmetic and may depend on the thread count. Not where there are many
// spans: a run of fewer heads reads a shorter piece of each cached token's row.
void split_heads(Spans& spans, int64_t threads);

// The floats each slot of the partial buffer holds: a row's m, l and output per query head.
inline int64_t slot_floats(int64_t Hq, int64_t D) { return Hq * (D + 2); }

// One span: `a` is the row's decode token (a.q and a.out at its first query head,
// a.kv_head 0); `partial` holds the slots, `own` one slot's room for a row's only span.
// A span of some kv heads fills only their query heads' share of its slot.
template <typename T>
void attend_span(const Span& span, const TileArgs& a, int64_t Hkv, const T* kc, const T* vc, float* partial,
                 float* own) {
  const int64_t Hq = Hkv * a.group, D = a.head_dim, first = span.head * a.group, rows = span.heads * a.group;
  float* slot = span.slot >= 0 ? partial + span.slot * slot_floats(Hq, D) : own;
  float *m = slot + first, *l = slot + Hq + first, *o = slot + 2 * Hq + first * D;
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  std::fill(o, o + rows * D, 0.f);
  TileArgs heads = a;
  heads.q += first * D;
  heads.out += first * D;
  heads.kv_head = span.head;
  decode_span(heads, span.heads, kc, vc, span.first, span.last, m, l, o);
  if (span.slot < 0)
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.f / l[r];
      for (int64_t k = 0; k < D; ++k) heads.out[r * D + k] = o[r * D + k] * inv;
    }
}

// Writes each cut row's output (at out + row * Hq * D) from its spans' partials.
void merge_spans(const Spans& spans, const float* partial, int64_t Hq, int64_t D, float* out);

}  // namespace headroom
