// The conformance sweep on the CPU (tests/conformance.h): every case of the table through every
// CPU kernel (dialects "reference", "cpu", "openblas") whose supports() takes it, against the
// op's reference kernel; the table covers every op; the coverage table, printed.
#include <gtest/gtest.h>

#include "conformance.h"

namespace kiln {
namespace {

namespace conformance = testing::conformance;

class CpuConformance : public ::testing::TestWithParam<Op> {};

TEST_P(CpuConformance, KernelsMatchReference) {
  conformance::expect_kernels_match_reference(GetParam(), Device::kCpu);
}

INSTANTIATE_TEST_SUITE_P(Ops, CpuConformance, ::testing::ValuesIn(conformance::ops_with_cases()),
                         [](const ::testing::TestParamInfo<Op>& info) {
                           return std::string(op_name(info.param));
                         });

// A new op cannot land without a case (ggml's test-backend-ops habit).
TEST(ConformanceTable, EveryOpHasACase) {
  for (Op op : conformance::ops_without_cases())
    ADD_FAILURE() << op_name(op) << " has no case in tests/conformance_cases.cc";
}

// The table the issue quotes: per op, the nodes each CPU dialect ran; kernels no case reached.
TEST(ConformanceTable, PrintsCpuCoverage) {
  const conformance::Coverage coverage = conformance::coverage({Device::kCpu});
  std::cout << coverage.table;
  for (const std::string& kernel : coverage.unreached) std::cout << "unreached: " << kernel << "\n";
}

}  // namespace
}  // namespace kiln
