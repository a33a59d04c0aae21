package gamelink

import (
	"math"
	"testing"

	commonv1 "rlfleet/gen/go/rlfleet/common/v1"
)

func TestFloat32RoundTrip(t *testing.T) {
	in := []float32{0, -1.5, float32(math.Inf(1)), 3}
	tensor := Float32Tensor([]int64{2, 2}, in)
	if len(tensor.Data) != 16 || tensor.Dtype != commonv1.DType_D_TYPE_FLOAT32 {
		t.Fatalf("encoded %v", tensor)
	}
	out, err := Float32s(tensor)
	if err != nil {
		t.Fatal(err)
	}
	for i := range in {
		if in[i] != out[i] {
			t.Fatalf("element %d: %v != %v", i, in[i], out[i])
		}
	}
}

func TestInt64sSignExtendsNarrowIntegers(t *testing.T) {
	tensor := &commonv1.Tensor{Dtype: commonv1.DType_D_TYPE_INT16, Shape: []int64{2}, Data: []byte{0xfe, 0xff, 0x07, 0x00}}
	out, err := Int64s(tensor)
	if err != nil || out[0] != -2 || out[1] != 7 {
		t.Fatalf("got %v, %v", out, err)
	}
	wide, err := Int64s(Int64Tensor([]int64{3}, []int64{-1, 0, 1 << 40}))
	if err != nil || wide[0] != -1 || wide[2] != 1<<40 {
		t.Fatalf("got %v, %v", wide, err)
	}
	if _, err := Int64s(Float32Tensor([]int64{1}, []float32{1})); err == nil {
		t.Fatal("a float tensor decoded as integers")
	}
	if _, err := Int64s(&commonv1.Tensor{Dtype: commonv1.DType_D_TYPE_INT64, Shape: []int64{2}, Data: make([]byte, 8)}); err == nil {
		t.Fatal("a short tensor decoded")
	}
}

func TestBoolTensorIsOneBytePerElement(t *testing.T) {
	tensor := BoolTensor([]int64{3}, []bool{true, false, true})
	if string(tensor.Data) != "\x01\x00\x01" {
		t.Fatalf("data %q", tensor.Data)
	}
}

func TestBoxSpaceAndBatch(t *testing.T) {
	box := BoxSpace(-1, 1, 3).GetBox()
	lows, _ := Float32s(box.Low)
	if len(lows) != 3 || lows[2] != -1 || box.Dtype != commonv1.DType_D_TYPE_FLOAT32 {
		t.Fatalf("box %v", box)
	}
	batch := Batch{
		Tick:         7,
		Observations: make([]float32, 6),
		Rewards:      []float32{0, 1},
		Terminated:   []bool{false, true},
		Truncated:    []bool{false, false},
		EpisodeIDs:   []int64{1, 2},
	}.Proto([]int64{3})
	if got := batch.Observations.GetTensor().Shape; len(got) != 2 || got[0] != 2 || got[1] != 3 {
		t.Fatalf("observation shape %v", got)
	}
	if batch.Tick != 7 || batch.EpisodeIds.Shape[0] != 2 {
		t.Fatalf("batch %v", batch)
	}
}

func TestErrorOfNil(t *testing.T) {
	if ErrorOf(nil) != nil {
		t.Fatal("nil status is an error")
	}
}
