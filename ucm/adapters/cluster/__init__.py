"""What the cluster tiers (mooncake, redis, fs) share: the budget index of
what this instance stored in a shared medium, and the circuit breaker that
stops calling a dead server."""
from ucm.adapters.cluster.breaker import CircuitBreaker
from ucm.adapters.cluster.budget import BudgetedAdapter, ClusterBudget, Reservation

__all__ = ["BudgetedAdapter", "CircuitBreaker", "ClusterBudget", "Reservation"]
