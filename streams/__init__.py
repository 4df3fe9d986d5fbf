"""Kafka side of dvi: the decision producer and consumer (with the dead-letter path), topics, the control topic's
transport, the client options, and the embedded broker's launcher. The payloads' shapes are `dvi.records` and
`dvi.control`; nothing here knows models, training or HTTP."""
