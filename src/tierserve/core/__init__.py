"""Shapes every side shares (engine, nodes, router, API, bench): request outputs, sampling
parameters, the cache tiers, L3 admin actions and backend kinds, the transfer protocol, a
model's config. Imports neither torch nor Mooncake nor any other tierserve package."""
