"""Tensor parallelism: the Mapping, shard math, collectives and the handshake, process launch."""
