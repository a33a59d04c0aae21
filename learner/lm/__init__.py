"""Language-model RL in the learner: trajectory groups in, GRPO-family updates on a DeepSpeed
engine around a transformers causal LM, Hugging Face-named weight versions out."""
