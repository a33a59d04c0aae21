#include "rlfleet/spaces.h"

#include <stdexcept>

#include "rlfleet/tensor.h"

namespace rlfleet::spaces {

namespace {

std::size_t product(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  for (std::int64_t extent : shape) {
    if (extent < 0) throw std::invalid_argument("space shape has a negative extent");
    n *= static_cast<std::size_t>(extent);
  }
  return n;
}

}  // namespace

Space box(float low, float high, std::vector<std::int64_t> shape) {
  const std::size_t n = product(shape);
  return box(std::vector<float>(n, low), std::vector<float>(n, high), std::move(shape));
}

Space box(const std::vector<float>& low, const std::vector<float>& high,
          std::vector<std::int64_t> shape) {
  const std::size_t n = product(shape);
  if (low.size() != n || high.size() != n) {
    throw std::invalid_argument("box bounds need " + std::to_string(n) + " values each, got " +
                                std::to_string(low.size()) + " and " + std::to_string(high.size()));
  }
  Space space;
  auto* b = space.mutable_box();
  b->set_dtype(common::v1::D_TYPE_FLOAT32);
  for (std::int64_t extent : shape) b->add_shape(extent);
  *b->mutable_low() = Tensor::of(low, shape).to_proto();
  *b->mutable_high() = Tensor::of(high, shape).to_proto();
  return space;
}

Space discrete(std::int64_t n, std::int64_t start) {
  if (n < 1) throw std::invalid_argument("discrete space needs n >= 1, got " + std::to_string(n));
  Space space;
  space.mutable_discrete()->set_n(n);
  space.mutable_discrete()->set_start(start);
  space.mutable_discrete()->set_dtype(common::v1::D_TYPE_INT64);
  return space;
}

Space multi_discrete(const std::vector<std::int64_t>& nvec) {
  const std::vector<std::int64_t> shape{static_cast<std::int64_t>(nvec.size())};
  Space space;
  auto* m = space.mutable_multi_discrete();
  *m->mutable_nvec() = Tensor::of(nvec, shape).to_proto();
  *m->mutable_start() = Tensor::of(std::vector<std::int64_t>(nvec.size(), 0), shape).to_proto();
  m->set_dtype(common::v1::D_TYPE_INT64);
  return space;
}

Space dict(const std::vector<std::pair<std::string, Space>>& items) {
  Space space;
  for (const auto& [name, sub] : items) {
    auto* named = space.mutable_dict()->add_spaces();
    named->set_name(name);
    *named->mutable_space() = sub;
  }
  return space;
}

std::vector<std::int64_t> sample_shape(const Space& space) {
  switch (space.kind_case()) {
    case Space::kBox:
      return {space.box().shape().begin(), space.box().shape().end()};
    case Space::kDiscrete:
      return {};
    case Space::kMultiDiscrete: {
      const auto& nvec = space.multi_discrete().nvec();
      return {nvec.shape().begin(), nvec.shape().end()};
    }
    case Space::kMultiBinary:
      return {space.multi_binary().shape().begin(), space.multi_binary().shape().end()};
    default:
      throw std::invalid_argument("a Dict, Tuple or Text space has no single sample shape");
  }
}

}  // namespace rlfleet::spaces
