"""Everything vLLM, in one package. Inside vLLM: `connector.RagcacheConnector` is a vLLM v1 KV
connector (it imports vLLM and runs only in vLLM's environment); `params` is the per-request wire
format and the token arithmetic, importable without vLLM. Beside it: `launch` starts vLLM's
OpenAI server as a child process, and `serve`, `serving`, `layout` and `stats` are the sidecar's
side of `ragcache serve --engine vllm`."""
