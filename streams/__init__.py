"""Kafka side of dvi: producer, consumer, topics, dead-letter queue, embedded broker launcher."""
