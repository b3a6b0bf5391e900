"""The control plane: the client and peer protocols (no I/O), their msgpack codec, and the zmq and Unix-socket
shells around them: the daemon's server, a client's link to it, the descriptor socket, CURVE keys, peers."""
