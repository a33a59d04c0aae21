"""The sampler service family: game actors (`actors/`), the language-model sampler (`lm/`, over
the generation engines in `engines/`) and rollout drivers (`rollout/`). Other services reach
it through `clients.sampler` (SamplerService's client) and the bus."""
