// The profiling reports (runtime/profile.h) on hand-made timings: grouping by op, dialect and
// fused kind, percentages, the top-N list, and the Chrome trace-event JSON (parsed back).
#include "runtime/profile.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/error.h"
#include "train/bench.h"

namespace kiln {
namespace {

NodeTiming timing(int64_t node, std::string op, std::string dialect, std::string kind, std::string outputs,
                  double ms) {
  return NodeTiming{node, std::move(op), std::move(dialect), std::move(kind), std::move(outputs), ms};
}

// Total 10 ms: matmul[cublaslt] 2 + 3 = 5 (50%), fused:ew[nvrtc] 1 + 1.5 = 2.5 (25%),
// fused:reduce[nvrtc] 2 (20%), add[cuda] 0.5 (5%).
std::vector<NodeTiming> sample() {
  return {timing(0, "matmul", "cublaslt", "", "f32[4,8]", 2.0),
          timing(1, "fused", "nvrtc", "ew", "f32[4,8]", 1.0),
          timing(2, "add", "cuda", "", "f32[4,8]", 0.5),
          timing(3, "fused", "nvrtc", "reduce", "f32[4]", 2.0),
          timing(4, "matmul", "cublaslt", "", "f32[8,8]", 3.0),
          timing(5, "fused", "nvrtc", "ew", "bf16[4,8], f32[4]", 1.5)};
}

TEST(Profile, LabelsNameOpKindAndDialect) {
  EXPECT_EQ(timing_label(timing(0, "matmul", "cublaslt", "", "", 1)), "matmul[cublaslt]");
  EXPECT_EQ(timing_label(timing(0, "fused", "nvrtc", "ew", "", 1)), "fused:ew[nvrtc]");
}

TEST(Profile, GroupsSumCountsAndPercentages) {
  std::vector<ProfileGroup> groups = group_timings(sample());
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0].label, "matmul[cublaslt]");
  EXPECT_EQ(groups[0].count, 2);
  EXPECT_DOUBLE_EQ(groups[0].total_ms, 5.0);
  EXPECT_DOUBLE_EQ(groups[0].percent, 50.0);
  EXPECT_EQ(groups[1].label, "fused:ew[nvrtc]");
  EXPECT_EQ(groups[1].count, 2);
  EXPECT_DOUBLE_EQ(groups[1].total_ms, 2.5);
  EXPECT_DOUBLE_EQ(groups[1].percent, 25.0);
  EXPECT_EQ(groups[2].label, "fused:reduce[nvrtc]");
  EXPECT_EQ(groups[2].count, 1);
  EXPECT_DOUBLE_EQ(groups[2].percent, 20.0);
  EXPECT_EQ(groups[3].label, "add[cuda]");
  EXPECT_DOUBLE_EQ(groups[3].total_ms, 0.5);
  EXPECT_DOUBLE_EQ(groups[3].percent, 5.0);
  double sum = 0;
  for (const ProfileGroup& g : groups) sum += g.percent;
  EXPECT_NEAR(sum, 100.0, 1e-9);
}

TEST(Profile, SameOpOnTwoDialectsIsTwoGroups) {
  std::vector<ProfileGroup> groups =
      group_timings({timing(0, "add", "cuda", "", "", 1.0), timing(1, "add", "nvrtc", "", "", 3.0)});
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].label, "add[nvrtc]");
  EXPECT_DOUBLE_EQ(groups[0].percent, 75.0);
  EXPECT_EQ(groups[1].label, "add[cuda]");
  EXPECT_DOUBLE_EQ(groups[1].percent, 25.0);
}

TEST(Profile, ZeroTotalGivesZeroPercentNotNan) {
  std::vector<ProfileGroup> groups = group_timings({timing(0, "add", "cuda", "", "", 0.0)});
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].percent, 0.0);
  EXPECT_NE(profile_table({}, 5).find("0 nodes"), std::string::npos);
}

