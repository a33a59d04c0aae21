package gamelink

import (
	"encoding/binary"
	"fmt"
	"math"

	commonv1 "rlfleet/gen/go/rlfleet/common/v1"
)

// Float32Tensor encodes values (row-major) as a float32 tensor of the given shape.
func Float32Tensor(shape []int64, values []float32) *commonv1.Tensor {
	data := make([]byte, 4*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(v))
	}
	return &commonv1.Tensor{Dtype: commonv1.DType_D_TYPE_FLOAT32, Shape: shape, Data: data}
}

// Float64Tensor encodes values (row-major) as a float64 tensor of the given shape.
func Float64Tensor(shape []int64, values []float64) *commonv1.Tensor {
	data := make([]byte, 8*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint64(data[8*i:], math.Float64bits(v))
	}
	return &commonv1.Tensor{Dtype: commonv1.DType_D_TYPE_FLOAT64, Shape: shape, Data: data}
}

// Int64Tensor encodes values (row-major) as an int64 tensor of the given shape.
func Int64Tensor(shape []int64, values []int64) *commonv1.Tensor {
	data := make([]byte, 8*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint64(data[8*i:], uint64(v))
	}
	return &commonv1.Tensor{Dtype: commonv1.DType_D_TYPE_INT64, Shape: shape, Data: data}
}

// BoolTensor encodes values (row-major) as a bool tensor (one byte per element).
func BoolTensor(shape []int64, values []bool) *commonv1.Tensor {
	data := make([]byte, len(values))
	for i, v := range values {
		if v {
			data[i] = 1
		}
	}
	return &commonv1.Tensor{Dtype: commonv1.DType_D_TYPE_BOOL, Shape: shape, Data: data}
}

// Leaf wraps one tensor as a TensorTree (the form of observations and actions of a Box or
// Discrete space).
func Leaf(t *commonv1.Tensor) *commonv1.TensorTree {
	return &commonv1.TensorTree{Node: &commonv1.TensorTree_Tensor{Tensor: t}}
}

// Int64s decodes an integer tensor (int8 to int64, uint8 to uint32) into int64 values, e.g.
// the actions of a Discrete or MultiDiscrete space.
func Int64s(t *commonv1.Tensor) ([]int64, error) {
	if t == nil {
		return nil, fmt.Errorf("gamelink: no tensor")
	}
	size, signed := 0, true
	switch t.Dtype {
	case commonv1.DType_D_TYPE_INT8:
		size = 1
	case commonv1.DType_D_TYPE_UINT8:
		size, signed = 1, false
	case commonv1.DType_D_TYPE_INT16:
		size = 2
	case commonv1.DType_D_TYPE_UINT16:
		size, signed = 2, false
	case commonv1.DType_D_TYPE_INT32:
		size = 4
	case commonv1.DType_D_TYPE_UINT32:
		size, signed = 4, false
	case commonv1.DType_D_TYPE_INT64:
		size = 8
	default:
		return nil, fmt.Errorf("gamelink: %v is not an integer dtype", t.Dtype)
	}
	if len(t.Data)%size != 0 || int64(len(t.Data)/size) != elements(t.Shape) {
		return nil, fmt.Errorf("gamelink: %d bytes do not hold shape %v of %v", len(t.Data), t.Shape, t.Dtype)
	}
	out := make([]int64, len(t.Data)/size)
	for i := range out {
		b := t.Data[i*size : (i+1)*size]
		var u uint64
		for j := size - 1; j >= 0; j-- {
			u = u<<8 | uint64(b[j])
		}
		if signed && size < 8 && u&(1<<(8*size-1)) != 0 {
			u |= ^uint64(0) << (8 * size) // sign-extend
		}
		out[i] = int64(u)
	}
	return out, nil
}

// Float32s decodes a float32 tensor, e.g. the actions of a Box space.
func Float32s(t *commonv1.Tensor) ([]float32, error) {
	if t == nil || t.Dtype != commonv1.DType_D_TYPE_FLOAT32 {
		return nil, fmt.Errorf("gamelink: not a float32 tensor")
	}
	if int64(len(t.Data)) != 4*elements(t.Shape) {
		return nil, fmt.Errorf("gamelink: %d bytes do not hold float32 %v", len(t.Data), t.Shape)
	}
	out := make([]float32, len(t.Data)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
	}
	return out, nil
}

func elements(shape []int64) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	return n
}
