#include "pong.h"

#include <algorithm>
#include <cmath>

namespace pong {

Table::Table(Rules rules, std::uint64_t seed) : rules_(rules), random_(seed) { reset(); }

float Table::random_uniform(float low, float high) {
  return std::uniform_real_distribution<float>(low, high)(random_);
}

void Table::reset() {
  paddle_y_ = 0.5f;
  opponent_y_ = 0.5f;
  points_ = 0;
  ticks_ = 0;
  serve();
}

void Table::serve() {
  ball_x_ = 0.5f;
  ball_y_ = random_uniform(0.25f, 0.75f);
  ball_vx_ = -rules_.ball_speed_x;
  ball_vy_ = random_uniform(-0.7f, 0.7f) * rules_.max_ball_speed_y;
}

StepResult Table::step(int action) {
  StepResult result;
  ++ticks_;
  const float h = rules_.paddle_half_height;
  const float move = action == kUp ? rules_.paddle_speed : action == kDown ? -rules_.paddle_speed : 0;
  paddle_y_ = std::clamp(paddle_y_ + move, h, 1.0f - h);

  // The opponent chases the ball while it comes its way, else drifts back to the middle.
  const float target = ball_vx_ > 0 ? ball_y_ : 0.5f;
  opponent_y_ += std::clamp(target - opponent_y_, -rules_.opponent_speed, rules_.opponent_speed);
  opponent_y_ = std::clamp(opponent_y_, h, 1.0f - h);

  ball_x_ += ball_vx_;
  ball_y_ += ball_vy_;
  if (ball_y_ < 0.0f) {
    ball_y_ = -ball_y_;
    ball_vy_ = -ball_vy_;
  } else if (ball_y_ > 1.0f) {
    ball_y_ = 2.0f - ball_y_;
    ball_vy_ = -ball_vy_;
  }

  if (ball_x_ <= 0.0f) {
    const float offset = (ball_y_ - paddle_y_) / h;
    if (std::abs(offset) > 1.0f) {
      result.terminated = true;  // missed
      return result;
    }
    // Returned: hitting off-centre steepens the shot, which is what beats the opponent.
    ball_x_ = -ball_x_;
    ball_vx_ = rules_.ball_speed_x;
    ball_vy_ = std::clamp(ball_vy_ + 0.6f * rules_.max_ball_speed_y * offset,
                          -rules_.max_ball_speed_y, rules_.max_ball_speed_y);
    ++points_;
    result.reward = 1.0f;
    if (points_ >= rules_.point_limit) {
      result.terminated = true;  // match won
      return result;
    }
  } else if (ball_x_ >= 1.0f) {
    const float offset = (ball_y_ - opponent_y_) / h;
    if (std::abs(offset) > 1.0f) {
      serve();  // the opponent missed: a new rally
    } else {
      ball_x_ = 2.0f - ball_x_;
      ball_vx_ = -rules_.ball_speed_x;
      ball_vy_ = std::clamp(ball_vy_ + 0.5f * rules_.max_ball_speed_y * offset +
                                random_uniform(-0.3f, 0.3f) * rules_.max_ball_speed_y,
                            -rules_.max_ball_speed_y, rules_.max_ball_speed_y);
    }
  }
  result.truncated = ticks_ >= rules_.max_ticks;
  return result;
}

void Table::observe(float* out) const {
  out[0] = ball_x_ * 2.0f - 1.0f;
  out[1] = ball_y_ * 2.0f - 1.0f;
  out[2] = ball_vx_ / rules_.ball_speed_x;
  out[3] = ball_vy_ / rules_.max_ball_speed_y;
  out[4] = paddle_y_ * 2.0f - 1.0f;
  out[5] = opponent_y_ * 2.0f - 1.0f;
}

int tracker_action(const Table& table) {
  const float gap = table.ball_y() - table.paddle_y();
  if (gap > 0.02f) return kUp;
  if (gap < -0.02f) return kDown;
  return kStay;
}

}  // namespace pong
