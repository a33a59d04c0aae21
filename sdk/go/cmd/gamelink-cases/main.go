// Command gamelink-cases runs the table-driven GameLink contract cases
// (tests/contract/game_link_cases.json; its "about" says what a case is) against a server:
//
//	gamelink-cases -address 127.0.0.1:50051 -cases tests/contract/game_link_cases.json
//
// Each case opens one Connect stream, sends its steps in order and checks every response's
// result kind or in-band error code and BadRequest field. It prints one line per case ("ok
// <name>" or "FAIL <name>: ...") and a summary, and exits 1 when a case failed.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"rlfleet/sdk/go/gamelink"

	commonv1 "rlfleet/gen/go/rlfleet/common/v1"
	envv1 "rlfleet/gen/go/rlfleet/env/v1"
)

type cases struct {
	Cases []struct {
		Name  string `json:"name"`
		Steps []step `json:"steps"`
	} `json:"cases"`
}

type step struct {
	Hello        map[string]json.RawMessage `json:"hello"`
	Observations *observations              `json:"observations"`
	Goodbye      *struct{}                  `json:"goodbye"`
	Empty        *struct{}                  `json:"empty"`
	Expect       struct {
		Result string  `json:"result"`
		Code   string  `json:"code"`
		Field  *string `json:"field"`
	} `json:"expect"`
}

type observations struct {
	Tick       uint64                    `json:"tick"`
	Terminated []bool                    `json:"terminated"`
	Truncated  []bool                    `json:"truncated"`
	EpisodeIDs []int64                   `json:"episode_ids"`
	Tensor     map[string]tensorOverride `json:"tensor"`
	Omit       []string                  `json:"omit"`
}

type tensorOverride struct {
	Dtype  string        `json:"dtype"`
	Shape  []int64       `json:"shape"`
	Values []interface{} `json:"values"`
}

const numAgents = 2

var obsShape = []int64{3}

func main() {
	address := flag.String("address", os.Getenv(gamelink.AddressEnv), "the env server's GameLink address (host:port)")
	path := flag.String("cases", "tests/contract/game_link_cases.json", "the cases file")
	only := flag.String("run", "", "run only the cases whose name contains this")
	timeout := flag.Duration("timeout", 10*time.Second, "per response")
	ticks := flag.Int("link-ticks", 0, "then play this many ticks through gamelink.Link (pipelined, max_in_flight 2)")
	flag.Parse()

	text, err := os.ReadFile(*path)
	check(err)
	var all cases
	check(json.Unmarshal(text, &all))
	ctx := context.Background()
	conn, err := gamelink.Dial(ctx, *address, grpc.WithBlock())
	check(err)
	defer conn.Close()

	failed, ran := 0, 0
	for _, c := range all.Cases {
		if !strings.Contains(c.Name, *only) {
			continue
		}
		ran++
		if err := runCase(ctx, conn, c.Steps, *timeout); err != nil {
			failed++
			fmt.Printf("FAIL %s: %v\n", c.Name, err)
		} else {
			fmt.Printf("ok %s\n", c.Name)
		}
	}
	fmt.Printf("%d cases, %d failed\n", ran, failed)
	if *ticks > 0 {
		if err := playLink(ctx, conn, *ticks); err != nil {
			failed++
			fmt.Printf("FAIL link: %v\n", err)
		}
	}
	if failed > 0 || ran == 0 {
		os.Exit(1)
	}
}

// playLink plays ticks through the Link API: 2 agents, up to 2 batches in flight, agent 0's
// episode ending every 5 ticks; then Goodbye, whose Farewell must count them.
func playLink(ctx context.Context, conn *grpc.ClientConn, ticks int) error {
	link, err := gamelink.Open(ctx, conn, gamelink.Config{
		Game:             "contract-go",
		EnvID:            "ContractGo-v0",
		ObservationSpace: gamelink.BoxSpace(-1, 1, obsShape...),
		ActionSpace:      gamelink.DiscreteSpace(3),
		NumAgents:        numAgents,
		MaxInFlight:      2,
	})
	if err != nil {
		return err
	}
	w := link.Welcome()
	fmt.Printf("link %s open: max_in_flight %d, policy_loaded %v, policy_version %d\n",
		w.LinkId, w.MaxInFlight, w.PolicyLoaded, w.PolicyVersion)
	ids, ended := []int64{1, 1000}, 0
	received := 0
	receive := func() error {
		reply, err := link.Receive()
		if err != nil {
			return err
		}
		actions, err := gamelink.DiscreteActions(reply)
		if err != nil {
			return err
		}
		if len(actions) != numAgents || actions[0] < 0 || actions[0] > 2 || actions[1] < 0 || actions[1] > 2 {
			return fmt.Errorf("tick %d: actions %v", reply.Tick, actions)
		}
		received++
		if reply.Tick != uint64(received) {
			return fmt.Errorf("reply to tick %d, expected %d", reply.Tick, received)
		}
		return nil
	}
	for tick := 1; tick <= ticks; tick++ {
		done := tick%5 == 0
		batch := gamelink.Batch{
			Tick:         uint64(tick),
			Observations: make([]float32, numAgents*int(obsShape[0])),
			Rewards:      []float32{1, 0},
			Terminated:   []bool{done, false},
			Truncated:    []bool{false, false},
			EpisodeIDs:   append([]int64(nil), ids...),
		}.Proto(obsShape)
		if done {
			ids[0]++
			ended++
		}
		if tick > 2 {
			if err := receive(); err != nil {
				return err
			}
		}
		if err := link.Submit(batch); err != nil {
			return err
		}
	}
	farewell, err := link.Close("contract done")
	if err != nil {
		return err
	}
	if farewell.Ticks != int64(ticks) || farewell.Episodes != int64(ended) {
		return fmt.Errorf("farewell %v: expected %d ticks, %d episodes", farewell, ticks, ended)
	}
	fmt.Printf("link: %d ticks, farewell %d ticks %d episodes\n", ticks, farewell.Ticks, farewell.Episodes)
	return nil
}

