"""KeysManager: the host agent that keeps stage parameters in shared memory and forks replicas from them."""
