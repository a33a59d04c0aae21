"""The sampler service family: game actors (`actors/`), the language-model sampler (`lm/`, over
the generation engines in `engines/`) and rollout drivers (`rollout/`). Other services import
it only through `client.py` (SamplerService's client); otherwise they meet through `rlfleet`
messages."""