func runCase(ctx context.Context, conn *grpc.ClientConn, steps []step, timeout time.Duration) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := gamelink.NewStream(ctx, conn)
	if err != nil {
		return err
	}
	defer stream.Close()
	for i, s := range steps {
		req, err := request(s)
		if err != nil {
			return fmt.Errorf("step %d: %v", i, err)
		}
		resp, err := ask(stream, req, timeout)
		if err != nil {
			return fmt.Errorf("step %d: %v", i, err)
		}
		if err := expect(s, resp); err != nil {
			return fmt.Errorf("step %d: %v", i, err)
		}
	}
	return nil
}

func ask(stream *gamelink.Stream, req *envv1.ConnectRequest, timeout time.Duration) (*envv1.ConnectResponse, error) {
	type answer struct {
		resp *envv1.ConnectResponse
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := stream.Ask(req)
		done <- answer{resp, err}
	}()
	select {
	case a := <-done:
		return a.resp, a.err
	case <-time.After(timeout):
		return nil, fmt.Errorf("no response within %v", timeout)
	}
}

func expect(s step, resp *envv1.ConnectResponse) error {
	result := ""
	switch resp.Result.(type) {
	case *envv1.ConnectResponse_Welcome:
		result = "welcome"
	case *envv1.ConnectResponse_Actions:
		result = "actions"
	case *envv1.ConnectResponse_Farewell:
		result = "farewell"
	}
	if s.Expect.Result != "" {
		if resp.Error != nil {
			return fmt.Errorf("expected %s, got error %v", s.Expect.Result, gamelink.ErrorOf(resp.Error))
		}
		if result != s.Expect.Result {
			return fmt.Errorf("expected %s, got %q", s.Expect.Result, result)
		}
		return nil
	}
	if resp.Error == nil {
		return fmt.Errorf("expected error %s, got %q", s.Expect.Code, result)
	}
	got := gamelink.ErrorOf(resp.Error)
	if want := codeOf(s.Expect.Code); got.Code != want {
		return fmt.Errorf("expected code %s, got %v", s.Expect.Code, got)
	}
	wantField := ""
	if s.Expect.Field != nil {
		wantField = *s.Expect.Field
	}
	if got.Field != wantField {
		return fmt.Errorf("expected field %q, got %v", wantField, got)
	}
	if result != "" {
		return fmt.Errorf("an error response also carries %s", result)
	}
	return nil
}

func codeOf(name string) codes.Code {
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if strings.EqualFold(strings.ReplaceAll(name, "_", ""), c.String()) {
			return c
		}
	}
	panic("unknown code " + name)
}

func request(s step) (*envv1.ConnectRequest, error) {
	switch {
	case s.Hello != nil:
		hello, err := hello(s.Hello)
		return &envv1.ConnectRequest{Request: &envv1.ConnectRequest_Hello{Hello: hello}}, err
	case s.Observations != nil:
		batch, err := batch(s.Observations)
		return &envv1.ConnectRequest{Request: &envv1.ConnectRequest_Observations{Observations: batch}}, err
	case s.Goodbye != nil:
		return &envv1.ConnectRequest{Request: &envv1.ConnectRequest_Goodbye{Goodbye: &envv1.Goodbye{}}}, nil
	case s.Empty != nil:
		return &envv1.ConnectRequest{}, nil
	}
	return nil, fmt.Errorf("a step with nothing to send")
}

