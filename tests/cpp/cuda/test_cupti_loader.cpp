// CuptiLibrary (tapesac/cuda/cupti_loader.h): loading needs no device, so these CudaHost* cases run in CI.
#include <string>

#include <gtest/gtest.h>

#include "tapesac/cuda/cupti_loader.h"

namespace tc = tapesac::cuda;

TEST(CudaHostCupti, ABogusPathFailsGracefullyWithAReason) {
  std::string why;
  EXPECT_EQ(tc::CuptiLibrary::load("/nonexistent/libcupti.so.13", &why), nullptr);
  EXPECT_NE(why.find("dlopen"), std::string::npos) << why;
  EXPECT_NE(why.find("/nonexistent/libcupti.so.13"), std::string::npos) << why;
  EXPECT_EQ(tc::CuptiLibrary::load("/nonexistent/libcupti.so.13", nullptr), nullptr);  // no crash without `why`
}

TEST(CudaHostCupti, ALibraryWithoutTheEntryPointsIsRefused) {
  std::string why;
  EXPECT_EQ(tc::CuptiLibrary::load("libm.so.6", &why), nullptr);
  EXPECT_NE(why.find("cuptiGetVersion"), std::string::npos) << why;
}

TEST(CudaHostCupti, TheDefaultLoadEitherResolvesEverythingOrSaysWhy) {
  std::string why;
  const tc::CuptiLibrary* lib = tc::CuptiLibrary::load_default(&why);
  if (lib == nullptr) {
    EXPECT_FALSE(why.empty());
    return;
  }
  EXPECT_EQ(lib->version() / 100, static_cast<uint32_t>(CUPTI_API_VERSION / 100));
  EXPECT_NE(lib->api().push_external_id, nullptr);
  EXPECT_NE(lib->api().graph_node_id, nullptr);
  EXPECT_EQ(tc::CuptiLibrary::load_default(nullptr), lib);  // cached
  EXPECT_FALSE(lib->result_string(CUPTI_ERROR_INVALID_PARAMETER).empty());
}
