// rlfleet GameLink for C++: connects a game that owns its loop to a training run.
//
//   rlfleet::GameLinkOptions options;
//   options.game = "pong-cpp";
//   options.env_id = "PongCpp-v0";
//   options.observation_space = rlfleet::spaces::box(-1, 1, {6});
//   options.action_space = rlfleet::spaces::discrete(3);
//   options.num_agents = 8;                       // address: $RLFLEET_GAME_LINK_ADDRESS
//   rlfleet::GameLink link(options);              // Hello -> Welcome (waits for the server)
//   while (running) {                             // once per tick:
//     auto actions = link.act(observations, rewards, terminated, truncated, episode_ids);
//     apply(actions.discrete());                  // one action per agent
//   }
//   rlfleet::Farewell counts = link.close("game over");
//
// The protocol is rlfleet.env.v1.GameLinkService (protos/rlfleet/env/v1/game_link.proto); the
// names match the Python (clients/game_link.py) and TypeScript SDKs. A GameLink is
// used from one thread (the game loop); it is movable, not copyable. gRPC stays out of this
// header: only the generated message types (spaces, tensor trees) appear here.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "rlfleet/common/v1/space.pb.h"
#include "rlfleet/common/v1/tensor.pb.h"
#include "rlfleet/errors.h"
#include "rlfleet/spaces.h"
#include "rlfleet/tensor.h"

namespace rlfleet {

// Environment variables the launcher sets for a game it starts (see the SDK README).
inline constexpr const char* kAddressVariable = "RLFLEET_GAME_LINK_ADDRESS";
inline constexpr const char* kRunVariable = "RLFLEET_RUN";
// The protocol version this SDK speaks (Hello.protocol_version).
inline constexpr std::uint32_t kProtocolVersion = 1;

struct GameLinkOptions {
  // host:port of the env server; empty: $RLFLEET_GAME_LINK_ADDRESS.
  std::string address;
  // Name of the game for logs and dashboards (1 to 128 characters).
  std::string game;
  // Environment id the game offers, e.g. "PongCpp-v0" ([A-Za-z0-9._/-], 1 to 128 characters).
  std::string env_id;
  // Observation and action space of ONE agent (see rlfleet/spaces.h).
  common::v1::Space observation_space;
  common::v1::Space action_space;
  // Agents acting at every tick; the leading dimension of every per-tick array.
  std::uint32_t num_agents = 1;
  // Identifies this game instance across reconnects. Unset: a random key made at construction,
  // so a cut stream resumes. "" turns resuming off.
  std::optional<std::string> session_key;
  // Observations the game may have sent and not yet received actions for; 1 is lock step.
  // The server may grant fewer (see GameLink::max_in_flight()).
  std::uint32_t max_in_flight = 1;
  // Free-form labels on the link's logs and metrics, e.g. {{"build", "1.4.2"}}.
  std::map<std::string, std::string> labels;
  // The run this game expects to join; empty: $RLFLEET_RUN. When both it and the server's run
  // name are known and differ, connecting fails (FAILED_PRECONDITION): wrong address.
  std::string run;
  // How long the first connect waits for the server (a run's game may start before its env
  // server listens), and how long a reconnect keeps trying after the stream breaks.
  std::chrono::milliseconds connect_timeout{60000};
  std::chrono::milliseconds reconnect_timeout{60000};
  // Largest reply accepted, in bytes (image actions are rare; observations are what grows).
  int max_message_bytes = 64 << 20;
  // Where the link reports reconnects and resumes; default: one line on stderr. May be empty.
  std::function<void(const std::string&)> log;
};

// The agents' observations for one tick, shaped [N, ...] like the observation space:
// - a flat std::vector<float> for a float32 Box space (the link adds the shape [N, *box.shape]);
// - a Tensor of any dtype and shape (the link sends it as it is);
// - a TensorTree for Dict/Tuple/Text spaces.
class Observations {
 public:
  Observations(std::vector<float> flat) : value_(std::move(flat)) {}  // NOLINT: implicit on purpose
  Observations(Tensor tensor) : value_(std::move(tensor)) {}          // NOLINT
  Observations(common::v1::TensorTree tree) : value_(std::move(tree)) {}  // NOLINT

