// Pong against a scripted opponent, one table per agent. The agent's paddle is on the left
// (x = 0), the opponent's on the right (x = 1); the court is the unit square. The opponent
// chases the ball at a limited speed, so steep shots beat it (the ball is then served again).
//
// Score: the agent earns a point (reward +1) for every ball it returns. Its episode ends when it
// misses (terminated), when it reaches the point limit (terminated: match won) or after
// max_ticks (truncated). The score of an episode is its return: points, 0 to point_limit.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace pong {

enum Action : int { kUp = 0, kStay = 1, kDown = 2 };
inline constexpr int kNumActions = 3;
inline constexpr int kObservationSize = 6;

struct Rules {
  float paddle_half_height = 0.1f;
  float paddle_speed = 0.035f;    // per tick, faster than the ball's steepest climb
  float opponent_speed = 0.02f;   // slower: steep shots get past it
  float ball_speed_x = 0.03f;     // a crossing takes about 33 ticks
  float max_ball_speed_y = 0.03f;
  int point_limit = 21;
  int max_ticks = 5000;
};

struct StepResult {
  float reward = 0.0f;
  bool terminated = false;
  bool truncated = false;
};

class Table {
 public:
  Table(Rules rules, std::uint64_t seed);

  void reset();  // a new episode: paddles centred, the ball served toward the agent
  StepResult step(int action);
  // ball x, y, vx, vy, agent paddle y, opponent paddle y, each scaled to [-1, 1].
  void observe(float* out) const;

  int points() const { return points_; }
  int ticks() const { return ticks_; }
  float ball_y() const { return ball_y_; }
  float paddle_y() const { return paddle_y_; }

 private:
  void serve();
  float random_uniform(float low, float high);

  Rules rules_;
  std::mt19937_64 random_;
  float ball_x_ = 0.5f, ball_y_ = 0.5f, ball_vx_ = 0.0f, ball_vy_ = 0.0f;
  float paddle_y_ = 0.5f, opponent_y_ = 0.5f;
  int points_ = 0;
  int ticks_ = 0;
};

// A built-in player for runs without a server: follows the ball (what a trained policy
// learns), or picks uniformly at random (the baseline).
int tracker_action(const Table& table);

}  // namespace pong
