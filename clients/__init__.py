"""The client modules of every service, one layer below the service packages.

A service reaches another only through these (`clients.env`, `clients.sampler`,
`clients.reward`, `clients.learner`) and `clients.game_link` is the Python SDK a game imports;
they import only the contracts (rlfleet.*), the runtime (services.*) and common.*, so no
service package ever imports another one.
"""
