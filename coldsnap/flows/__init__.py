"""Flows: the operations as plain sequences over the parts. One implementation, used by CLI, shim and hooks."""
