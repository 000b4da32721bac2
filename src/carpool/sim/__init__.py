"""Offline tools: a discrete-event simulator that drives the real BrokerCore, workloads,
policy comparison and tuning (``carpool simulate``, ``carpool tune``)."""
