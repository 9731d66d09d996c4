"""The Gym hand-off contract, at the bottom of the package map: wire models, ids and capture keys,
canonical JSON and digests, error names, stream names.  Imports nothing of the project."""
