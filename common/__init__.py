"""Domain code several services share: spaces, the tensor codec, the weight format, game policy
networks and artifacts, local models and prompt datasets.

It sits between the runtime (``services/``, which knows no domain) and the service packages: it
may import the runtime and the generated contracts, never a service package.
"""
