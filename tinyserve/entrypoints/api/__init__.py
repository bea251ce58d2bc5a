"""The HTTP server: OpenAI- and Anthropic-compatible endpoints, health and metrics."""