  // The wire form for `num_agents` agents of `space` (checks the flat vector's size).
  common::v1::TensorTree to_tree(const common::v1::Space& space, std::uint32_t num_agents) const;

 private:
  std::variant<std::vector<float>, Tensor, common::v1::TensorTree> value_;
};

// The answer to one tick: an action for every agent.
struct Actions {
  std::uint64_t tick = 0;            // the tick these actions answer
  std::int64_t policy_version = 0;   // the policy that chose them
  common::v1::TensorTree actions;    // shaped [N, ...] like the action space

  Tensor tensor() const;                    // the leaf (Box/Discrete/MultiDiscrete action spaces)
  std::vector<std::int64_t> discrete() const;  // integer actions widened to int64, row-major
  std::vector<float> box() const;           // continuous actions as float32, row-major
};

// The answer to Goodbye: what the link did over its life (resumes included).
struct Farewell {
  std::int64_t ticks = 0;
  std::int64_t episodes = 0;
};

class GameLink {
 public:
  // Connects and says Hello; throws GameLinkError when the server refuses (INVALID_ARGUMENT
  // naming the bad field, RESOURCE_EXHAUSTED) or is not reachable within connect_timeout
  // (UNAVAILABLE).
  explicit GameLink(GameLinkOptions options);
  ~GameLink();  // cancels the stream without Goodbye (the server treats it as a disconnect)
  GameLink(GameLink&&) noexcept;
  GameLink& operator=(GameLink&&) noexcept;
  GameLink(const GameLink&) = delete;
  GameLink& operator=(const GameLink&) = delete;

  // Lock step: sends this tick's observations (tick = the last tick sent + 1) and waits for the
  // actions. rewards: float per agent for its previous action; terminated / truncated: the
  // agent's episode ended at this tick; episode_ids: the episode each agent is in (a new id
  // starts a new episode). An in-band error (bad shape, NaN reward) is thrown as GameLinkError
  // and the link stays usable. Nothing may be in flight (use submit/receive for pipelining).
  Actions act(const Observations& observations, const std::vector<float>& rewards,
              const std::vector<bool>& terminated, const std::vector<bool>& truncated,
              const std::vector<std::int64_t>& episode_ids);

  // Pipelining: sends observations for `tick` (strictly increasing; gaps allowed) without
  // waiting. At most max_in_flight() may be outstanding (FAILED_PRECONDITION beyond).
  void submit(std::uint64_t tick, const Observations& observations,
              const std::vector<float>& rewards, const std::vector<bool>& terminated,
              const std::vector<bool>& truncated, const std::vector<std::int64_t>& episode_ids);
  // The actions for the oldest outstanding tick (blocks until they come). Throws that tick's
  // in-band error as GameLinkError (the link stays usable); DATA_LOSS when the server answered
  // the tick but the stream broke before the reply arrived (act on the previous actions).
  Actions receive();

  // Sends Goodbye (outstanding replies are discarded), returns the Farewell counts and ends the
  // stream. The session key is released: the server keeps nothing for a resume.
  Farewell close(const std::string& reason = "");

  // Observations sent and not yet answered.
  std::size_t in_flight() const;
  // What Welcome said (the latest one, after a reconnect).
  const std::string& link_id() const;
  const std::string& session_key() const;
  const std::string& run() const;
  std::uint32_t max_in_flight() const;
  bool resumed() const;           // the latest connect resumed the link
  std::uint64_t last_tick() const;  // Welcome.last_tick of the latest connect
  double resume_window_s() const;
  // The policy version of the latest reply (or Welcome's, before any reply).
  std::int64_t policy_version() const;
  // How often the stream broke and was connected again.
  int reconnects() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlfleet
