"""The state channel as every sidecar sees it: the follower, the proposer and checkpoints."""
