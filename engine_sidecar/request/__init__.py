"""A request's prompt: assembly by segments, token fingerprints, cache keys, the CA-Table orders."""
