// Package gamelink connects a game written in Go to an rlfleet training run: a small client of
// GameLinkService (protos/rlfleet/env/v1/game_link.proto; docs/game_link.md walks through the
// protocol). The message types are generated from protos/ by sdk/go/build.sh (the recipe in
// docs/game_link.md, "Generate a client in another language").
//
// Two levels:
//
//   - Stream: one Connect call with raw ConnectRequest/ConnectResponse messages (each request
//     answered by exactly one response, in order). The contract case runner uses it.
//   - Link: an opened link (Hello answered by Welcome) with Act (lock step), Submit/Receive
//     (pipelining up to Welcome.max_in_flight) and Close (Goodbye answered by Farewell).
//
// In-band errors (the server refused one request; the link stays usable) are *Error values
// with the google.rpc code and the BadRequest field. Unlike the Python, TypeScript and C++
// SDKs this one does not reconnect by itself: on a transport error open a new Link with the
// same Config.SessionKey within Welcome.resume_window_s.
package gamelink

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/golang/protobuf/ptypes"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	commonv1 "rlfleet/gen/go/rlfleet/common/v1"
	envv1 "rlfleet/gen/go/rlfleet/env/v1"
)

// ProtocolVersion is the GameLink protocol version this package speaks (Hello.protocol_version).
const ProtocolVersion = 1

// AddressEnv names the environment variable that carries the env server's GameLink address
// (host:port) for games started by a run.
const AddressEnv = "RLFLEET_GAME_LINK_ADDRESS"

// Error is an in-band error: the server refused one request and the stream stays usable.
type Error struct {
	Code    codes.Code // google.rpc code, e.g. codes.InvalidArgument
	Message string
	Field   string // the BadRequest field, e.g. "observations.rewards"; "" when none
}

func (e *Error) Error() string {
	if e.Field != "" {
		return fmt.Sprintf("%s (%s): %s", e.Code, e.Field, e.Message)
	}
	return fmt.Sprintf("%s: %s", e.Code, e.Message)
}

// ErrorOf turns a response's google.rpc.Status into an *Error (nil for nil).
func ErrorOf(status *statuspb.Status) *Error {
	if status == nil {
		return nil
	}
	e := &Error{Code: codes.Code(status.Code), Message: status.Message}
	for _, detail := range status.Details {
		var bad errdetails.BadRequest
		if ptypes.Is(detail, &bad) && ptypes.UnmarshalAny(detail, &bad) == nil &&
			len(bad.FieldViolations) > 0 {
			e.Field = bad.FieldViolations[0].Field
			break
		}
	}
	return e
}

// Dial connects to an env server's GameLinkService without TLS; address "" means
// $RLFLEET_GAME_LINK_ADDRESS.
func Dial(ctx context.Context, address string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	if address == "" {
		address = os.Getenv(AddressEnv)
		if address == "" {
			return nil, fmt.Errorf("gamelink: no address given and %s is not set", AddressEnv)
		}
	}
	return grpc.DialContext(ctx, address, append([]grpc.DialOption{grpc.WithInsecure()}, opts...)...)
}

// Stream is one Connect call with raw protocol messages.
type Stream struct {
	call   envv1.GameLinkService_ConnectClient
	cancel context.CancelFunc
	nextID uint64
}

