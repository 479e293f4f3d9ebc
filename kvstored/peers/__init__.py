"""Peers: other kvstored daemons, and the bulk channel that moves blocks between them.

:mod:`kvstored.peers.transport` is mechanism only: it moves bytes by key, checks them and reports
what happened; what to fetch, from whom and where to keep it is decided by its callers.
"""
