"""What a user measures on their own model and machine: `ragcache calibrate` (per-token costs and
the recompute ratio they imply), `ragcache calibrate-temperature` (the attention temperature on
reused chunk KV), and the answer metrics `ragcache check` reports. The benchmark lab (the
checkout's ragcache_lab/, never in the wheel) builds on these; nothing here imports the lab."""
