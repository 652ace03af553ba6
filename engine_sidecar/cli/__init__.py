"""The `ragcache` command line: one module per concern, the entry point first."""
