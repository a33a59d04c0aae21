"""GameLinkService: games that own their loop connect to the env server and ask for actions.

- protocol.py: validation of Hello and ObservationBatch against the declared spaces;
- recorder.py: one link's per-agent transitions -> rollout fragments (common.fragments);
- hub.py: the policy, one batched forward over every waiting observation of every link, and
  the weights it follows (clients.learner.WeightFollower);
- links.py: the links of this server (session keys, resume window, takeover, limits);
- servicer.py: the Connect stream (ordering, pipelining, in-band errors, Goodbye).

docs/game_link.md is the walk-through; the proto (rlfleet/env/v1/game_link.proto) the contract.
"""