TEST(Profile, TableShowsTotalGroupsAndTopNodes) {
  std::string table = profile_table(sample(), 2);
  EXPECT_NE(table.find("10.000 ms over 6 nodes"), std::string::npos) << table;
  // matmul group: total 5, 50%, 2 nodes, mean 2.5.
  EXPECT_NE(table.find("5.000   50.00       2     2.5000  matmul[cublaslt]"), std::string::npos) << table;
  EXPECT_NE(table.find("fused:reduce[nvrtc]"), std::string::npos) << table;
  // Top 2 single nodes: node 4 (3 ms, 30%) then node 0 (2 ms, ties with node 3 keep node order).
  size_t top = table.find("top 2 nodes:");
  ASSERT_NE(top, std::string::npos) << table;
  std::string tail = table.substr(top);
  size_t first = tail.find("3.0000   30.00       4  matmul[cublaslt] -> f32[8,8]");
  size_t second = tail.find("2.0000   20.00       0  matmul[cublaslt] -> f32[4,8]");
  EXPECT_NE(first, std::string::npos) << table;
  EXPECT_NE(second, std::string::npos) << table;
  EXPECT_LT(first, second);
  EXPECT_EQ(tail.find("-> f32[4]\n"), std::string::npos) << "node 3 is third, not shown: " << table;
}

TEST(Profile, GroupsByOutputTypesToo) {
  // One more matmul of f32[8,8]: with node 4 a group of 2 (4 ms, mean 2), apart from node 0's
  // f32[4,8]; the two fused:ew nodes have different outputs, so two groups.
  std::vector<NodeTiming> t = sample();
  t.push_back(timing(6, "matmul", "cublaslt", "", "f32[8,8]", 1.0));
  std::vector<ProfileGroup> groups = group_timings(t, /*by_outputs=*/true);
  ASSERT_EQ(groups.size(), 6u);
  EXPECT_EQ(groups[0].label, "matmul[cublaslt]");
  EXPECT_EQ(groups[0].outputs, "f32[8,8]");
  EXPECT_EQ(groups[0].count, 2);
  EXPECT_DOUBLE_EQ(groups[0].total_ms, 4.0);
  EXPECT_NEAR(groups[0].percent, 100.0 * 4.0 / 11.0, 1e-9);
  // 2 ms each, by label: fused:reduce, then matmul f32[4,8].
  EXPECT_EQ(groups[1].label, "fused:reduce[nvrtc]");
  EXPECT_EQ(groups[1].outputs, "f32[4]");
  EXPECT_EQ(groups[2].label, "matmul[cublaslt]");
  EXPECT_EQ(groups[2].outputs, "f32[4,8]");
  EXPECT_EQ(groups[3].outputs, "bf16[4,8], f32[4]");
  EXPECT_EQ(group_timings(t).size(), 4u);  // by op alone: as before
  const std::string table = profile_table(t, 3);
  const size_t at = table.find("top 3 by op and output types:");
  ASSERT_NE(at, std::string::npos) << table;
  EXPECT_NE(table.find("4.000   36.36       2     2.0000  matmul[cublaslt] -> f32[8,8]", at), std::string::npos)
      << table;
  // The fourth group (1.5 ms) is not shown, nor is its node among the top 3 nodes.
  EXPECT_EQ(table.find("bf16[4,8], f32[4]"), std::string::npos) << table;
}