// hello is the default Hello (Box(-1, 1, (3,), float32), Discrete(3), 2 agents, version 1)
// with the step's overrides.
func hello(fields map[string]json.RawMessage) (*envv1.Hello, error) {
	cfg := gamelink.Config{
		Game:             "contract",
		EnvID:            "Contract-v0",
		ObservationSpace: gamelink.BoxSpace(-1, 1, obsShape...),
		ActionSpace:      gamelink.DiscreteSpace(3),
		NumAgents:        numAgents,
	}
	h := cfg.Hello()
	for name, raw := range fields {
		var err error
		switch name {
		case "game":
			err = json.Unmarshal(raw, &h.Game)
		case "env_id":
			err = json.Unmarshal(raw, &h.EnvId)
		case "num_agents":
			err = json.Unmarshal(raw, &h.NumAgents)
		case "protocol_version":
			err = json.Unmarshal(raw, &h.ProtocolVersion)
		case "session_key":
			err = json.Unmarshal(raw, &h.SessionKey)
		case "max_in_flight":
			err = json.Unmarshal(raw, &h.MaxInFlight)
		case "observation_space", "action_space":
			var kind string
			if err = json.Unmarshal(raw, &kind); err != nil {
				break
			}
			space := &commonv1.Space{} // "empty": an unset Space
			if kind == "discrete" {
				space = gamelink.DiscreteSpace(3)
			} else if kind != "empty" {
				return nil, fmt.Errorf("hello.%s: unknown space %q", name, kind)
			}
			if name == "observation_space" {
				h.ObservationSpace = space
			} else {
				h.ActionSpace = space
			}
		default:
			return nil, fmt.Errorf("hello: unknown override %q", name)
		}
		if err != nil {
			return nil, fmt.Errorf("hello.%s: %v", name, err)
		}
	}
	return h, nil
}

// batch is a good batch for the step's tick with its flags, episode ids, tensor overrides and
// omissions applied.
func batch(o *observations) (*envv1.ObservationBatch, error) {
	flags := func(values []bool) []bool {
		if values == nil {
			return make([]bool, numAgents)
		}
		return values
	}
	ids := o.EpisodeIDs
	if ids == nil {
		ids = []int64{1, 2}
	}
	msg := gamelink.Batch{
		Tick:         o.Tick,
		Observations: make([]float32, numAgents*int(obsShape[0])),
		Rewards:      make([]float32, numAgents),
		Terminated:   flags(o.Terminated),
		Truncated:    flags(o.Truncated),
		EpisodeIDs:   ids,
	}.Proto(obsShape)
	for name, change := range o.Tensor {
		target := map[string]**commonv1.Tensor{
			"rewards": &msg.Rewards, "terminated": &msg.Terminated,
			"truncated": &msg.Truncated, "episode_ids": &msg.EpisodeIds,
		}
		var old *commonv1.Tensor
		if name == "observations" {
			old = msg.Observations.GetTensor()
		} else if ptr, ok := target[name]; ok {
			old = *ptr
		} else {
			return nil, fmt.Errorf("tensor: unknown %q", name)
		}
		t, err := override(old, change)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %v", name, err)
		}
		if name == "observations" {
			msg.Observations = gamelink.Leaf(t)
		} else {
			*target[name] = t
		}
	}
	for _, name := range o.Omit {
		switch name {
		case "observations":
			msg.Observations = nil
		case "rewards":
			msg.Rewards = nil
		case "terminated":
			msg.Terminated = nil
		case "truncated":
			msg.Truncated = nil
		case "episode_ids":
			msg.EpisodeIds = nil
		default:
			return nil, fmt.Errorf("omit: unknown %q", name)
		}
	}
	return msg, nil
}

var dtypes = map[string]struct {
	code commonv1.DType
	size int
}{
	"float32": {commonv1.DType_D_TYPE_FLOAT32, 4}, "float64": {commonv1.DType_D_TYPE_FLOAT64, 8},
	"int8": {commonv1.DType_D_TYPE_INT8, 1}, "int16": {commonv1.DType_D_TYPE_INT16, 2},
	"int32": {commonv1.DType_D_TYPE_INT32, 4}, "int64": {commonv1.DType_D_TYPE_INT64, 8},
	"uint8": {commonv1.DType_D_TYPE_UINT8, 1}, "bool": {commonv1.DType_D_TYPE_BOOL, 1},
}

// override is a zero tensor of the override's dtype and shape (the old tensor's where unset)
// holding the override's values ("nan", "inf" or numbers) when given.
func override(old *commonv1.Tensor, change tensorOverride) (*commonv1.Tensor, error) {
	shape := old.Shape
	if change.Shape != nil {
		shape = change.Shape
	}
	code, size := old.Dtype, 0
	for name, d := range dtypes {
		if (change.Dtype == "" && d.code == code) || name == change.Dtype {
			code, size = d.code, d.size
		}
	}
	if size == 0 {
		return nil, fmt.Errorf("unsupported dtype %q", change.Dtype)
	}
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	data := make([]byte, int(n)*size)
	for i, raw := range change.Values {
		var v float64
		switch x := raw.(type) {
		case float64:
			v = x
		case string:
			switch x {
			case "nan":
				v = math.NaN()
			case "inf":
				v = math.Inf(1)
			case "-inf":
				v = math.Inf(-1)
			default:
				return nil, fmt.Errorf("value %q", x)
			}
		default:
			return nil, fmt.Errorf("value %v", raw)
		}
		switch code {
		case commonv1.DType_D_TYPE_FLOAT32:
			binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(float32(v)))
		case commonv1.DType_D_TYPE_FLOAT64:
			binary.LittleEndian.PutUint64(data[8*i:], math.Float64bits(v))
		default:
			return nil, fmt.Errorf("values of dtype %v are not supported", code)
		}
	}
	return &commonv1.Tensor{Dtype: code, Shape: shape, Data: data}, nil
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "gamelink-cases:", err)
		os.Exit(2)
	}
}
