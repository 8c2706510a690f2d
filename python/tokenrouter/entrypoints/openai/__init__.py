"""vLLM's OpenAI entry-point paths (``tokenrouter.entrypoints.openai.run_batch``)."""
