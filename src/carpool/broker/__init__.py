"""The broker: a ZeroMQ ROUTER pair that queues, batches and routes inference requests."""
