"""The cluster: which kvstored daemons exist and how to reach them (membership through etcd leases,
or a static list). No home-made consensus: etcd decides who is alive."""
