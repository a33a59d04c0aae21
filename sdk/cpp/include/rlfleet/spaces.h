// Builders for rlfleet.common.v1.Space (gymnasium's spaces on the wire): what a game declares in
// GameLinkOptions for ONE agent's observation and action.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rlfleet/common/v1/space.pb.h"

namespace rlfleet::spaces {

using Space = rlfleet::common::v1::Space;

// float32 Box of `shape` with the same bounds everywhere (+-infinity allowed).
Space box(float low, float high, std::vector<std::int64_t> shape);
// float32 Box with per-element bounds (low.size() == high.size() == product(shape)).
Space box(const std::vector<float>& low, const std::vector<float>& high,
          std::vector<std::int64_t> shape);
// One integer in [start, start + n), sent as int64.
Space discrete(std::int64_t n, std::int64_t start = 0);
// An int64 array, element i in [0, nvec[i]).
Space multi_discrete(const std::vector<std::int64_t>& nvec);
// Named sub-spaces, in this order.
Space dict(const std::vector<std::pair<std::string, Space>>& items);

// The shape of one sample of a Box, Discrete ({}), MultiDiscrete or MultiBinary space;
// std::invalid_argument for Dict, Tuple and Text spaces, which have no single shape.
std::vector<std::int64_t> sample_shape(const Space& space);

}  // namespace rlfleet::spaces
