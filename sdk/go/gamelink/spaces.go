package gamelink

import commonv1 "rlfleet/gen/go/rlfleet/common/v1"

// BoxSpace is a float32 Box of one agent: every element in [low, high].
func BoxSpace(low, high float32, shape ...int64) *commonv1.Space {
	n := elements(shape)
	lows, highs := make([]float32, n), make([]float32, n)
	for i := range lows {
		lows[i], highs[i] = low, high
	}
	return &commonv1.Space{Kind: &commonv1.Space_Box{Box: &commonv1.BoxSpace{
		Dtype: commonv1.DType_D_TYPE_FLOAT32,
		Shape: shape,
		Low:   Float32Tensor(shape, lows),
		High:  Float32Tensor(shape, highs),
	}}}
}

// DiscreteSpace is Discrete(n): one int64 action in [0, n).
func DiscreteSpace(n int64) *commonv1.Space {
	return &commonv1.Space{Kind: &commonv1.Space_Discrete{Discrete: &commonv1.DiscreteSpace{
		N: n, Dtype: commonv1.DType_D_TYPE_INT64,
	}}}
}
