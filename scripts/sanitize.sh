#!/usr/bin/env bash
# The whole CPU suite again under AddressSanitizer + UndefinedBehaviorSanitizer (CPU only, no
# benchmarks, only the test binary), in build-asan/. Run it before landing a large change: it
# doubled CI's time (52 min at stop 28, against the 30 the project keeps CI under), so CI runs
# the README's test command alone. -O1 -g1 instead of RelWithDebInfo's -O2 -g halves the build
# and keeps file:line in the reports. UBSan only reports by default; halt_on_error makes a
# finding fail its test. The three longest numerical tests (170 s under ASan; the same kernels
# run in shorter tests) are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build-asan -G Ninja -DKILN_SANITIZE=ON -DKILN_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DKILN_CUDA=OFF
cmake --build build-asan --target kiln_tests
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-asan -j2 --output-on-failure \
  -E 'CpuConv.SplitsLargeBatchesIntoGroups|LossScaling.AmpTracksF32OnTinyGpt|SimplifyModels.GptTrainingStepUnchanged'
