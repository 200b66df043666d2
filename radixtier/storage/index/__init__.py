"""The prefix index: record encoding, the in-process index and the Redis index."""
