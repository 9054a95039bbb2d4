"""Code that runs in other processes: the ranks of the torch.distributed tests
(spawned, gloo, loopback only) and the interrupted-and-resumed run of
tests/test_reliability.py. Test modules import these as ``workers.<name>``."""
