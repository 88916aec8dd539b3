// Tests of the attribution of CUPTI activity records to tape ops (capture/kernel_times.h) on synthetic records.
#include <cstdint>
#include <unordered_map>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/capture/kernel_times.h"

namespace tapesac::capture {
namespace {

TEST(KernelTimes, EagerRecordsJoinThroughExternalCorrelation) {
  // Block 2, ops 0..2. API calls 10, 11 ran under op 0, 12 under op 2, 13 under block 1's op 0, 14 unknown.
  const std::vector<ExternalCorrelation> corr{{10, external_id(2, 0)}, {11, external_id(2, 0)},
                                              {12, external_id(2, 2)}, {13, external_id(1, 0)}};
  const std::vector<DeviceActivity> acts{{10, 100, 150, 0}, {11, 200, 210, 0}, {12, 300, 400, 0},
                                         {13, 500, 600, 0}, {14, 700, 705, 0}};
  const auto t = attribute_kernel_times(acts, corr, 2, 3, {});
  EXPECT_EQ(t.ns, (std::vector<int64_t>{60, 0, 100}));
  EXPECT_EQ(t.records, (std::vector<int32_t>{2, 0, 1}));
  EXPECT_EQ(t.unattributed_ns, 105);
  EXPECT_EQ(t.unattributed_records, 2);
}

TEST(KernelTimes, GraphRecordsJoinThroughClonedNodeIds) {
  // All graph kernels share the cudaGraphLaunch correlation id; only the node id tells the ops apart.
  const std::vector<ExternalCorrelation> corr{{50, external_id(0, 1)}};
  const std::vector<DeviceActivity> acts{{50, 0, 10, 9001}, {50, 10, 30, 9002}, {50, 30, 70, 9003},
                                         {50, 70, 71, 4242}};
  const std::unordered_map<uint64_t, OpIndex> owner{{9001, 0}, {9002, 1}, {9003, 1}};
  const auto t = attribute_kernel_times(acts, corr, 0, 2, owner);
  EXPECT_EQ(t.ns, (std::vector<int64_t>{10, 60}));
  EXPECT_EQ(t.unattributed_records, 1);  // node 4242: unowned (e.g. a static-input copy)
  EXPECT_EQ(external_id(3, 7) >> 32, 3u);
  EXPECT_EQ(external_id(3, 7) & 0xffffffffu, 7u);
}

TEST(KernelTimes, ExecutableNodesMapToTheOwnersOfTheirTemplates) {
  // Template nodes 0..3 (CUPTI ids 11..14): node 0 unowned (the capture's entry node), 1 and 2 launched by op 0,
  // 3 by op 2. Instantiation cloned 11->91, 12->92, 14->94; 13 had no clone (e.g. instantiated before the timer
  // subscribed): its records stay unattributed rather than guessed.
  const std::vector<uint64_t> ids{11, 12, 13, 14};
  const std::vector<OpIndex> owner{-1, 0, 0, 2};  // -1: kUnowned
  const std::unordered_map<uint64_t, uint64_t> cloned{{11, 91}, {12, 92}, {14, 94}};
  const auto map = exec_node_owner(ids, owner, cloned);
  EXPECT_EQ(map, (std::unordered_map<uint64_t, OpIndex>{{92, 0}, {94, 2}}));
  const std::vector<DeviceActivity> acts{{7, 0, 5, 91}, {7, 5, 25, 92}, {7, 25, 30, 93}, {7, 30, 70, 94}};
  const auto t = attribute_kernel_times(acts, {}, 0, 3, map);
  EXPECT_EQ(t.ns, (std::vector<int64_t>{20, 0, 40}));
  EXPECT_EQ(t.unattributed_ns, 10);
  EXPECT_THROW(exec_node_owner({1, 2}, {0}, cloned), std::invalid_argument);
}

}  // namespace
}  // namespace tapesac::capture
