"""Test and benchmark helpers: an in-process network of real hosts (:mod:`~ps_p2p.testing.
localnet`), fakes (an instant engine, a vLLM server) and the protocol fuzzer
(:mod:`~ps_p2p.testing.fuzz`)."""
