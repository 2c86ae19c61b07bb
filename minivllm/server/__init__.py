"""`minivllm serve`: an OpenAI-compatible HTTP server over the shared front end."""
