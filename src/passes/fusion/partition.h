// Fusion partitioning as a problem on its own, apart from the IR: items (the graph's nodes, in
// topological order) produce values that other items read; a partition assigns every item to a
// group; a value is "kept out of memory" when its producer and every consumer share a group and
// nothing outside the step needs it. The fusion pass (passes/fusion/fusion.cc) builds a Problem
// from a graph, asks a partitioner for groups, and outlines each group of two or more items into
// one `fused` node.
//
// Legality of a group (is_legal checks all of it):
//   - every item in it has the same iteration space (Item::space);
//   - at most one GEMM (the group's "nucleus"), and the GEMM reads nothing computed inside the
//     group: the group is the GEMM plus its epilogue;
//   - a column value (a reduction across tiles, e.g. a bias gradient: every value of a column
//     reduction item, and the values marked ValueUse::column) has no consumer inside its group:
//     it is only complete after the last tile;
//   - an opaque item is alone in its group;
//   - contracting the group into one node leaves the graph acyclic (no path leaves the group and
//     comes back into it).
//
// Two partitioners: a fast greedy one, and an optimal one (exact search per connected component
// of fusable items) that falls back to greedy on components too large for it or past its time
// limit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::fusion {

enum class ItemKind : uint8_t {
  kElementwise,      // one output element per input element (after broadcasting)
  kRowOp,            // reduces or normalizes along the last axis, rows independent (softmax,
                     // layer_norm, a last-axis sum): complete within a tile of whole rows
  kGemm,             // a matrix product: may nucleate a group as its epilogue's producer
  kColumnReduction,  // reduces across rows (tiles): may only be an output of its group
  kOpaque,           // never fused (attention, gather, shape changes that move data, ...)
};

struct Item {
  ItemKind kind = ItemKind::kOpaque;
  int64_t space = -1;  // iteration-space key: items of one group have equal keys
};

struct ValueUse {
  int producer = -1;            // item index
  std::vector<int> consumers;   // item indices (may repeat when an item reads a value twice)
  int64_t bytes = 0;            // size of the value in memory
  bool external = false;        // a graph output or update: written to memory whatever happens
  // A sum over every row (complete only after the last tile): no consumer may share its
  // producer's group. Every value of a kColumnReduction item is one whether or not this is set;
  // a row op may have some (LayerNorm's gradient: dx per row, dgamma and dbeta over all rows).
  bool column = false;
};

struct Problem {
  std::vector<Item> items;       // topological order: a value's consumers come after its producer
  std::vector<ValueUse> values;  // every value some item produces
};

struct Partition {
  std::vector<int> group_of;  // per item: its group id, 0..groups-1
  int64_t saved_bytes = 0;    // bytes of values kept out of memory (the objective)
  // How the components of fusable items were solved (partition_optimal only).
  int components_exact = 0;
  int components_greedy = 0;  // too large or timed out: greedy's answer
  // Groups the fusion pass took apart afterwards because outlining them raised the planned
  // arena (passes/fusion/fusion.h, unstretch_groups); saved_bytes is then recounted.
  int groups_dropped = 0;
};

// Whether `group_of` (one group id per item) is a legal partition; on false, `why` (if given)
// names the first broken rule and the items involved.
bool is_legal(const Problem& problem, const std::vector<int>& group_of, std::string* why = nullptr);
// The objective: bytes of non-external values whose producer and consumers all share a group.
int64_t saved_bytes(const Problem& problem, const std::vector<int>& group_of);

// Greedy: visits values largest first and merges producer and consumer groups when the merged
// group stays legal; again while a pass merges something (a merge refused early may be legal
// once other groups have formed). Fast (near-linear per pass in practice); not optimal.
Partition partition_greedy(const Problem& problem);

// A second objective after the first: reads kept out of memory. Merges a consumer's group into
// the group producing a value it reads, where the merged group stays legal, although the value
// itself stays in memory (another reader outside the group, or a graph output): the consumer
// then takes it from the producer's registers instead of reading it back (gelu after its GEMM
// writing the pre-activation for the backward; the cast and bias-gradient sum after a residual
// gradient add). Values largest first, like greedy. Never merges a row op or a column
// reduction with a GEMM group that holds no row op (no library epilogue does the first: the
// product would go through memory anyway; cuBLASLt's BGRAD epilogues for the second measured
// slower than a separate sum); a GEMM group with a row op already has a generated rows epilogue
// that takes both. A row op may join a GEMM group whose epilogue reads, from outside, a value of
// more bytes than the product (an f32 residual added to a 16-bit product: no library epilogue
// takes it, so the product goes through memory to a generated kernel already). Never lowers
// saved_bytes; returns `partition` unchanged if it is not legal.
Partition absorb_readers(const Problem& problem, const Partition& partition);

struct OptimalOptions {
  int max_component_items = 24;  // larger components get greedy's answer
  double time_limit_seconds = 0.5;  // per component; past it, greedy's answer
};
// Exact per component: never worse than greedy (greedy's answer seeds the search bound).
Partition partition_optimal(const Problem& problem, const OptimalOptions& options = {});

}  // namespace kiln::fusion
