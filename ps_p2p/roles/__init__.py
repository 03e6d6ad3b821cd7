"""Roles assembled from the services: user client, model node server, verifier."""
