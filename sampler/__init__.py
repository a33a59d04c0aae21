"""The sampler service family: game actors (`actors/`), and later the LLM engines and rollout
drivers. Nothing here is imported by another service; they meet through `rlfleet` messages."""
