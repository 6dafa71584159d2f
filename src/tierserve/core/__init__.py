"""Shapes every side shares (engine, nodes, router, API, bench): request outputs, sampling
parameters, a request's cache scope, the cache tiers, L3 admin actions and backend kinds, the
transfer protocol, a model's config. Imports neither torch nor Mooncake nor any other tierserve
package."""
