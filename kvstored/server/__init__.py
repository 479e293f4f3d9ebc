"""gRPC front end of the daemon: servicers, status mapping, process lifecycle."""
