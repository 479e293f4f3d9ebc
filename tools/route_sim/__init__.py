"""Routing evaluation: workloads replayed through the real router and index code over simulated
nodes (``python -m tools.route_sim``)."""
