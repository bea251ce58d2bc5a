"""The APIs beside chat and completions: Anthropic's Messages and OpenAI's Responses, each
turned into the same engine requests as chat; SageMaker's /invocations, answered by chat or completions."""
