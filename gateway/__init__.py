"""The OpenAI-compatible HTTP gateway in front of serving samplers.

``rlfleet serve gateway`` (gateway/service.py) runs a FastAPI app (gateway/app.py) on uvicorn:
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (gateway/openai/), API keys and
rate limits (auth.py, limits.py), Prometheus metrics (metrics.py) and a pool of sampler
replicas reached through ``clients.sampler`` only (backends.py). The `serve` job (jobs.py)
expands a model folder and a replica count into samplers plus this gateway.
"""
