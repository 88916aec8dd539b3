// Tests of the structural tape (capture/tape.h) and the op-kind table (capture/op_kinds.h), built by hand the way
// the recorder fills them.
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tape.h"

namespace tapesac::capture {
namespace {

TensorMeta meta(int64_t numel) {
  TensorMeta m;
  m.sizes = {numel};
  m.strides = {1};
  m.dtype = 6;
  m.nbytes = numel * 4;
  return m;
}

ArgRef read(const Tape& t, ValueId v, int16_t arg) {
  ArgRef a;
  a.arg = arg;
  a.value = v;
  a.state = t.state_of(t.value(v).storage);
  return a;
}

TEST(Tape, ExternalStorageStartsAtStateZero) {
  Tape t;
  const StorageId s = t.add_storage(/*external=*/true, 128);
  const ValueId x = t.add_external_value(s, meta(32));
  EXPECT_TRUE(t.storage(s).external);
  EXPECT_EQ(t.storage(s).nbytes, 128);
  EXPECT_TRUE(t.storage(s).writers.empty());
  EXPECT_EQ(t.state_of(s), 0);
  EXPECT_EQ(t.value(x).producer, kExternal);
  EXPECT_EQ(t.value(x).storage, s);
  EXPECT_EQ(t.value(x).state, 0);
  EXPECT_EQ(t.next_op_index(), 0);
}

TEST(Tape, AddOutputValueIsProducedByTheNextOp) {
  Tape t;
  const StorageId sx = t.add_storage(true, 64);
  const ValueId x = t.add_external_value(sx, meta(16));
  const StorageId s = t.add_storage(false, 64);
  const ValueId y = t.add_output_value(s, 1, meta(16));
  EXPECT_EQ(t.value(y).producer, 0);
  EXPECT_EQ(t.value(y).state, 1);
  OpRecord op;
  op.kind = intern_op_kind("aten::exp");
  op.inputs = {read(t, x, 0)};
  op.outputs = {y};
  op.writes = {s};
  EXPECT_EQ(t.add_op(op), 0);
  const StorageId s2 = t.add_storage(false, 64);
  const ValueId z = t.add_output_value(s2, 1, meta(16));
  EXPECT_EQ(t.value(z).producer, 1);
}

TEST(Tape, AddOpAppendsWritersInTapeOrder) {
  Tape t;
  const StorageId sx = t.add_storage(true, 64);
  const ValueId x = t.add_external_value(sx, meta(16));
  // op 0: a = exp(x), creates storage sa.
  const StorageId sa = t.add_storage(false, 64);
  const ValueId a = t.add_output_value(sa, 1, meta(16));
  OpRecord create;
  create.kind = intern_op_kind("aten::exp");
  create.inputs = {read(t, x, 0)};
  create.outputs = {a};
  create.writes = {sa};
  t.add_op(create);
  EXPECT_EQ(t.state_of(sa), 1);
  // op 1: a.add_(x), writes sa.
  const ArgRef a_read = read(t, a, 0);
  EXPECT_EQ(a_read.state, 1);
  const ValueId a2 = t.add_output_value(sa, t.state_of(sa) + 1, meta(16));
  OpRecord add;
  add.kind = intern_op_kind("aten::add_");
  add.inputs = {a_read, read(t, x, 1)};
  add.outputs = {a2};
  add.writes = {sa};
  EXPECT_EQ(t.add_op(add), 1);
  // op 2: x.mul_(a2), writes the external sx.
  const ValueId x2 = t.add_output_value(sx, t.state_of(sx) + 1, meta(16));
  OpRecord mul;
  mul.kind = intern_op_kind("aten::mul_");
  mul.flags = kWritesExternal;
  mul.inputs = {read(t, x, 0), read(t, a2, 1)};
  mul.outputs = {x2};
  mul.writes = {sx};
  EXPECT_EQ(t.add_op(mul), 2);

  EXPECT_EQ(t.storage(sa).writers, (std::vector<OpIndex>{0, 1}));
  EXPECT_EQ(t.state_of(sa), 2);
  EXPECT_EQ(t.storage(sa).final_state(), 2);
  EXPECT_EQ(t.storage(sx).writers, (std::vector<OpIndex>{2}));
  EXPECT_EQ(t.state_of(sx), 1);
  EXPECT_EQ(t.ops().size(), 3u);
  EXPECT_EQ(t.op(1).inputs[0].state, 1);
  EXPECT_EQ(t.value(a2).state, 2);
  EXPECT_TRUE(t.op(2).has(kWritesExternal));
  EXPECT_FALSE(t.op(2).has(kView));
}

TEST(Tape, AddOpCountsAStorageListedTwiceOnce) {
  Tape t;
  const StorageId s = t.add_storage(false, 64);
  const ValueId v = t.add_output_value(s, 1, meta(16));
  OpRecord op;
  op.kind = intern_op_kind("aten::empty");
  op.outputs = {v};
  op.writes = {s, s};
  t.add_op(op);
  EXPECT_EQ(t.storage(s).writers, (std::vector<OpIndex>{0}));
  EXPECT_EQ(t.state_of(s), 1);
}

TEST(Tape, ViewOpWritesNothing) {
  Tape t;
  const StorageId s = t.add_storage(true, 64);
  const ValueId x = t.add_external_value(s, meta(16));
  TensorMeta m = meta(16);
  m.storage_offset = 4;
  const ValueId v = t.add_output_value(s, t.state_of(s), m);
  OpRecord op;
  op.kind = intern_op_kind("aten::slice.Tensor");
  op.flags = kView;
  op.inputs = {read(t, x, 0)};
  op.inputs[0].meta_only = true;
  op.outputs = {v};
  t.add_op(op);
  EXPECT_TRUE(t.storage(s).writers.empty());
  EXPECT_EQ(t.state_of(s), 0);
  EXPECT_EQ(t.value(v).producer, 0);
  EXPECT_FALSE(t.value(v).meta.same_view(t.value(x).meta));
  EXPECT_TRUE(t.value(x).meta.same_view(meta(16)));
}

TEST(Tape, AddOpWithAnUnknownStorageThrows) {
  Tape t;
  const StorageId s = t.add_storage(false, 64);
  OpRecord op;
  op.kind = intern_op_kind("aten::zero_");
  op.writes = {s + 1};
  EXPECT_THROW(t.add_op(op), std::out_of_range);
  op.writes = {-1};
  EXPECT_THROW(t.add_op(op), std::out_of_range);
  EXPECT_TRUE(t.ops().empty());
}

TEST(Tape, AddOpWithAnUnknownValueThrows) {
  Tape t;
  const StorageId s = t.add_storage(true, 64);
  const ValueId x = t.add_external_value(s, meta(16));
  OpRecord op;
  op.kind = intern_op_kind("aten::neg");
  op.inputs = {read(t, x, 0)};
  op.inputs[0].value = x + 1;
  EXPECT_THROW(t.add_op(op), std::out_of_range);
  op.inputs[0].value = -1;
  EXPECT_THROW(t.add_op(op), std::out_of_range);
  EXPECT_TRUE(t.ops().empty());
}

TEST(Tape, AccessorsAndAddOutputValueCheckBounds) {
  Tape t;
  EXPECT_THROW(t.add_output_value(0, 1, meta(1)), std::out_of_range);
  EXPECT_THROW(t.op(0), std::out_of_range);
  EXPECT_THROW(t.value(0), std::out_of_range);
  EXPECT_THROW(t.storage(0), std::out_of_range);
  EXPECT_THROW(t.state_of(0), std::out_of_range);
}

TEST(Tape, ToStringMentionsOpNamesReadsAndWrites) {
  Tape t;
  const StorageId sx = t.add_storage(true, 64);
  const ValueId x = t.add_external_value(sx, meta(16));
  const StorageId sa = t.add_storage(false, 64);
  const ValueId a = t.add_output_value(sa, 1, meta(16));
  OpRecord op;
  op.kind = intern_op_kind("tapesac_test::frobnicate");
  op.inputs = {read(t, x, 0)};
  op.outputs = {a};
  op.writes = {sa};
  op.flags = kRandom;
  t.add_op(op);
  const ValueId a2 = t.add_output_value(sa, 2, meta(16));
  OpRecord add;
  add.kind = intern_op_kind("aten::add_");
  add.inputs = {read(t, a, 0), read(t, x, 1)};
  add.outputs = {a2};
  add.writes = {sa};
  t.add_op(add);

  const std::string s = t.to_string();
  EXPECT_NE(s.find("tapesac_test::frobnicate"), std::string::npos) << s;
  EXPECT_NE(s.find("aten::add_"), std::string::npos) << s;
  EXPECT_NE(s.find("v" + std::to_string(x)), std::string::npos) << s;
  EXPECT_NE(s.find("writes s" + std::to_string(sa)), std::string::npos) << s;
  EXPECT_LT(s.find("tapesac_test::frobnicate"), s.find("aten::add_")) << s;
  EXPECT_EQ(Tape().to_string(), "");
}

TEST(OpKinds, InternIsStableAndRoundTrips) {
  const OpKind mm = intern_op_kind("aten::mm");
  const OpKind addmm = intern_op_kind("aten::addmm");
  EXPECT_GE(mm, 0);
  EXPECT_NE(mm, addmm);
  EXPECT_EQ(intern_op_kind("aten::mm"), mm);
  EXPECT_EQ(op_kind_name(mm), "aten::mm");
  EXPECT_EQ(op_kind_name(addmm), "aten::addmm");
}

TEST(OpKinds, UnknownKindThrows) {
  EXPECT_THROW(op_kind_name(-1), std::out_of_range);
  EXPECT_THROW(op_kind_name(1 << 30), std::out_of_range);
}

}  // namespace
}  // namespace tapesac::capture
