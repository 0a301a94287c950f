"""The ground floor: what ``embodied/``, ``envs/`` and ``policies/`` all import, and which imports
nothing of theirs (docs/architecture.md): name registries, the errors a user can fix, and the
naming of shared-memory segments."""
