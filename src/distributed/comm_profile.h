// The measured half of the distribution passes' cost model (analysis/cost_model.h): each
// collective kind timed over a sweep of sizes on this group, fitted to t = latency + bytes /
// bandwidth, and cached on disk per machine, engine and world size (KILN_CACHE_DIR, kind
// "comm"), so only the first run on a machine pays for the sweep (a fraction of a second).
//
// Every rank must plan with the same numbers (the passes place collectives by them, and every
// rank has to issue the same collectives in the same order), so rank 0 decides: it reads the
// cache or, on a miss, all ranks run the sweep and rank 0 fits it; the fit reaches the others
// through the group's store.
#pragma once

#include "analysis/cost_model.h"
#include "device/device_runtime.h"
#include "distributed/process_group.h"

namespace kiln {

// CostModel::defaults(device) with the collectives' fits measured (or cached) on this group.
CostModel comm_cost_model(ProcessGroup& group, const DeviceRuntime& runtime);

// The least-squares fit of t = latency + bytes / bandwidth to (bytes, seconds) samples; a
// latency below zero (noise) is clamped to zero. Throws kiln::Error with fewer than two sizes.
CollectiveFit fit_collective(const std::vector<std::pair<double, double>>& samples);

}  // namespace kiln
