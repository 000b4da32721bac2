"""Pieces shared by broker, worker and client: wire protocol, errors, clock, config."""
