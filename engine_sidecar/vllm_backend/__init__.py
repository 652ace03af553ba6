"""ragcache inside vLLM: `connector.RagcacheConnector` is a vLLM v1 KV connector (it imports vLLM
and runs only in vLLM's environment); `params` is the per-request wire format and the token
arithmetic, importable without vLLM."""
