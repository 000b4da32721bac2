"""The worker: a ZeroMQ DEALER that runs batches on an engine and returns the results."""