TEST(Profile, ChromeTraceParsesWithBackToBackEvents) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kiln_profile_test_" + std::to_string(::getpid()) + ".json")).string();
  write_chrome_trace(sample(), path);
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in);
  std::filesystem::remove(path);
  ASSERT_TRUE(j.contains("traceEvents"));
  const nlohmann::json& events = j["traceEvents"];
  ASSERT_EQ(events.size(), 6u);
  // Durations in microseconds; each event starts where the previous one ends.
  const double want_ts[] = {0, 2000, 3000, 3500, 5500, 8500};
  const double want_dur[] = {2000, 1000, 500, 2000, 3000, 1500};
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(events[i]["ph"], "X") << i;
    EXPECT_NEAR(events[i]["ts"].get<double>(), want_ts[i], 1e-9) << i;
    EXPECT_NEAR(events[i]["dur"].get<double>(), want_dur[i], 1e-9) << i;
    EXPECT_EQ(events[i]["args"]["node"].get<int64_t>(), static_cast<int64_t>(i));
    EXPECT_TRUE(events[i].contains("pid") && events[i].contains("tid")) << i;
  }
  EXPECT_EQ(events[0]["name"], "matmul[cublaslt]");
  EXPECT_EQ(events[5]["name"], "fused:ew[nvrtc]");
  EXPECT_EQ(events[5]["args"]["outputs"], "bf16[4,8], f32[4]");
  EXPECT_EQ(events[5]["args"]["kind"], "ew");
  EXPECT_FALSE(events[0]["args"].contains("kind"));
}

TEST(Profile, UnwritableTracePathIsAClearError) {
  try {
    write_chrome_trace(sample(), "/nonexistent-dir-kiln/trace.json");
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir-kiln/trace.json"), std::string::npos) << e.what();
  }
}

// ---- timelines (traced steps) ----

TraceEvent event(std::string name, double start_us, double end_us, uint64_t launch, int64_t node) {
  return TraceEvent{std::move(name), start_us, end_us, launch, node};
}

std::vector<NodeTiming> timeline_labels() {
  return {timing(0, "matmul", "cublaslt", "", "bf16[4,8]", 0), timing(1, "fused", "nvrtc", "ew", "f32[4,8]", 0),
          timing(2, "add", "cuda", "", "f32[4]", 0)};
}

// Three replayed steps (launches 7, 9 and 3: launch ids need not follow time) and a lone upload
// between the first two, shuffled. Step A overlaps two events (node 1's second kernel and node 2).
//   A: n0 [0,10] n1 [12,20] n1 [20,25] n2 [24,26] copy [30,31]   busy 25, span 31, 2 gaps
//   B: n0 [100,104] n1 [105,115] n2 [115,116] copy [116,118]     busy 17, span 18, 1 gap
//   C: n0 [200,206] n1 [206,210] n2 [212,213]                    busy 11, span 13, 1 gap
std::vector<TraceEvent> traced() {
  return {event("gemm", 105, 115, 9, 1),  event("k_add", 212, 213, 3, 2), event("memcpy DtoD", 30, 31, 7, -1),
          event("gemm", 0, 10, 7, 0),     event("memcpy HtoD", 50, 51, 8, -1), event("ew", 12, 20, 7, 1),
          event("ew2", 20, 25, 7, 1),     event("k_add", 24, 26, 7, 2),   event("gemm", 100, 104, 9, 0),
          event("k_add", 115, 116, 9, 2), event("memcpy DtoD", 116, 118, 9, -1), event("gemm", 200, 206, 3, 0),
          event("ew", 206, 210, 3, 1)};
}

TEST(Timeline, StepsAreLaunchesOfMoreThanOneEventInTimeOrder) {
  const auto steps = split_steps(traced());
  ASSERT_EQ(steps.size(), 3u);  // the upload (one event) is no step
  EXPECT_EQ(steps[0].size(), 5u);
  EXPECT_EQ(steps[1].size(), 4u);
  EXPECT_EQ(steps[2].size(), 3u);
  EXPECT_EQ(steps[0][0].start_us, 0);
  EXPECT_EQ(steps[2][0].launch, 3u);
  for (const auto& step : steps)
    for (size_t i = 1; i < step.size(); ++i) EXPECT_LE(step[i - 1].start_us, step[i].start_us);
}

TEST(Timeline, SpanBusyAndIdleCountOverlapsOnce) {
  const auto steps = split_steps(traced());
  const double want_span[] = {31, 18, 13}, want_busy[] = {25, 17, 11};
  const int64_t want_gaps[] = {2, 1, 1};
  for (size_t s = 0; s < 3; ++s) {
    StepTimes t = step_times(steps[s]);
    EXPECT_NEAR(t.span_ms, want_span[s] / 1e3, 1e-12) << s;
    EXPECT_NEAR(t.busy_ms, want_busy[s] / 1e3, 1e-12) << s;
    EXPECT_NEAR(t.idle_ms, (want_span[s] - want_busy[s]) / 1e3, 1e-12) << s;
    EXPECT_EQ(t.gaps, want_gaps[s]) << s;
  }
}

