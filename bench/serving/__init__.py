"""Serving: the OpenAI gateway against vLLM's own server, exported and quantized models."""
