// The per-tick values a game passes in and gets back: observations in their wire form, and the
// accessors of the actions.
#include <stdexcept>

#include "rlfleet/game_link.h"

namespace rlfleet {

namespace {

GameLinkError local_error(std::string message, std::string field) {
  return GameLinkError(ErrorCode::kInvalidArgument, std::move(message), std::move(field));
}

}  // namespace

common::v1::TensorTree Observations::to_tree(const common::v1::Space& space,
                                             std::uint32_t num_agents) const {
  common::v1::TensorTree tree;
  if (const auto* flat = std::get_if<std::vector<float>>(&value_)) {
    if (!space.has_box() || space.box().dtype() != common::v1::D_TYPE_FLOAT32) {
      throw local_error("a flat float vector needs a float32 Box observation space; pass a "
                        "Tensor or a TensorTree for this space", "observations.observations");
    }
    std::vector<std::int64_t> shape{static_cast<std::int64_t>(num_agents)};
    std::int64_t expected = num_agents;
    for (std::int64_t extent : space.box().shape()) {
      shape.push_back(extent);
      expected *= extent;
    }
    if (static_cast<std::int64_t>(flat->size()) != expected) {
      throw local_error("observations hold " + std::to_string(flat->size()) + " floats; " +
                        std::to_string(num_agents) + " agents of this space need " +
                        std::to_string(expected), "observations.observations");
    }
    *tree.mutable_tensor() = Tensor::of(*flat, shape).to_proto();
  } else if (const auto* tensor = std::get_if<Tensor>(&value_)) {
    *tree.mutable_tensor() = tensor->to_proto();
  } else {
    tree = std::get<common::v1::TensorTree>(value_);
  }
  return tree;
}

Tensor Actions::tensor() const {
  if (!actions.has_tensor()) {
    throw std::invalid_argument("the actions are a nested tree (Dict/Tuple action space); read "
                                "Actions::actions");
  }
  return Tensor::from_proto(actions.tensor());
}

std::vector<std::int64_t> Actions::discrete() const { return tensor().to_int64(); }

std::vector<float> Actions::box() const { return tensor().to_float32(); }

}  // namespace rlfleet
