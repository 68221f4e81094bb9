"""Load without servers: the one load model (:mod:`.model`) with the tools that run on it (the
demo, the balancing scenario suite), and the synthetic topic traffic of simulated brokers
(:mod:`.traffic`). Pure: no I/O, no clock, no event loop."""
