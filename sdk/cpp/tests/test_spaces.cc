#include <gtest/gtest.h>

#include "rlfleet/game_link.h"

namespace spaces = rlfleet::spaces;
using rlfleet::Tensor;

TEST(Spaces, BoxCarriesFloat32BoundsOfItsShape) {
  const auto space = spaces::box(-1.0f, 1.0f, {2, 3});
  ASSERT_TRUE(space.has_box());
  EXPECT_EQ(space.box().dtype(), rlfleet::common::v1::D_TYPE_FLOAT32);
  const Tensor low = Tensor::from_proto(space.box().low());
  EXPECT_EQ(low.shape(), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(low.values<float>(), std::vector<float>(6, -1.0f));
  EXPECT_EQ(Tensor::from_proto(space.box().high()).values<float>(), std::vector<float>(6, 1.0f));
  EXPECT_EQ(spaces::sample_shape(space), (std::vector<std::int64_t>{2, 3}));
}

TEST(Spaces, BoxBoundsMustMatchTheShape) {
  EXPECT_THROW(spaces::box({0.0f}, {1.0f, 2.0f}, {2}), std::invalid_argument);
}

TEST(Spaces, DiscreteAndMultiDiscrete) {
  const auto d = spaces::discrete(3);
  EXPECT_EQ(d.discrete().n(), 3);
  EXPECT_EQ(d.discrete().dtype(), rlfleet::common::v1::D_TYPE_INT64);
  EXPECT_TRUE(spaces::sample_shape(d).empty());
  EXPECT_THROW(spaces::discrete(0), std::invalid_argument);
  const auto m = spaces::multi_discrete({3, 4});
  EXPECT_EQ(Tensor::from_proto(m.multi_discrete().nvec()).values<std::int64_t>(),
            (std::vector<std::int64_t>{3, 4}));
  EXPECT_EQ(spaces::sample_shape(m), (std::vector<std::int64_t>{2}));
}

TEST(Spaces, DictKeepsOrder) {
  const auto space = spaces::dict({{"b", spaces::discrete(2)}, {"a", spaces::box(0, 1, {1})}});
  ASSERT_EQ(space.dict().spaces_size(), 2);
  EXPECT_EQ(space.dict().spaces(0).name(), "b");
  EXPECT_THROW(spaces::sample_shape(space), std::invalid_argument);
}

TEST(Observations, FlatFloatsGetTheAgentsAndBoxShape) {
  const rlfleet::Observations obs(std::vector<float>(12, 0.5f));
  const auto tree = obs.to_tree(spaces::box(0, 1, {2, 3}), 2);
  ASSERT_TRUE(tree.has_tensor());
  const Tensor t = Tensor::from_proto(tree.tensor());
  EXPECT_EQ(t.shape(), (std::vector<std::int64_t>{2, 2, 3}));
  EXPECT_EQ(t.values<float>(), std::vector<float>(12, 0.5f));
}

TEST(Observations, FlatFloatsOfTheWrongSizeNameTheField) {
  const rlfleet::Observations obs(std::vector<float>(5, 0.0f));
  try {
    obs.to_tree(spaces::box(0, 1, {3}), 2);
    FAIL() << "no error";
  } catch (const rlfleet::GameLinkError& e) {
    EXPECT_EQ(e.code(), rlfleet::ErrorCode::kInvalidArgument);
    EXPECT_EQ(e.field(), "observations.observations");
    EXPECT_NE(std::string(e.what()).find("need 6"), std::string::npos) << e.what();
  }
  EXPECT_THROW(obs.to_tree(spaces::discrete(3), 5), rlfleet::GameLinkError);
}

TEST(Observations, TensorsAndTreesGoAsTheyAre) {
  const Tensor t = Tensor::of(std::vector<std::uint8_t>{1, 2, 3, 4}, {2, 2});
  const auto tree = rlfleet::Observations(t).to_tree(spaces::discrete(3), 2);
  EXPECT_EQ(tree.tensor().dtype(), rlfleet::common::v1::D_TYPE_UINT8);
  rlfleet::common::v1::TensorTree nested;
  (*nested.mutable_dict()->mutable_items())["pos"].mutable_tensor()->CopyFrom(t.to_proto());
  EXPECT_TRUE(rlfleet::Observations(nested).to_tree(spaces::discrete(3), 2).has_dict());
}

TEST(Actions, DiscreteAndBoxReadTheLeaf) {
  rlfleet::Actions actions;
  *actions.actions.mutable_tensor() = Tensor::of(std::vector<std::int32_t>{2, 0, 1}, {3}).to_proto();
  EXPECT_EQ(actions.discrete(), (std::vector<std::int64_t>{2, 0, 1}));
  EXPECT_EQ(actions.box(), (std::vector<float>{2.0f, 0.0f, 1.0f}));
  rlfleet::Actions nested;
  nested.actions.mutable_tuple();
  EXPECT_THROW(nested.discrete(), std::invalid_argument);
}
