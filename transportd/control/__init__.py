"""The control plane: the zmq and Unix-socket shells around the client and peer protocols: the daemon's server,
a client's link to it, the descriptor socket, CURVE keys, peers. The protocols (no I/O) and their msgpack codec
are the contract's (``cmd_ring.protocol``, ``cmd_ring.codec``); ``protocol`` and ``codec`` here are the same
modules under their old names."""
