// Operator facts and operators that go away (Note [Operators deregistered] in capture/src/op_info.cpp).
#include <gtest/gtest.h>

#include <optional>

#include <torch/library.h>

#include "tapesac/capture/op_info.h"

namespace tapesac::capture {
namespace {

c10::OperatorName name_of(const char* name) { return c10::OperatorName(name, ""); }

// A torch.library library defined and destroyed in the test, as a scoped library in Python is.
std::optional<torch::Library> define(const char* schema) {
  std::optional<torch::Library> lib;
  lib.emplace(torch::Library::DEF, "tapesac_op_info_test", std::nullopt, __FILE__, __LINE__);
  lib->def(schema);
  return lib;
}

TEST(OpInfo, AnOperatorRegisteredAgainIsNotAnsweredFromItsOldFacts) {
  std::optional<torch::Library> lib = define("f(Tensor x) -> Tensor");
  const OpInfo* first = op_info(name_of("tapesac_op_info_test::f"));
  ASSERT_NE(first, nullptr);
  EXPECT_FALSE(first->random);
  EXPECT_EQ(first->generator_arg, -1);
  const uint64_t epoch = op_registry_epoch();
  lib.reset();  // deregisters tapesac_op_info_test::f: its dispatcher entry is freed
  EXPECT_GT(op_registry_epoch(), epoch);
  EXPECT_EQ(op_info(name_of("tapesac_op_info_test::f")), nullptr);
  lib = define("f(Tensor x, Generator? generator=None) -> Tensor");
  const OpInfo* second = op_info(name_of("tapesac_op_info_test::f"));
  ASSERT_NE(second, nullptr);
  EXPECT_TRUE(second->random);  // the new schema's facts, not the first registration's
  EXPECT_EQ(second->generator_arg, 1);
  EXPECT_EQ(second->handle.schema().arguments().size(), 2u);
  EXPECT_EQ(op_info(name_of("tapesac_op_info_test::f")), second);  // cached again until the next deregistration
  EXPECT_FALSE(first->random);  // the superseded facts stay readable: pointers to them may still be held
}

}  // namespace
}  // namespace tapesac::capture
