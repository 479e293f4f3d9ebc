"""The one version number of kvstored (daemon, SDK and kvctl)."""

__version__ = "0.1.0"
