"""A serving replica composed from the core library: `replica` (engine, queue, hot swaps, metrics, handed its
channels) and `api` (the OpenAI-compatible HTTP face). Nothing here builds Kafka or MLflow clients."""
