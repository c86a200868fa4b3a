"""The engine: requests in, token/text deltas out; one step = schedule, execute, update."""