// NewStream opens a Connect call on conn; it ends with ctx or Close.
func NewStream(ctx context.Context, conn grpc.ClientConnInterface) (*Stream, error) {
	ctx, cancel := context.WithCancel(ctx)
	call, err := envv1.NewGameLinkServiceClient(conn).Connect(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	return &Stream{call: call, cancel: cancel}, nil
}

// Send sends req with the next request id, which it returns.
func (s *Stream) Send(req *envv1.ConnectRequest) (uint64, error) {
	s.nextID++
	req.RequestId = s.nextID
	return s.nextID, s.call.Send(req)
}

// Recv returns the next response; a gRPC status error when the stream ended.
func (s *Stream) Recv() (*envv1.ConnectResponse, error) { return s.call.Recv() }

// Ask sends req and returns its response (lock step).
func (s *Stream) Ask(req *envv1.ConnectRequest) (*envv1.ConnectResponse, error) {
	id, err := s.Send(req)
	if err != nil {
		return nil, err
	}
	resp, err := s.Recv()
	if err != nil {
		return nil, err
	}
	if resp.RequestId != id {
		return nil, fmt.Errorf("gamelink: response to request %d, expected %d", resp.RequestId, id)
	}
	return resp, nil
}

// Close ends the call without Goodbye (the server keeps a resumable link for its window).
func (s *Stream) Close() {
	_ = s.call.CloseSend()
	s.cancel()
}

// Config says what a game declares in its Hello.
type Config struct {
	Game             string          // e.g. "pong-go"
	EnvID            string          // e.g. "PongGo-v0"
	ObservationSpace *commonv1.Space // of ONE agent (a Box: BoxSpace)
	ActionSpace      *commonv1.Space // of ONE agent (e.g. DiscreteSpace)
	NumAgents        uint32          // N >= 1
	SessionKey       string          // identifies this game instance across reconnects; "" none
	MaxInFlight      uint32          // wished; 0 means 1 (lock step)
	Labels           map[string]string
}

// Hello is the Hello message cfg declares.
func (cfg Config) Hello() *envv1.Hello {
	return &envv1.Hello{
		Game:             cfg.Game,
		EnvId:            cfg.EnvID,
		ObservationSpace: cfg.ObservationSpace,
		ActionSpace:      cfg.ActionSpace,
		NumAgents:        cfg.NumAgents,
		ProtocolVersion:  ProtocolVersion,
		SessionKey:       cfg.SessionKey,
		MaxInFlight:      cfg.MaxInFlight,
		Labels:           cfg.Labels,
	}
}

// Link is an open link: Hello sent and answered by Welcome.
type Link struct {
	stream   *Stream
	welcome  *envv1.Welcome
	inFlight int
}

// Open starts a stream on conn and says Hello; an in-band refusal is an *Error.
func Open(ctx context.Context, conn grpc.ClientConnInterface, cfg Config) (*Link, error) {
	stream, err := NewStream(ctx, conn)
	if err != nil {
		return nil, err
	}
	resp, err := stream.Ask(&envv1.ConnectRequest{Request: &envv1.ConnectRequest_Hello{Hello: cfg.Hello()}})
	if err == nil && resp.Error != nil {
		err = ErrorOf(resp.Error)
	}
	if err == nil && resp.GetWelcome() == nil {
		err = errors.New("gamelink: Hello was not answered with Welcome")
	}
	if err != nil {
		stream.Close()
		return nil, err
	}
	return &Link{stream: stream, welcome: resp.GetWelcome()}, nil
}

// Welcome is the server's answer to Hello: link id, granted max_in_flight, resume state, run,
// and whether a policy is loaded (policy_loaded, policy_version).
func (l *Link) Welcome() *envv1.Welcome { return l.welcome }

// Submit sends one tick's batch without waiting (at most Welcome.max_in_flight unanswered).
func (l *Link) Submit(batch *envv1.ObservationBatch) error {
	if l.inFlight >= int(l.welcome.MaxInFlight) {
		return fmt.Errorf("gamelink: %d batches in flight, the granted max_in_flight: Receive first", l.inFlight)
	}
	if _, err := l.stream.Send(&envv1.ConnectRequest{Request: &envv1.ConnectRequest_Observations{Observations: batch}}); err != nil {
		return err
	}
	l.inFlight++
	return nil
}

// Receive returns the reply to the oldest batch submitted; an in-band refusal is an *Error.
func (l *Link) Receive() (*envv1.ActionReply, error) {
	if l.inFlight == 0 {
		return nil, errors.New("gamelink: nothing in flight")
	}
	resp, err := l.stream.Recv()
	if err != nil {
		return nil, err
	}
	l.inFlight--
	if resp.Error != nil {
		return nil, ErrorOf(resp.Error)
	}
	if resp.GetActions() == nil {
		return nil, errors.New("gamelink: an observation batch was not answered with actions")
	}
	return resp.GetActions(), nil
}

// Act sends one tick's batch and waits for its actions (lock step).
func (l *Link) Act(batch *envv1.ObservationBatch) (*envv1.ActionReply, error) {
	if err := l.Submit(batch); err != nil {
		return nil, err
	}
	return l.Receive()
}

// Close says Goodbye (after the replies still in flight, which it drops) and returns Farewell.
func (l *Link) Close(reason string) (*envv1.Farewell, error) {
	defer l.stream.Close()
	for l.inFlight > 0 {
		if _, err := l.Receive(); err != nil {
			var inBand *Error
			if !errors.As(err, &inBand) {
				return nil, err
			}
		}
	}
	resp, err := l.stream.Ask(&envv1.ConnectRequest{Request: &envv1.ConnectRequest_Goodbye{Goodbye: &envv1.Goodbye{Reason: reason}}})
	if err != nil {
		return nil, err
	}
	if resp.Error != nil {
		return nil, ErrorOf(resp.Error)
	}
	return resp.GetFarewell(), nil
}

// Batch is one tick of N agents with a Box observation of obsShape per agent.
type Batch struct {
	Tick         uint64
	Observations []float32 // N * prod(obsShape), agent-major
	Rewards      []float32 // [N], for each agent's previous action
	Terminated   []bool    // [N]
	Truncated    []bool    // [N]
	EpisodeIDs   []int64   // [N]; a new id starts a new episode
}

// Proto encodes the batch; N is len(b.Rewards).
func (b Batch) Proto(obsShape []int64) *envv1.ObservationBatch {
	n := int64(len(b.Rewards))
	return &envv1.ObservationBatch{
		Tick:         b.Tick,
		Observations: Leaf(Float32Tensor(append([]int64{n}, obsShape...), b.Observations)),
		Rewards:      Float32Tensor([]int64{n}, b.Rewards),
		Terminated:   BoolTensor([]int64{n}, b.Terminated),
		Truncated:    BoolTensor([]int64{n}, b.Truncated),
		EpisodeIds:   Int64Tensor([]int64{n}, b.EpisodeIDs),
	}
}

// DiscreteActions decodes a reply's actions for a Discrete action space: one per agent.
func DiscreteActions(reply *envv1.ActionReply) ([]int64, error) {
	return Int64s(reply.GetActions().GetTensor())
}
