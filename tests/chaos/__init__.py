"""A chaos suite for cluster mode: real nodes, injected faults, a history of what every client saw, and a checker
that reads it and the durable state at the end (docs/chaos.md)."""
