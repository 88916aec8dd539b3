// Tensor identity (capture/tensor_identity.h): views share their base's storage key and a copy does not; a tensor
// without storage is its own key; a detached alias shares the storage and the version counter but carries no
// autograd metadata, and dispatches no op.
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tapesac/capture/tensor_identity.h"

namespace tapesac::capture {
namespace {

TEST(TensorIdentity, ViewsShareTheStorageKeyCopiesDoNot) {
  const at::Tensor a = torch::zeros({4, 4});
  EXPECT_EQ(storage_key(a), storage_key(a.view({16})));
  EXPECT_EQ(storage_key(a), storage_key(a.select(0, 2)));
  EXPECT_EQ(storage_key(a), static_cast<const void*>(a.storage().unsafeGetStorageImpl()));
  EXPECT_NE(storage_key(a), storage_key(a.clone()));
}

TEST(TensorIdentity, ATensorWithoutStorageIsItsOwnKey) {
  const at::Tensor s = torch::eye(3).to_sparse();
  ASSERT_FALSE(s.has_storage());
  EXPECT_EQ(storage_key(s), static_cast<const void*>(s.unsafeGetTensorImpl()));
}

TEST(TensorIdentity, DetachedAliasSharesStorageAndVersionWithoutAutograd) {
  const at::Tensor x = torch::ones({3}, torch::requires_grad());
  const at::Tensor y = x * 2;
  ASSERT_NE(y.grad_fn(), nullptr);
  at::Tensor d = detached_alias(y);
  EXPECT_EQ(storage_key(d), storage_key(y));
  EXPECT_NE(d.unsafeGetTensorImpl(), y.unsafeGetTensorImpl());
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.grad_fn(), nullptr);
  const int64_t version = y._version();
  {
    at::NoGradGuard no_grad;
    d.add_(1);
  }
  EXPECT_EQ(y._version(), version + 1);  // one version counter: replay contracts see writes through the alias
  EXPECT_TRUE(torch::equal(y, torch::full({3}, 3.0)));
  EXPECT_FALSE(detached_alias(at::Tensor()).defined());
}

TEST(TensorIdentity, DetachedAliasDispatchesNothing) {
  const at::Tensor y = torch::ones({2, 2});
  int calls = 0;
  thread_local int* counter = nullptr;
  counter = &calls;
  const at::CallbackHandle h = at::addThreadLocalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
        ++*counter;
        return nullptr;
      }));
  const at::Tensor d = detached_alias(y);
  const int after_alias = calls;
  const at::Tensor viewed = y.view({4});
  const int after_view = calls;
  at::removeCallback(h);
  counter = nullptr;
  EXPECT_TRUE(d.defined());
  EXPECT_EQ(after_alias, 0);
  EXPECT_GT(after_view, 0);  // the callback does see a dispatched op
}

}  // namespace
}  // namespace tapesac::capture
