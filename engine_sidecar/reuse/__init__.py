"""The owner of chunk reuse: planning from what the tiers hold, the CP-Tree, in-place and precomputed chunk KV, conversations, and the commit of what a prefill computed."""
