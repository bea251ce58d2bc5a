"""The ways in: the offline LLM class and the HTTP server."""
