"""Generation engines behind one protocol (base.py): vLLM (vllm_engine.py) and transformers
(hf_engine.py), found by name with base.build_engine."""