TEST(Timeline, NodeTimesAreMediansOfPerStepSums) {
  const auto times = timeline_node_times(split_steps(traced()), timeline_labels());
  ASSERT_EQ(times.size(), 4u);  // three nodes, then the unmapped copy by name
  // n0: 10, 4, 6 -> 6; n1: 8 + 5, 10, 4 -> 10; n2: 2, 1, 1 -> 1; copy: 1, 2, 0 -> 1 (us).
  EXPECT_NEAR(times[0].ms, 0.006, 1e-12);
  EXPECT_NEAR(times[1].ms, 0.010, 1e-12);
  EXPECT_NEAR(times[2].ms, 0.001, 1e-12);
  EXPECT_EQ(times[1].kind, "ew");
  EXPECT_EQ(times[3].node, -1);
  EXPECT_EQ(times[3].op, "memcpy DtoD");
  EXPECT_EQ(times[3].dialect, "unmapped");
  EXPECT_NEAR(times[3].ms, 0.001, 1e-12);
}

TEST(Timeline, ReportGivesMediansGapsAndTheNodeTable) {
  const std::string report = timeline_report(split_steps(traced()), timeline_labels(), 10, 5);
  // Span median 18 us (step B), range 13 .. 31; between steps 69 and 82 us -> 75.5.
  EXPECT_NE(report.find("3 steps"), std::string::npos) << report;
  EXPECT_NE(report.find("0.018 ms median (0.013 .. 0.031)"), std::string::npos) << report;
  EXPECT_NE(report.find("0.076 ms median (0.069 .. 0.082)"), std::string::npos) << report;
  // Step B's one gap: 1 us between node 0 and node 1.
  EXPECT_NE(report.find("1.0 us  after node 0 matmul[cublaslt]  before node 1 fused:ew[nvrtc]"), std::string::npos)
      << report;
  // The node table sums the medians: 6 + 10 + 1 + 1 us.
  EXPECT_NE(report.find("kernel time: 0.018 ms over 4 nodes"), std::string::npos) << report;
  EXPECT_THROW(timeline_report({}, timeline_labels()), Error);
}

TEST(Timeline, TraceJsonIsOnTheDeviceClockFromTheFirstEvent) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kiln_timeline_test_" + std::to_string(::getpid()) + ".json")).string();
  write_timeline_trace(split_steps(traced()), timeline_labels(), path);
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in);
  std::filesystem::remove(path);
  const nlohmann::json& events = j["traceEvents"];
  ASSERT_EQ(events.size(), 12u);
  EXPECT_NEAR(events[0]["ts"].get<double>(), 0, 1e-9);
  EXPECT_EQ(events[0]["name"], "matmul[cublaslt]");
  EXPECT_EQ(events[0]["args"]["kernel"], "gemm");
  EXPECT_EQ(events[4]["name"], "memcpy DtoD");  // unmapped: its own name
  EXPECT_EQ(events[5]["args"]["step"], 1);
  EXPECT_NEAR(events[5]["ts"].get<double>(), 100, 1e-9);
  EXPECT_NEAR(events[6]["dur"].get<double>(), 10, 1e-9);
}

TEST(Profile, BenchProfileAndTimelineOnTheCpuAreClearErrors) {
  for (bool timeline : {false, true}) {
    train::BenchOptions o;
    o.device = "cpu";
    o.model = "mlp";
    (timeline ? o.timeline_path : o.profile_path) = "/tmp/never-written.json";
    o.out = nullptr;
    try {
      train::run_benchmark(o);
      ADD_FAILURE() << "expected kiln::Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(timeline ? "--timeline needs --device cuda" : "--profile needs --device cuda"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace kiln
